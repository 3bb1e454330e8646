"""The measured read-back of a link's delay: a TCP round-trip probe between two containers (there is no
``ping`` in the node image, and ICMP would not take TCP's path through the delay line anyway).

One container echoes, the other sends small messages (`MESSAGE_BYTES`, ``TCP_NODELAY`` on both sides,
one message in flight) and times each round trip with ``time.perf_counter``; the first
`WARMUP_SAMPLES` (connection set-up, cold caches) are left out. Each message and its echo is one
segment each way, carrying the other side's ACK, so a round trip crosses each container's delay once
(netem: each egress; the delay line: each arrival).

`summarize` gives median and p99 (nearest rank) in milliseconds beside the round trip asked
(`asked_rtt_ms`); `measure_rtt` runs the two ends through the Engine API (``python -c`` of the fixed
scripts below: no shell; the echo refuses anything but whole messages of the agreed size).
"""

from __future__ import annotations

import json
import math
import threading
from typing import Any, Callable, Sequence

from harness.spec.links import LinkProfile

PORT = 5031
MESSAGE_BYTES = 64
WARMUP_SAMPLES = 3
BUDGET_S = 2.0  # a probe's time in a run: the number of round trips is chosen to take about this long
MIN_SAMPLES, MAX_SAMPLES = 20, 200
CONNECT_TIMEOUT_S = 15.0

# Echo: one connection; echo whole MESSAGE_BYTES messages until the peer closes, then exit 0.
SERVE = """
import socket, sys
size = int(sys.argv[2])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); s.settimeout(float(sys.argv[3]))
c, _ = s.accept(); c.settimeout(60); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    msg = b""
    while len(msg) < size:
        part = c.recv(size - len(msg))
        if not part:
            break
        msg += part
    if len(msg) < size:
        sys.exit(0 if not msg else 3)
    c.sendall(msg)
"""
# Ping: connect (retrying while the echo starts), argv[3] round trips of argv[4] bytes; prints JSON.
PING = """
import json, socket, sys, time
host, port, count, size, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
deadline = time.monotonic() + timeout
while True:
    try:
        c = socket.create_connection((host, port), timeout=5); break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); c.settimeout(60)
msg = bytes(range(256)) * (size // 256) + bytes(size % 256); out = []
for _ in range(count):
    t0 = time.perf_counter(); c.sendall(msg); got = 0
    while got < size:
        part = c.recv(size - got)
        if not part:
            sys.exit("the echo closed the connection")
        got += len(part)
    out.append((time.perf_counter() - t0) * 1000)
c.close()
print(json.dumps({"rtt_ms": out}))
"""


def one_way_ms(profile: LinkProfile | None) -> float:
    """The delay a packet arriving at (delay line) or leaving (netem) a container shaped by `profile` is
    held, in ms: the profile's delay, twice with ``ingress`` (both directions shaped). 0 for None."""
    if profile is None:
        return 0.0
    return profile.delay_ms * (2 if profile.ingress else 1)


def asked_rtt_ms(a: LinkProfile | None, b: LinkProfile | None) -> float:
    """The round trip asked between two containers shaped by `a` and `b` (ms): the sum of their one-way
    delays (`one_way_ms`); the jitter's mean is 0 for every distribution of netem's."""
    return round(one_way_ms(a) + one_way_ms(b), 6)


def probe_count(asked_ms: float, budget_s: float = BUDGET_S) -> int:
    """How many round trips fit `budget_s` at `asked_ms` each, within `MIN_SAMPLES`..`MAX_SAMPLES`
    (plus the warm-up ones)."""
    fit = int(budget_s * 1000 / max(asked_ms, 0.1))
    return max(MIN_SAMPLES, min(MAX_SAMPLES, fit)) + WARMUP_SAMPLES


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """The `q`-quantile (0 < q <= 1) of sorted values by the nearest-rank method (value at rank
    ceil(q n)). Raises ValueError on an empty sequence."""
    if not sorted_values:
        raise ValueError("no values")
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def summarize(samples_ms: Sequence[float], asked_ms: float | None = None) -> dict[str, Any]:
    """Round trips (ms, in the order measured; the first `WARMUP_SAMPLES` are dropped) -> ``samples``,
    ``median_rtt_ms``, ``p99_rtt_ms`` (nearest rank), ``min_rtt_ms``, ``max_rtt_ms`` and, with
    `asked_ms`, ``asked_rtt_ms`` and ``median_error_ms`` (median - asked).

    Raises:
        ValueError: no sample is left after the warm-up, or a sample is not a finite number >= 0.
    """
    kept = list(samples_ms[WARMUP_SAMPLES:])
    if not kept:
        raise ValueError(f"no round trip left after the {WARMUP_SAMPLES} warm-up ones")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in kept):
        raise ValueError("a round trip that is not a finite number of ms >= 0")
    values = sorted(kept)
    n = len(values)
    median = values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
    out: dict[str, Any] = {"samples": n, "median_rtt_ms": round(median, 4),
                           "p99_rtt_ms": round(nearest_rank(values, 0.99), 4),
                           "min_rtt_ms": round(values[0], 4), "max_rtt_ms": round(values[-1], 4)}
    if asked_ms is not None:
        out.update(asked_rtt_ms=asked_ms, median_error_ms=round(median - asked_ms, 4))
    return out


def parse_ping_output(text: str) -> list[float]:
    """The ping's JSON line -> its round trips in ms.

    Raises:
        ValueError: not the ping's JSON (an object with a list ``rtt_ms`` of numbers).
    """
    try:
        data = json.loads(text.strip().splitlines()[-1] if text.strip() else "")
    except (json.JSONDecodeError, IndexError) as exc:
        raise ValueError(f"the round-trip probe printed no JSON ({exc}): {text[-200:]!r}") from None
    samples = data.get("rtt_ms") if isinstance(data, dict) else None
    if not isinstance(samples, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                for v in samples):
        raise ValueError(f"the round-trip probe's JSON has no list of numbers rtt_ms: {text[-200:]!r}")
    return [float(v) for v in samples]


def measure_rtt(server, client, server_host: str, count: int, port: int = PORT,
                size_bytes: int = MESSAGE_BYTES) -> list[float]:
    """`count` TCP round trips from `client` to `server` (docker SDK containers; `server_host` is the
    server's name on their network), in ms, in the order measured.

    Raises:
        RuntimeError: either end failed (with its output), or the ping printed no round trips.
    """
    result: dict[str, Any] = {}

    def serve() -> None:
        result["serve"] = server.exec_run(["python", "-c", SERVE, str(port), str(size_bytes),
                                           str(CONNECT_TIMEOUT_S)], demux=True)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    code, output = client.exec_run(["python", "-c", PING, server_host, str(port), str(count), str(size_bytes),
                                    str(CONNECT_TIMEOUT_S)], demux=True)
    thread.join(timeout=CONNECT_TIMEOUT_S + 60)
    out, err = output if isinstance(output, tuple) else (output, b"")
    text = (out or b"").decode(errors="replace")
    if code != 0:
        raise RuntimeError(f"round-trip probe to {server_host}:{port} failed (exit {code}): "
                           f"{(err or b'').decode(errors='replace')[-300:] or text[-300:]}")
    try:
        return parse_ping_output(text)
    except ValueError as exc:
        raise RuntimeError(str(exc)) from None


def measure_unshaped(server, client, server_host: str, round_trips: int,
                     progress: Callable[[str], None]) -> dict[str, Any]:
    """The ping-pong with nothing in its path (the caller has removed every shaping): `round_trips`
    round trips after the warm-up, `summarize`d, and one progress line with the median and p99 (ms).
    Every shaped round trip carries this one, its tail included. Raises as `measure_rtt` does."""
    summary = summarize(measure_rtt(server, client, server_host, round_trips + WARMUP_SAMPLES), 0.0)
    progress(f"[bench-link] unshaped round trip: median {summary['median_rtt_ms']:.3f} ms, "
             f"p99 {summary['p99_rtt_ms']:.3f} ms")
    return summary
