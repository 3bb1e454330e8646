"""Parallel chunked (de)compression of large lossless payloads on a thread pool.

A payload of at least two chunks (`chunk_bytes`, default 1 MiB) encoded by a codec that releases
the GIL (zlib, zstd, lz4, blosc2) is cut into chunks encoded in parallel on `threads` threads; each
chunk is an independent stream of that codec and the chunk table travels in the header's
``codec_params`` as ``{"chunks": [[raw_nbytes, wire_nbytes], ...]}``. The encoded chunks go to
``sendmsg`` as separate buffers (no join). The receiver checks the table against the declared sizes
before decoding anything, decodes each chunk bounded by its own declared size, in parallel, straight
into one output buffer.

The pool is passed in, never global: a node's `wiiide.codecs.policy.CompressionPolicy` owns one and
hands it to its frame readers (`wiiide.wire.reader.FrameReader(pool=...)`); without a pool every chunk
is done in the calling thread.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from wiiide.codecs.base import Buffer, Codec, check_params
from wiiide.errors import ProtocolError
from wiiide.wire.format import byte_view

MAX_CHUNKS = 65536
MIN_CHUNK_BYTES = 64 * 1024


class CodecPool:
    """A thread pool for chunked codec work.

    Args:
        threads: worker threads (1: chunks, if any, are done in the calling thread).
        chunk_bytes: raw bytes per chunk (rounded down to a multiple of 8, so no element is split).

    Raises:
        ValueError: fewer than 1 thread or chunks under `MIN_CHUNK_BYTES` (64 KiB).
    """

    def __init__(self, threads: int = 1, chunk_bytes: int = 1024 * 1024) -> None:
        if threads < 1:
            raise ValueError(f"codec threads must be >= 1, got {threads}")
        if chunk_bytes < MIN_CHUNK_BYTES:
            raise ValueError(f"codec chunk must be >= {MIN_CHUNK_BYTES} bytes, got {chunk_bytes}")
        self.threads = threads
        self.chunk_bytes = chunk_bytes - chunk_bytes % 8
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="codec") if threads > 1 else None

    def map(self, fn, items: Sequence[Any]) -> list[Any]:
        """``[fn(item) for item in items]``, on the pool's threads when it has more than one."""
        if self._executor is None or len(items) < 2:
            return [fn(item) for item in items]
        return list(self._executor.map(fn, items))

    def close(self) -> None:
        """Stop the threads (without waiting for queued work); the pool must not be used afterwards."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)


def common_itemsize(arrays: Sequence[np.ndarray]) -> int:
    """The element size shared by every array, 1 when they differ (shuffling then does nothing useful)."""
    sizes = {a.dtype.itemsize for a in arrays}
    return sizes.pop() if len(sizes) == 1 else 1


def encode_bytes(codec: Codec, arrays: Sequence[np.ndarray], pool: CodecPool | None
                 ) -> tuple[list[Buffer], dict[str, Any]]:
    """Encode the arrays' bytes (any dtypes, C-contiguous) with a lossless `codec`.

    Returns (payload buffers in order, codec_params): one buffer and ``{}``, or, when the payload is at
    least two of `pool`'s chunks (or above the codec's own ``MAX_CHUNK_BYTES``), one buffer per chunk
    and the chunk table ``{"chunks": [[raw_nbytes, wire_nbytes], ...]}``.
    """
    views = [byte_view(a) for a in arrays if a.nbytes]
    raw_nbytes = sum(v.nbytes for v in views)
    if raw_nbytes == 0:
        return [], {}
    itemsize = common_itemsize(arrays)
    joined = views[0] if len(views) == 1 else memoryview(b"".join(views))
    limit = getattr(codec, "MAX_CHUNK_BYTES", None)
    chunk_bytes = pool.chunk_bytes if pool is not None else None
    parallel = pool is not None and pool.threads > 1 and codec.releases_gil and raw_nbytes >= 2 * pool.chunk_bytes
    if not parallel and (limit is None or raw_nbytes <= limit):
        return [codec.encode(joined, itemsize)], {}
    chunk_bytes = chunk_bytes if parallel else limit - limit % 8
    chunks = [joined[i:i + chunk_bytes] for i in range(0, raw_nbytes, chunk_bytes)]
    parts = (pool.map if parallel else lambda f, xs: [f(x) for x in xs])(lambda c: codec.encode(c, itemsize), chunks)
    return parts, {"chunks": [[c.nbytes, len(p)] for c, p in zip(chunks, parts)]}


def decode_bytes(codec: Codec, wire: memoryview, raw_nbytes: int, params: dict[str, Any],
                 pool: CodecPool | None) -> Buffer:
    """Decode a lossless payload, chunked or not, into exactly `raw_nbytes` bytes (chunks on `pool`).

    Raises:
        ProtocolError: codec_params other than a valid chunk table, a table that does not add up to
            the declared sizes, or a chunk that decodes to another size than its entry says.
    """
    check_params(codec.wire_id, params, {"chunks"})
    table = params.get("chunks")
    if table is None:
        return codec.decode(wire, raw_nbytes)
    if not isinstance(table, list) or not 1 <= len(table) <= MAX_CHUNKS:
        raise ProtocolError(f"codec {codec.wire_id!r}: 'chunks' must be a list of 1..{MAX_CHUNKS} entries")
    spans, raw_at, wire_at = [], 0, 0
    for entry in table:
        if (not isinstance(entry, list) or len(entry) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in entry)):
            raise ProtocolError(f"codec {codec.wire_id!r}: each chunk must be [raw_nbytes, wire_nbytes] > 0")
        spans.append((raw_at, entry[0], wire_at, entry[1]))
        raw_at += entry[0]
        wire_at += entry[1]
    if raw_at != raw_nbytes or wire_at != wire.nbytes:
        raise ProtocolError(f"codec {codec.wire_id!r}: chunks add up to {raw_at} raw / {wire_at} wire bytes, "
                            f"the header declares {raw_nbytes} / the payload has {wire.nbytes}")
    out = np.empty(raw_nbytes, dtype=np.uint8)

    def one(span: tuple[int, int, int, int]) -> None:
        r0, rn, w0, wn = span
        decoded = codec.decode(wire[w0:w0 + wn], rn)  # bounded by this chunk's declared size
        out[r0:r0 + rn] = np.frombuffer(decoded, dtype=np.uint8)

    (pool or CodecPool(1)).map(one, spans)
    return memoryview(out)


def default_threads() -> int:
    """Codec threads when the config says 0: the cores this process may use, at most 4."""
    try:
        return max(1, min(4, len(os.sched_getaffinity(0))))
    except (AttributeError, OSError):
        return 1
