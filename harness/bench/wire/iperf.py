"""iperf3 between the same two peers: the physical reference of the frames section.

The sink starts ``iperf3 --server`` next to itself (`start_server`); the source runs one client per
frames trial (`run_client`: ``iperf3 --client HOST --bytes N --window 8M --json``, the frames'
socket buffers) interleaved with the raw and
frame trials, so every ratio compares figures taken side by side. The figure kept is the receiver's:
``end.sum_received`` ``bytes`` / ``seconds`` of iperf3's JSON (``-J``), never its text.

iperf3 is Debian's package (in the node image, see docker/Dockerfile); where the binary is missing
(a local run on a host without it) the section records ``unavailable`` with the reason instead.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from typing import Any

from harness.bench.wire.channel import SOCKET_BUFFER_BYTES

IPERF3 = "iperf3"
IPERF3_PORT = 29612  # next to bench-wire's own PORT
CLIENT_TIMEOUT_S = 120.0
CONNECT_RETRIES = 20  # the server may still be starting: retried every 0.25 s
RETRY_SLEEP_S = 0.25


class Iperf3Error(RuntimeError):
    """iperf3 failed or printed JSON without the received totals; the message holds its error."""


def iperf3_path() -> str | None:
    """The iperf3 binary on PATH, or None."""
    return shutil.which(IPERF3)


def start_server(port: int = IPERF3_PORT) -> subprocess.Popen | None:
    """Start ``iperf3 --server --port PORT`` (serves clients one after the other until killed);
    None when iperf3 is not installed. The caller stops it (`stop_server`).

    Raises:
        OSError: iperf3 exists but could not be started.
    """
    path = iperf3_path()
    if path is None:
        return None
    return subprocess.Popen([path, "--server", "--port", str(port)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_server(proc: subprocess.Popen | None) -> None:
    """Terminate the server `start_server` returned (no-op for None) and reap it."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def parse_result(text: str) -> dict[str, Any]:
    """The receiver's totals from iperf3's ``--json`` output.

    Returns:
        ``bytes`` (received), ``seconds`` (of the data phase), ``bytes_per_s`` (their quotient),
        ``figure`` (``receiver``; ``sender``, from ``end.sum_sent``, when iperf3 reports no received
        bytes, as it does for transfers of a few MB), ``retransmits`` (the sender's, None when iperf3
        does not report them) and ``version``.

    Raises:
        Iperf3Error: not JSON, an ``error`` member (iperf3's own message), or neither positive
        ``end.sum_received`` nor ``end.sum_sent`` bytes and seconds.
    """
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise Iperf3Error(f"iperf3 printed no JSON ({exc}): {text[:300]!r}") from None
    if not isinstance(doc, dict):
        raise Iperf3Error(f"iperf3 JSON is not an object: {text[:300]!r}")
    if doc.get("error"):
        raise Iperf3Error(f"iperf3: {doc['error']}")
    end = doc.get("end", {}) if isinstance(doc.get("end"), dict) else {}
    sent = end.get("sum_sent", {}) if isinstance(end.get("sum_sent"), dict) else {}
    figure = "receiver"
    for side in ("sum_received", "sum_sent"):
        totals = end.get(side, {}) if isinstance(end.get(side), dict) else {}
        nbytes, seconds = totals.get("bytes"), totals.get("seconds")
        if isinstance(nbytes, (int, float)) and isinstance(seconds, (int, float)) and nbytes > 0 and seconds > 0:
            break
        figure = "sender"  # a transfer of a few MB can end before the server's totals are in: iperf3 says 0
    else:
        raise Iperf3Error(f"iperf3 JSON has no received or sent totals (end = {end!r:.200})")
    return {"bytes": int(nbytes), "seconds": float(seconds), "bytes_per_s": nbytes / seconds, "figure": figure,
            "retransmits": sent.get("retransmits"), "version": doc.get("start", {}).get("version")}


def run_client(host: str, nbytes: int, port: int = IPERF3_PORT) -> dict[str, Any]:
    """One iperf3 client moving `nbytes` bytes to the server on `host`:`port`; `parse_result` of its JSON.

    Retries a refused connection (the server starting) `CONNECT_RETRIES` times.

    Raises:
        Iperf3Error: iperf3 is missing, failed, or printed no usable JSON.
    """
    path = iperf3_path()
    if path is None:
        raise Iperf3Error("iperf3 is not installed (Debian: apt-get install iperf3; the node image has it)")
    # the same socket buffers as the raw loops and the frames (channel.SOCKET_BUFFER_BYTES, 8 MiB)
    argv = [path, "--client", host, "--port", str(port), "--bytes", str(nbytes), "--window",
            str(SOCKET_BUFFER_BYTES), "--json"]
    for attempt in range(CONNECT_RETRIES):
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise Iperf3Error(f"{' '.join(argv)} did not finish in {CLIENT_TIMEOUT_S:.0f} s") from None
        try:
            return parse_result(done.stdout)
        except Iperf3Error as exc:
            busy = "connect" in str(exc).lower() or "busy" in str(exc).lower()
            if not busy or attempt == CONNECT_RETRIES - 1:
                raise
            time.sleep(RETRY_SLEEP_S)
    raise AssertionError("unreachable")
