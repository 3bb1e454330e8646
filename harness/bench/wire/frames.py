"""Section ``frames``: raw socket throughput against WIIIIIDE frame throughput, per frame size and codec.

For each size, trials are interleaved (raw, then each codec, `repeats` times) so each ratio compares
figures taken side by side. Throughput is payload (raw tensor) bytes delivered per second, counted from
the first byte sent to the sink's acknowledgement of the last frame.
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np

from harness.bench.wire.channel import read_ack, send_control
from harness.bench.wire.payloads import payload_of
from wiiide.codecs import codec_from_name
from wiiide.codecs.chunked import CodecPool
from wiiide.protocol import FrameReader, WireTensor, encode_message, send_frames
from wiiide.units import MIB

MIN_COUNT, MAX_COUNT = 2, 4096  # messages per trial


def raw_trial(sock: socket.socket, reader: FrameReader, buf: memoryview, count: int) -> float:
    """Seconds to move `count` x `buf` (bytes) with `sendall` and get the sink's ack.

    Raises:
        OSError, ConnectionError: the connection failed or the sink answered something else.
    """
    send_control(sock, "trial", mode="raw", count=count, size=buf.nbytes)
    t0 = time.perf_counter()
    for _ in range(count):
        sock.sendall(buf)
    read_ack(reader)
    return time.perf_counter() - t0


def frame_trial(sock: socket.socket, reader: FrameReader, payload: np.ndarray, count: int, codec_name: str,
                pool: CodecPool) -> tuple[float, float, int]:
    """`count` gradient frames of `payload` (float32), each encoded with `codec_name` as it is sent.

    Returns:
        (seconds from the first byte to the sink's ack, the sink's decode seconds, wire bytes of one frame).

    Raises:
        ValueError: unknown codec name. OSError, ConnectionError: as `raw_trial`.
    """
    codec = codec_from_name(codec_name)
    send_control(sock, "trial", mode="frames", count=count, size=payload.nbytes)
    t0 = time.perf_counter()
    wire_bytes = 0
    for _ in range(count):
        frame = encode_message("gradients", {"step": 0}, [WireTensor("grad", payload)], codec, pool)
        wire_bytes = send_frames(sock, [frame])
    meta = read_ack(reader)
    return time.perf_counter() - t0, float(meta.get("decode_s", 0.0)), wire_bytes


def trial_count(size_bytes: int, bytes_per_trial: int) -> int:
    """Messages per raw / uncompressed trial: `bytes_per_trial` // `size_bytes`, within [2, 4096]."""
    return max(MIN_COUNT, min(MAX_COUNT, bytes_per_trial // size_bytes))


def frames_section(sock: socket.socket, reader: FrameReader, grad: np.ndarray, sizes_bytes: Sequence[int],
                   codecs: Sequence[str], repeats: int, bytes_per_trial: int, pool: CodecPool,
                   progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """One row per size: raw and per-codec throughput of every repeat, and frame / raw ratios.

    Each row: ``size_bytes``, ``count_per_trial``, ``raw_bytes_per_s`` (list, one per repeat) and its
    ``raw_bytes_per_s_median``, and ``frames[codec]`` with ``bytes_per_s`` (list), ``bytes_per_s_median``,
    ``wire_nbytes`` (one frame on the wire), ``sink_decode_s`` (list), ``vs_raw_per_repeat`` (frame / raw
    of the same repeat) and ``vs_raw`` (their median: robust to load that comes and goes between repeats).
    Compressed codecs move a quarter of the uncompressed trial's messages (at least 2).

    Raises:
        OSError, ConnectionError: the connection failed.
    """
    rows = []
    for size in sizes_bytes:
        payload = payload_of(size, grad)
        raw = memoryview(payload).cast("B")
        count = trial_count(size, bytes_per_trial)
        row: dict[str, Any] = {"size_bytes": size, "count_per_trial": count, "raw_bytes_per_s": [],
                               "frames": {c: {"bytes_per_s": [], "wire_nbytes": None, "sink_decode_s": []}
                                          for c in codecs}}
        for _ in range(repeats):
            row["raw_bytes_per_s"].append(count * size / raw_trial(sock, reader, raw, count))
            for c in codecs:
                n = count if c == "none" else max(MIN_COUNT, count // 4)
                seconds, decode_s, wire_bytes = frame_trial(sock, reader, payload, n, c, pool)
                entry = row["frames"][c]
                entry["bytes_per_s"].append(n * size / seconds)
                entry["sink_decode_s"].append(decode_s)
                entry["wire_nbytes"] = wire_bytes
        row["raw_bytes_per_s_median"] = statistics.median(row["raw_bytes_per_s"])
        for entry in row["frames"].values():
            entry["bytes_per_s_median"] = statistics.median(entry["bytes_per_s"])
            entry["vs_raw_per_repeat"] = [f / r for f, r in zip(entry["bytes_per_s"], row["raw_bytes_per_s"])]
            entry["vs_raw"] = statistics.median(entry["vs_raw_per_repeat"])
        rows.append(row)
        none = row["frames"].get("none", {})
        progress(f"  {size / MIB:8.3f} MiB: raw {row['raw_bytes_per_s_median'] / 1e6:8.0f} MB/s, none frames "
                 f"{none.get('bytes_per_s_median', 0) / 1e6:8.0f} MB/s ({none.get('vs_raw', 0):.3f}x)")
    return rows
