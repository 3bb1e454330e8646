"""Socket options of the seeds (001/002/004 ``configure_socket``), from config, with read-back.

The kernel doubles a requested SO_SNDBUF/SO_RCVBUF (to leave room for its bookkeeping) and caps the
request at ``net.core.wmem_max`` / ``rmem_max`` (socket(7)), so the effective size is read back with
getsockopt and recorded: a run that asked for 16 MiB may have got far less.
"""

from __future__ import annotations

import json
import math
import socket
import ssl
import struct
import subprocess
from typing import Any

from wiiide.config import RunConfig


AUTO_CONGESTION = "reno"  # shard_tcp_congestion auto: the loss-based algorithm any process may set


def shard_congestion(cfg: RunConfig) -> str:
    """The congestion control for the sharded servers' connections (pushes and pulls), for
    `configure_socket`'s `congestion`: ``shard_tcp_congestion`` if it names one; with ``''`` or
    ``auto`` and ``tcp_congestion`` set, that; ``auto`` with neither: ``auto`` (`AUTO_CONGESTION` where
    this process may set it, else the system's); ``''`` with neither: ``''`` (the system's)."""
    choice = cfg.shard_tcp_congestion
    if choice not in ("", "auto"):
        return choice
    return cfg.tcp_congestion or choice


def set_io_timeout(sock: Any, timeout_s: float) -> None:
    """Bound each receive and each send on `sock` to `timeout_s` seconds (> 0) without a byte moving.

    On a kernel socket the bound is the kernel's (socket(7) SO_RCVTIMEO and SO_SNDTIMEO) and the socket
    stays blocking (Python's timeout None). A Python timeout (`socket.settimeout`) makes the socket
    non-blocking and puts a `poll` before every `recv_into` and `sendmsg` (CPython's sock_call_ex), and a
    non-blocking `sendmsg` of a 1 MiB frame returns each time the send buffer fills: 5 `sendmsg` and 10
    `poll` per 1 MiB frame over a socketpair where the raw loop makes one `sendmsg`. With the kernel's
    bound a frame costs the raw loop's calls. A call that times out fails with EAGAIN;
    `wiiide.wire.reader` and `wiiide.wire.send` raise it as `socket.timeout`, as before. TLS sockets
    (`ssl.SSLSocket`, `wiiide.wire.tls_stream.TLSStream`) and sockets without the options get
    `settimeout(timeout_s)`.

    Raises:
        OSError: from setsockopt.
    """
    if (type(sock) is socket.socket and not isinstance(sock, ssl.SSLSocket) and hasattr(socket, "SO_RCVTIMEO")
            and sock.type == socket.SOCK_STREAM):
        usec_total = max(1, math.ceil(timeout_s * 1e6))
        timeval = struct.pack("ll", usec_total // 1_000_000, usec_total % 1_000_000)  # struct timeval
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        return
    sock.settimeout(timeout_s)


def congestion_of(sock: socket.socket) -> str | None:
    """The congestion control a TCP socket runs (tcp(7) TCP_CONGESTION); None where the platform has none."""
    if not hasattr(socket, "TCP_CONGESTION"):
        return None
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0", 1)[0].decode()


def configure_socket(sock: socket.socket, cfg: RunConfig, congestion: str | None = None) -> dict[str, Any]:
    """Apply buffer sizes and TCP options; return what is in force, read back with getsockopt.

    `congestion`: the congestion control instead of ``cfg.tcp_congestion`` (None: that one); ``auto``
    tries `AUTO_CONGESTION` and keeps the system's where the kernel refuses it (net.ipv4.
    tcp_allowed_congestion_control) or the platform has no TCP_CONGESTION (`shard_congestion`).

    Returns a dict with ``sndbuf_bytes``/``rcvbuf_bytes`` (effective), the requested sizes,
    ``tcp_nodelay``, ``tcp_quickack`` (None where the platform has no TCP_QUICKACK), ``keepalive`` and
    ``tcp_congestion`` (the congestion control in force, tcp(7) TCP_CONGESTION; None where the platform
    has none). Raises OSError from setsockopt (``tcp_congestion`` not available or not allowed: its message
    names the algorithm and net.ipv4.tcp_available_congestion_control).
    """
    if cfg.sndbuf_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg.sndbuf_bytes)
    if cfg.rcvbuf_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, cfg.rcvbuf_bytes)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, int(cfg.tcp_nodelay))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, int(cfg.keepalive))
    quickack = None
    if hasattr(socket, "TCP_QUICKACK"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, int(cfg.tcp_quickack))
        quickack = bool(cfg.tcp_quickack)
    wanted = cfg.tcp_congestion if congestion is None else congestion
    in_force = None
    if hasattr(socket, "TCP_CONGESTION"):
        if wanted:
            name = AUTO_CONGESTION if wanted == "auto" else wanted
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode("ascii"))
            except OSError as exc:
                if wanted != "auto":  # auto where it is not allowed: the system's stays
                    raise OSError(exc.errno, f"tcp_congestion {wanted!r}: {exc.strerror} (see "
                                             "net.ipv4.tcp_available_congestion_control)") from None
        in_force = congestion_of(sock)
    elif wanted and wanted != "auto":
        raise OSError(f"tcp_congestion {wanted!r}: this platform has no TCP_CONGESTION")
    return {
        "sndbuf_requested_bytes": cfg.sndbuf_bytes,
        "rcvbuf_requested_bytes": cfg.rcvbuf_bytes,
        "sndbuf_bytes": sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
        "rcvbuf_bytes": sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
        "tcp_nodelay": bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)),
        "tcp_quickack": quickack,
        "keepalive": bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)),
        "tcp_congestion": in_force,
    }


def set_route_congestion(congestion: str, run: Any = None) -> list[str]:
    """Set `congestion` (a tcp(7) congestion control, e.g. ``cubic``) on every route of this network
    namespace that leaves through an interface other than loopback (ip-route(8) ``congctl``): every TCP
    connection opened over them afterwards starts with it, also those of sockets this process does not
    configure (gloo's, for the ddp and fsdp engines, where `configure_socket` cannot reach). Routes are read
    with ``ip -j route show`` (JSON) and each changed in place, its other attributes kept.

    Needs CAP_NET_ADMIN in the namespace (the harness's containers have it). `run`: `subprocess.run`
    (tests pass a stand-in).

    Returns:
        The destinations changed (``ip``'s ``dst``, e.g. ``172.18.0.0/16`` or ``default``).
    Raises:
        OSError: no ``ip`` command, or ``ip`` refused a change (its message, e.g. "Operation not
            permitted" without CAP_NET_ADMIN, or an unknown algorithm).
    """
    run = run or subprocess.run

    def ip(*argv: str) -> str:
        try:
            done = run(["ip", *argv], capture_output=True, text=True, timeout=10.0)
        except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
            raise OSError(f"tcp_congestion {congestion!r} on the routes: ip {' '.join(argv)}: {exc}") from None
        if done.returncode != 0:
            raise OSError(f"tcp_congestion {congestion!r} on the routes: ip {' '.join(argv)}: "
                          f"{(done.stderr or done.stdout).strip()[:300]}")
        return done.stdout

    try:
        routes = json.loads(ip("-j", "route", "show") or "[]")
    except ValueError as exc:
        raise OSError(f"tcp_congestion {congestion!r}: ip -j route show gave no JSON: {exc}") from None
    changed = []
    for route in routes:
        if not isinstance(route, dict) or route.get("dev") in (None, "lo") or not route.get("dst"):
            continue
        argv = ["route", "change", str(route["dst"])]
        for key, word in (("gateway", "via"), ("dev", "dev"), ("protocol", "proto"), ("scope", "scope"),
                          ("prefsrc", "src"), ("metric", "metric")):
            if route.get(key) is not None:
                argv += [word, str(route[key])]
        ip(*argv, "congctl", congestion)
        changed.append(str(route["dst"]))
    return changed


def congestion_in_force(run: Any = None) -> dict[str, int]:
    """How many established TCP connections of this network namespace run each congestion control, read
    with ``ss -tinH state established`` (its info lines name the algorithm, one of
    net.ipv4.tcp_available_congestion_control): the read-back of `set_route_congestion`, for sockets
    whose options this process cannot read (gloo's). Empty when ``ss`` is missing or fails.

    `run`: `subprocess.run` (tests pass a stand-in). Returns algorithm -> connections, e.g. ``{"cubic": 8}``.
    """
    run = run or subprocess.run
    try:
        known = set(open("/proc/sys/net/ipv4/tcp_available_congestion_control").read().split())
        done = run(["ss", "-tinH", "state", "established"], capture_output=True, text=True, timeout=10.0)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if done.returncode != 0:
        return {}
    counts: dict[str, int] = {}
    for line in done.stdout.splitlines():
        for token in line.split():
            if token in known:
                counts[token] = counts.get(token, 0) + 1
                break
    return counts


# struct tcp_info (include/uapi/linux/tcp.h): 8 one-byte fields, then u32s: rto, ato, snd_mss (byte 16),
# rcv_mss, unacked, sacked, lost, retrans, fackets, last_data_sent, last_ack_sent, last_data_recv,
# last_ack_recv, pmtu, rcv_ssthresh, rtt, rttvar, snd_ssthresh, snd_cwnd (byte 80, in segments).
_TCP_INFO_U32 = struct.Struct("=I")
_TCP_INFO_SND_MSS_AT, _TCP_INFO_SND_CWND_AT, _TCP_INFO_NEEDED_BYTES = 16, 80, 84


def tcp_cwnd_bytes(sock: socket.socket) -> int | None:
    """The congestion window of a TCP socket in bytes: ``tcpi_snd_cwnd`` (segments) x ``tcpi_snd_mss``
    (bytes) from getsockopt(TCP_INFO) (Linux, tcp(7)), what the connection may have in flight unacknowledged.
    None where there is no TCP_INFO (not Linux, not TCP) or the socket is closed."""
    if not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_NEEDED_BYTES)
    except OSError:
        return None
    if len(info) < _TCP_INFO_NEEDED_BYTES:
        return None
    mss = _TCP_INFO_U32.unpack_from(info, _TCP_INFO_SND_MSS_AT)[0]
    cwnd = _TCP_INFO_U32.unpack_from(info, _TCP_INFO_SND_CWND_AT)[0]
    return int(mss) * int(cwnd)
