"""Section ``codecs``: each codec's ratio and encode / decode speed on real gradients, in process (no socket)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np

from wiiide.codecs import codec_from_name
from wiiide.codecs.chunked import CodecPool
from wiiide.units import MIB
from wiiide.wire.decode import decode_payload, parse_header
from wiiide.wire.encode import encode_message
from wiiide.wire.format import PREFIX, PREFIX_NBYTES
from wiiide.wire.messages import WireTensor

CHUNK_BYTES = MIB  # parallel chunks of the codec pool
BUDGET_S = 6.0  # per (gradient, codec, threads): slow codecs on the big gradient get fewer repeats


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def codec_table(grads: dict[str, np.ndarray], codec_names: Sequence[str], threads: Sequence[int], repeats: int,
                progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Ratio and encode / decode speed of each codec on each gradient, per thread count.

    Thread counts above 1 apply only to lossless codecs that release the GIL. Up to `repeats`
    measurements each, fewer once `BUDGET_S` seconds have passed.

    Args:
        grads: name -> flat float32 gradient.
        codec_names: codec names (`wiiide.codecs.codec_from_name`).
        threads: codec pool thread counts.

    Returns:
        One row per (gradient, codec, threads): ``gradient``, ``raw_nbytes`` (bytes), ``codec``,
        ``lossless``, ``threads``, ``ratio`` (raw bytes / payload bytes on the wire), ``encode_bytes_per_s``
        and ``decode_bytes_per_s`` (raw bytes per second, one per repeat; an encode entry is None when the
        encoder reported no time) and their ``*_median``.

    Raises:
        ValueError: unknown codec name.
    """
    rows = []
    for gname, g in grads.items():
        for name in codec_names:
            for nthreads in threads:
                codec = codec_from_name(name)
                if nthreads > 1 and not (codec.lossless and codec.releases_gil):
                    continue
                pool = CodecPool(nthreads, CHUNK_BYTES)
                enc: list[float | None] = []
                dec: list[float] = []
                ratio = None
                deadline = time.perf_counter() + BUDGET_S
                try:
                    for _ in range(repeats):
                        frame = encode_message("gradients", {}, [WireTensor("grad", g)], codec, pool)
                        data = b"".join(memoryview(b) for b in frame.buffers)
                        header_nbytes = PREFIX.unpack_from(data)[3]  # magic, version, flags, header, payload
                        header = parse_header(data[PREFIX_NBYTES:PREFIX_NBYTES + header_nbytes], 1 << 31)
                        t0 = time.perf_counter()
                        decode_payload(header, memoryview(data)[PREFIX_NBYTES + header_nbytes:], pool)
                        dec.append(g.nbytes / (time.perf_counter() - t0))
                        enc.append(g.nbytes / frame.encode_s if frame.encode_s else None)
                        ratio = frame.raw_nbytes / frame.payload_nbytes
                        if time.perf_counter() > deadline:
                            break
                finally:
                    pool.close()
                row = {"gradient": gname, "raw_nbytes": int(g.nbytes), "codec": name, "lossless": codec.lossless,
                       "threads": nthreads, "ratio": ratio, "encode_bytes_per_s": enc, "decode_bytes_per_s": dec,
                       "encode_bytes_per_s_median": _median(enc), "decode_bytes_per_s_median": _median(dec)}
                rows.append(row)
                progress(f"  codec {name:>13} x{nthreads} on {gname}: ratio {ratio:.3f}, encode "
                         f"{(row['encode_bytes_per_s_median'] or 0) / 1e6:.0f} MB/s, decode "
                         f"{row['decode_bytes_per_s_median'] / 1e6:.0f} MB/s")
    return rows
