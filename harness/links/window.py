"""The measured read-back of what a socket buffer lets one TCP flow carry on a link with delay: a bulk
flow from worker 1 to the coordinator with the point's ``SO_SNDBUF`` / ``SO_RCVBUF`` (the sizes the
training's connections ask for), run right after the round-trip probe (`harness.links.rtt`).

The sink counts the bytes it receives from `WARMUP_S` after the first byte (slow start and BBR's
startup are over by then at the round trips studied here) to `WARMUP_S + MEASURE_S`, and prints the
throughput over that span with the buffers as the kernel set them (``getsockopt``, which reports twice
the request, socket(7)) and the TCP sysctls of its network namespace that decide how much of a buffer
TCP gives the data (``tcp_adv_win_scale``, ``tcp_rmem``, ``tcp_wmem``; ip-sysctl.rst). The report keeps
it as ``links.window_probe``; `harness.analysis.window_model` compares it with min(rate, window / RTT).
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

PORT = 5032
WARMUP_S = 1.5
MEASURE_S = 2.5
CONNECT_TIMEOUT_S = 15.0
SYSCTLS = ("net/ipv4/tcp_adv_win_scale", "net/ipv4/tcp_rmem", "net/ipv4/tcp_wmem", "net/core/rmem_max",
           "net/core/wmem_max")

# Sink: argv port, sndbuf, rcvbuf (bytes, 0: kernel default), warm-up s, measure s, accept timeout s.
SINK = """
import json, socket, sys, time
port, snd, rcv, warm, span, timeout = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
if rcv: s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcv)
if snd: s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, snd)
s.bind(("0.0.0.0", port)); s.listen(1); s.settimeout(timeout)
c, _ = s.accept(); c.settimeout(30)
buf = bytearray(1 << 20); view = memoryview(buf); first = None; counted = 0
while True:
    n = c.recv_into(view)
    if not n:
        sys.exit("the source closed before the measurement ended")
    now = time.perf_counter()
    if first is None:
        first = now
    if now - first >= warm + span:
        break
    if now - first >= warm:
        counted += n
try:  # the kernel's own account of this connection (iproute2's ss): rb = SO_RCVBUF, rcv_ssthresh = its window bound
    import subprocess
    ss = subprocess.run(["ss", "-tmiH", "sport", "=", ":%d" % port], capture_output=True, text=True, timeout=5).stdout
except (OSError, subprocess.SubprocessError):
    ss = ""
sysctls = {}
for key in sys.argv[7:]:
    try:
        sysctls[key.replace("/", ".")] = open("/proc/sys/" + key).read().split()
    except OSError:
        sysctls[key.replace("/", ".")] = None
print(json.dumps({"throughput_bps": counted * 8 / span, "measured_s": span, "warmup_s": warm,
                  "rcvbuf_bytes": c.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF), "sysctls": sysctls,
                  "receiver_ss": ss[-600:]}))
c.close()
"""
# Source: argv host, port, sndbuf, rcvbuf, connect timeout s; sends until the sink closes; prints its sndbuf.
SOURCE = """
import json, socket, sys, time
host, port, snd, rcv, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
deadline = time.monotonic() + timeout
while True:
    c = socket.socket()
    if snd: c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, snd)
    if rcv: c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcv)
    try:
        c.settimeout(5); c.connect((host, port)); break
    except OSError:
        c.close()
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
c.settimeout(30); block = bytes(1 << 20)
try:
    while True:
        c.sendall(block)
except OSError:
    pass
print(json.dumps({"sndbuf_bytes": c.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)}))
"""


def receiver_window_bytes(ss_text: str) -> int | None:
    """The receiver's window bound from its ``ss -tmi`` line: ``rcv_ssthresh`` (the most it advertises,
    which a bulk flow grows to ``window_clamp``, the kernel's data share of ``rb``); None when absent."""
    found = re.search(r"\brcv_ssthresh:(\d+)", ss_text or "")
    return int(found.group(1)) if found else None


def parse_output(sink_text: str, source_text: str) -> dict[str, Any]:
    """The sink's and the source's JSON lines -> ``throughput_bps``, ``measured_s``, ``warmup_s``,
    ``sndbuf_bytes`` (the source's, read back), ``rcvbuf_bytes`` (the sink's), ``sysctls`` (key ->
    list of fields as text, None where unreadable), ``receiver_ss`` (the sink's ``ss -tmi`` text) and
    ``receiver_window_bytes`` (`receiver_window_bytes` of it).

    Raises:
        ValueError: either printed no JSON object, or the throughput is not a number >= 0.
    """
    out: dict[str, Any] = {}
    for text, who in ((sink_text, "sink"), (source_text, "source")):
        try:
            data = json.loads(text.strip().splitlines()[-1] if text.strip() else "")
        except (json.JSONDecodeError, IndexError) as exc:
            raise ValueError(f"the window probe's {who} printed no JSON ({exc}): {text[-200:]!r}") from None
        if not isinstance(data, dict):
            raise ValueError(f"the window probe's {who} printed {text[-200:]!r}, not a JSON object")
        out.update(data)
    out["receiver_window_bytes"] = receiver_window_bytes(str(out.get("receiver_ss") or ""))
    rate = out.get("throughput_bps")
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or rate < 0:
        raise ValueError(f"the window probe's throughput is not a number >= 0: {rate!r}")
    return out


def measure_window(server, client, server_host: str, sndbuf_bytes: int, rcvbuf_bytes: int,
                   port: int = PORT) -> dict[str, Any]:
    """One bulk TCP flow from `client` to `server` (docker SDK containers; `server_host` is the server's
    name on their network), both ends asking for `sndbuf_bytes` / `rcvbuf_bytes` (0: the kernel's
    autotuning). Returns `parse_output`'s record plus ``sndbuf_requested_bytes`` and
    ``rcvbuf_requested_bytes``; takes about ``WARMUP_S + MEASURE_S`` seconds plus a round trip.

    Raises:
        RuntimeError: the sink failed (with its output), or either end printed no JSON.
    """
    result: dict[str, Any] = {}
    buffers = [str(int(sndbuf_bytes)), str(int(rcvbuf_bytes))]

    def source() -> None:
        result["source"] = client.exec_run(["python", "-c", SOURCE, server_host, str(port), *buffers,
                                            str(CONNECT_TIMEOUT_S)], demux=True)

    thread = threading.Thread(target=source, daemon=True)
    thread.start()
    code, output = server.exec_run(["python", "-c", SINK, str(port), *buffers, str(WARMUP_S), str(MEASURE_S),
                                    str(CONNECT_TIMEOUT_S), *SYSCTLS], demux=True)
    thread.join(timeout=CONNECT_TIMEOUT_S + 60)
    out, err = output if isinstance(output, tuple) else (output, b"")
    text = (out or b"").decode(errors="replace")
    if code != 0:
        raise RuntimeError(f"window probe to {server_host}:{port} failed (exit {code}): "
                           f"{(err or b'').decode(errors='replace')[-300:] or text[-300:]}")
    _, source_output = result.get("source") or (None, (b"", b""))
    source_out = source_output[0] if isinstance(source_output, tuple) else source_output
    try:
        record = parse_output(text, (source_out or b"").decode(errors="replace"))
    except ValueError as exc:
        raise RuntimeError(str(exc)) from None
    return {"sndbuf_requested_bytes": int(sndbuf_bytes), "rcvbuf_requested_bytes": int(rcvbuf_bytes), **record}
