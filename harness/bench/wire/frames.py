"""Section ``frames``: raw socket throughput against WIIIIIDE frame throughput, per frame size and codec.

For each size, trials are interleaved (every raw variant of `RAW_VARIANTS`, iperf3 when it is there,
then each codec, `repeats` times, each repeat starting one trial further on: `trial_orders`) so each
ratio compares figures taken side by side; each timed raw or frames trial follows an untimed warm-up
trial of the same kind (`WARMUP_FRACTION`). Throughput is payload (raw tensor) bytes delivered per
second, counted from the first byte sent to the sink's acknowledgement of the last frame (iperf3: its
receiver's bytes over its data phase's seconds).

The raw reference of a size is the raw variant with the highest median there (`raw.py` says what each
variant does); the frames' ``vs_raw`` compares each repeat with that variant's figure of the same repeat.

Two figures tell where frames lose time against the raw loops. Every trial records the CPU seconds the
source and the sink processes spent on it (user + system, `time.process_time`) per second of the trial: the
side near 1.0 binds. And ``none/prebuilt`` sends one uncompressed frame, encoded once before the trial,
`count` times: the frames' bytes, send path and reader without the sender's per-frame encode.
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from harness.bench.wire.channel import read_ack, send_control
from harness.bench.wire.iperf import Iperf3Error, run_client
from harness.bench.wire.payloads import payload_of
from harness.bench.wire.raw import RAW_CHUNK_BYTES, RAW_VARIANTS, RawVariant, send_raw
from wiiide.codecs import codec_from_name
from wiiide.codecs.chunked import CodecPool
from wiiide.units import MIB
from wiiide.wire.encode import encode_message
from wiiide.wire.messages import WireTensor
from wiiide.wire.reader import FrameReader
from wiiide.wire.send import send_frames

MIN_COUNT, MAX_COUNT = 2, 4096  # messages per trial
# Each timed trial (raw variant or frames) follows an untimed one of the same kind, 1/8 as long: the same
# frames trial run twice in a row in one repeat gave 0.90x / 0.86x of the raw loop in its first slot and
# 1.08x / 0.96x in the second (loopback, two runs, 2026-11-23), so the order of the trials was part of the
# ratios. Between two containers the warm-up changed little (0.66x first slot, 0.73x second, with it).
WARMUP_FRACTION = 1 / 8


class Trial(NamedTuple):
    """One timed trial: `seconds` from the first byte sent to the sink's ack; the CPU seconds (user +
    system) the source process (`source_cpu_s`) and the sink process (`sink_cpu_s`, from its ack) spent
    meanwhile; the sink's decode seconds and the wire bytes of one frame (frames trials; 0 for raw ones)."""

    seconds: float
    source_cpu_s: float
    sink_cpu_s: float
    sink_decode_s: float = 0.0
    wire_nbytes: int = 0


def raw_trial(sock: socket.socket, reader: FrameReader, buf: memoryview, count: int,
              variant: RawVariant = RAW_VARIANTS[0], chunk_bytes: int = RAW_CHUNK_BYTES) -> Trial:
    """Move `count` x `buf` (bytes) the `variant` way and get the sink's ack.

    `chunk_bytes`: the sink's recv size of the ``chunk`` and ``scratch`` receivers (bytes).

    Raises:
        OSError, ConnectionError: the connection failed or the sink answered something else.
    """
    send_control(sock, "trial", mode="raw", count=count, size=buf.nbytes, recv=variant.recv,
                 chunk_bytes=chunk_bytes)
    t0, cpu0 = time.perf_counter(), time.process_time()
    send_raw(sock, buf, count, variant.send)
    meta = read_ack(reader)
    return Trial(time.perf_counter() - t0, time.process_time() - cpu0, float(meta.get("cpu_s", 0.0)))


def frame_trial(sock: socket.socket, reader: FrameReader, payload: np.ndarray, count: int, codec_name: str,
                pool: CodecPool, frame_reader: str = "whole", prebuilt: bool = False) -> Trial:
    """`count` gradient frames of `payload` (float32), each encoded with `codec_name` as it is sent, read
    by the sink's `frame_reader` (``whole`` or ``exact``, `harness.bench.wire.plan.FRAME_READERS`).
    `prebuilt`: one frame encoded before the clock starts, sent `count` times (no encode in the trial).

    Raises:
        ValueError: unknown codec name. OSError, ConnectionError: as `raw_trial`.
    """
    codec = codec_from_name(codec_name)
    send_control(sock, "trial", mode="frames", count=count, size=payload.nbytes, reader=frame_reader)
    frame = encode_message("gradients", {"step": 0}, [WireTensor("grad", payload)], codec, pool) if prebuilt else None
    t0, cpu0 = time.perf_counter(), time.process_time()
    wire_bytes = 0
    for _ in range(count):
        if not prebuilt:
            frame = encode_message("gradients", {"step": 0}, [WireTensor("grad", payload)], codec, pool)
        wire_bytes = send_frames(sock, [frame])
    meta = read_ack(reader)
    return Trial(time.perf_counter() - t0, time.process_time() - cpu0, float(meta.get("cpu_s", 0.0)),
                 float(meta.get("decode_s", 0.0)), wire_bytes)


def trial_orders(kinds: int, repeats: int) -> list[list[int]]:
    """The order of the `kinds` trials (indices 0..kinds-1) in each of `repeats` repeats: repeat r starts at
    kind r mod `kinds` and goes round (0 1 2, 1 2 0, 2 0 1, ...), so that over `kinds` repeats every kind
    runs once in every slot. With one fixed order, whatever a slot does to its trial (the one right after
    iperf3, say) fell on the same kind in every repeat and could not be told from the kind's own speed:
    before 2026-11-25 (commit aaeaba4) the uncompressed frames always ran right after iperf3."""
    return [[(r + k) % kinds for k in range(kinds)] for r in range(repeats)]


def warmup_count(count: int) -> int:
    """Messages of the untimed trial that precedes each timed one: `count` x `WARMUP_FRACTION`, at least
    `MIN_COUNT`."""
    return max(MIN_COUNT, int(count * WARMUP_FRACTION))


def trial_count(size_bytes: int, bytes_per_trial: int) -> int:
    """Messages per raw / uncompressed trial: `bytes_per_trial` // `size_bytes`, within [2, 4096]."""
    return max(MIN_COUNT, min(MAX_COUNT, bytes_per_trial // size_bytes))


def _stats(values: list[float]) -> dict[str, Any]:
    return {"bytes_per_s": values, "bytes_per_s_median": statistics.median(values)}


def _add_cpu(entry: dict[str, Any], trial: Trial) -> None:
    """Append `trial`'s CPU seconds per second of the trial, source and sink, to `entry`'s lists."""
    entry.setdefault("source_cpu_per_s", []).append(trial.source_cpu_s / trial.seconds)
    entry.setdefault("sink_cpu_per_s", []).append(trial.sink_cpu_s / trial.seconds)


def frames_section(sock: socket.socket, reader: FrameReader, grad: np.ndarray, sizes_bytes: Sequence[int],
                   codecs: Sequence[str], repeats: int, bytes_per_trial: int, pool: CodecPool,
                   progress: Callable[[str], None], chunk_bytes: int = RAW_CHUNK_BYTES,
                   iperf3_host: str | None = None, iperf3_port: int | None = None,
                   frame_readers: Sequence[str] = ("whole",)) -> list[dict[str, Any]]:
    """One row per size: every raw variant's, iperf3's and each codec's throughput of every repeat, and ratios.

    Each row: ``size_bytes``, ``count_per_trial``, ``raw_variants`` (variant name -> ``bytes_per_s``
    list and ``bytes_per_s_median``), ``raw_variant`` (the fastest by median: the raw reference),
    ``raw_bytes_per_s`` (its list, one per repeat) and ``raw_bytes_per_s_median``; ``iperf3``
    (``bytes_per_s`` list and median, ``retransmits`` and ``figure`` lists, see `iperf.parse_result`, or
    ``unavailable`` with the reason);
    ``frames[codec]`` with ``bytes_per_s`` (list), ``bytes_per_s_median``, ``wire_nbytes`` (one frame
    on the wire), ``sink_decode_s`` (list), ``vs_raw_per_repeat`` (frame / raw of the same repeat),
    ``vs_raw`` (their median: robust to load that comes and goes between repeats), and, with iperf3,
    ``vs_iperf3_per_repeat`` and ``vs_iperf3``. Every raw variant and frames entry also has
    ``source_cpu_per_s`` and ``sink_cpu_per_s`` (lists: each process's CPU seconds per second of the
    trial). Compressed codecs move a quarter of the uncompressed trial's messages (at least 2).
    `chunk_bytes` is the sink's recv size of the chunked raw receivers (`RAW_CHUNK_BYTES`);
    iperf3 runs against ``iperf3_host``:``iperf3_port`` (None: not measured). The sink reads with
    `frame_readers`[0] (``whole`` or ``exact``); each further reader also reads the uncompressed frames,
    in the same repeats, reported as ``frames["none/<reader>"]``. With ``none`` among `codecs`,
    ``frames["none/prebuilt"]`` is the uncompressed frame encoded once and sent `count` times (see the
    module's docstring).

    Raises:
        OSError, ConnectionError: the connection failed.
    """
    from harness.bench.wire.iperf import IPERF3_PORT

    rows = []
    for size in sizes_bytes:
        payload = payload_of(size, grad)
        raw = memoryview(payload).cast("B")
        count = trial_count(size, bytes_per_trial)
        raw_entries: dict[str, dict[str, Any]] = {v.name: {"bytes_per_s": []} for v in RAW_VARIANTS}
        iperf3: dict[str, Any] = ({"bytes_per_s": [], "retransmits": [], "figure": []} if iperf3_host
                                  else {"unavailable": "not asked for"})
        trials = [(c, c, frame_readers[0], False) for c in codecs]  # (report key, codec, sink reader, prebuilt)
        trials += [(f"none/{r}", "none", r, False) for r in frame_readers[1:] if "none" in codecs]
        trials += [("none/prebuilt", "none", frame_readers[0], True)] if "none" in codecs else []
        row: dict[str, Any] = {"size_bytes": size, "count_per_trial": count,
                               "frames": {key: {"bytes_per_s": [], "wire_nbytes": None, "sink_decode_s": []}
                                          for key, _, _, _ in trials}}
        # every kind of trial of a repeat, in their listed order: the raw variants, iperf3, the frames trials
        kinds = [("raw", v) for v in RAW_VARIANTS] + [("iperf3", None)] + [("frames", t) for t in trials]
        warmup = warmup_count(count)
        for order in trial_orders(len(kinds), repeats):
            for kind, item in (kinds[i] for i in order):  # each repeat from another start
                if kind == "raw":
                    raw_trial(sock, reader, raw, warmup, item, chunk_bytes)  # untimed: see WARMUP_FRACTION
                    trial = raw_trial(sock, reader, raw, count, item, chunk_bytes)
                    entry = raw_entries[item.name]
                    entry["bytes_per_s"].append(count * size / trial.seconds)
                    _add_cpu(entry, trial)
                elif kind == "iperf3":
                    if "unavailable" in iperf3:
                        continue
                    try:
                        result = run_client(iperf3_host, count * size, iperf3_port or IPERF3_PORT)
                        iperf3["bytes_per_s"].append(result["bytes_per_s"])
                        iperf3["retransmits"].append(result["retransmits"])
                        iperf3["figure"].append(result["figure"])
                        iperf3["version"] = result["version"]
                    except Iperf3Error as exc:
                        iperf3 = {"unavailable": str(exc)}
                else:
                    key, c, frame_reader, prebuilt = item
                    n = count if c == "none" else max(MIN_COUNT, count // 4)
                    frame_trial(sock, reader, payload, warmup_count(n), c, pool, frame_reader, prebuilt)  # untimed
                    trial = frame_trial(sock, reader, payload, n, c, pool, frame_reader, prebuilt)
                    entry = row["frames"][key]
                    entry["bytes_per_s"].append(n * size / trial.seconds)
                    entry["sink_decode_s"].append(trial.sink_decode_s)
                    entry["wire_nbytes"] = trial.wire_nbytes
                    _add_cpu(entry, trial)
        row["raw_variants"] = {name: {**_stats(e["bytes_per_s"]), **e} for name, e in raw_entries.items()}
        best = max(row["raw_variants"], key=lambda name: row["raw_variants"][name]["bytes_per_s_median"])
        row["raw_variant"] = best
        row["raw_bytes_per_s"] = row["raw_variants"][best]["bytes_per_s"]
        row["raw_bytes_per_s_median"] = row["raw_variants"][best]["bytes_per_s_median"]
        if "unavailable" not in iperf3:
            iperf3["bytes_per_s_median"] = statistics.median(iperf3["bytes_per_s"])
        row["iperf3"] = iperf3
        for entry in row["frames"].values():
            entry["bytes_per_s_median"] = statistics.median(entry["bytes_per_s"])
            entry["vs_raw_per_repeat"] = [f / r for f, r in zip(entry["bytes_per_s"], row["raw_bytes_per_s"])]
            entry["vs_raw"] = statistics.median(entry["vs_raw_per_repeat"])
            if "unavailable" not in iperf3:
                entry["vs_iperf3_per_repeat"] = [f / r for f, r in zip(entry["bytes_per_s"], iperf3["bytes_per_s"])]
                entry["vs_iperf3"] = statistics.median(entry["vs_iperf3_per_repeat"])
        rows.append(row)
        none = row["frames"].get("none", {})
        ref = (f", iperf3 {iperf3['bytes_per_s_median'] / 1e6:8.0f} MB/s" if "unavailable" not in iperf3 else "")
        progress(f"  {size / MIB:8.3f} MiB: raw {row['raw_bytes_per_s_median'] / 1e6:8.0f} MB/s ({best}){ref}, "
                 f"none frames {none.get('bytes_per_s_median', 0) / 1e6:8.0f} MB/s ({none.get('vs_raw', 0):.3f}x)")
    return rows
