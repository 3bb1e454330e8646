"""Section ``links``: synchronous gradient round trips through a paced sender, per rate and policy.

Each message is one gradient out and the sink's ack back, as a worker waits for its parameters; the
sender is a `PacedSocket` at each rate (0 = the plain socket, unpaced).
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np

from harness.bench.wire.channel import read_ack, send_control
from harness.bench.wire.paced import PacedSocket
from wiiide.codecs.policy import CompressionPolicy
from wiiide.wire.messages import WireTensor
from wiiide.wire.reader import FrameReader
from wiiide.wire.send import send_frames

PROBE_EVERY = 20  # network-aware's probe interval here (messages)


def links_section(sock: socket.socket, reader: FrameReader, grad: np.ndarray, rates_bps: Sequence[float],
                  policies: Sequence[str], messages: int, pool_threads: int,
                  progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Per rate, `messages` synchronous round trips per policy.

    The policies take turns message by message in a shuffled order each round (seeded), so a burst of
    load on a shared machine hits them all alike and no policy always follows the same one (seed's
    45 ms of zlib leaves cold caches).

    Args:
        grad: the float32 gradient sent every message.
        rates_bps: link rates in bit/s; 0 = unpaced. ``network-aware`` is told the rate.
        policies: compression policy names.
        messages: round trips per policy and rate.
        pool_threads: each policy's codec threads.

    Returns:
        One row per (rate, policy): ``policy``, ``rate_bps`` (None when unpaced), ``message_s`` (seconds
        per round trip, every message), ``codecs_used`` (codec -> messages), ``message_s_median``,
        ``message_s_mean``, ``message_s_p25`` (s), ``goodput_bytes_per_s`` (gradient bytes over the
        sum of round-trip times) and ``decisions`` (the policy's reasons record).

    Raises:
        ValueError: unknown policy. OSError, ConnectionError: the connection failed.
    """
    rows = []
    tensors = [WireTensor("grad", grad)]
    for rate in rates_bps:
        target = PacedSocket(sock, rate) if rate else sock
        runs = [{"policy": name, "rate_bps": rate or None, "message_s": [], "codecs_used": {},
                 "_p": CompressionPolicy(name, link_bandwidth_bps=rate or 0, codec_threads=pool_threads,
                                         probe_every=PROBE_EVERY)} for name in policies]
        send_control(sock, "trial", mode="roundtrip", count=messages * len(runs), size=grad.nbytes)
        rng = np.random.default_rng(0)
        for _ in range(messages):
            for i in rng.permutation(len(runs)):
                run = runs[i]
                t0 = time.perf_counter()
                frame = run["_p"].encode("gradients", {"step": 0}, tensors)
                send_frames(target, [frame])
                read_ack(reader)
                run["message_s"].append(time.perf_counter() - t0)
                run["codecs_used"][frame.codec] = run["codecs_used"].get(frame.codec, 0) + 1
        read_ack(reader)
        for run in runs:
            policy = run.pop("_p")
            policy.close()
            times = run["message_s"]
            run.update({"message_s_median": statistics.median(times), "message_s_mean": statistics.fmean(times),
                        "message_s_p25": float(np.quantile(times, 0.25)),
                        "goodput_bytes_per_s": grad.nbytes * len(times) / sum(times),
                        "decisions": policy.record.get("reasons")})
            rows.append(run)
            label = f"{rate / 1e6:.0f} Mbit/s" if rate else "unpaced"
            progress(f"  link {label:>12} {run['policy']:>20}: median {run['message_s_median'] * 1e3:7.2f} "
                     f"ms/message, codecs {run['codecs_used']}")
    return rows
