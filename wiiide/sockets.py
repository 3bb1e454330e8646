"""Socket options of the seeds (001/002/004 ``configure_socket``), from config, with read-back.

The kernel doubles a requested SO_SNDBUF/SO_RCVBUF (to leave room for its bookkeeping) and caps the
request at ``net.core.wmem_max`` / ``rmem_max`` (socket(7)), so the effective size is read back with
getsockopt and recorded: a run that asked for 16 MiB may have got far less.
"""

from __future__ import annotations

import socket
from typing import Any

from wiiide.config import RunConfig


def configure_socket(sock: socket.socket, cfg: RunConfig) -> dict[str, Any]:
    """Apply buffer sizes and TCP options; return what is in force, read back with getsockopt.

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
    congestion = None
    if hasattr(socket, "TCP_CONGESTION"):
        if cfg.tcp_congestion:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cfg.tcp_congestion.encode("ascii"))
            except OSError as exc:
                raise OSError(exc.errno, f"tcp_congestion {cfg.tcp_congestion!r}: {exc.strerror} (see "
                                         "net.ipv4.tcp_available_congestion_control)") from None
        congestion = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0", 1)[0].decode()
    elif cfg.tcp_congestion:
        raise OSError(f"tcp_congestion {cfg.tcp_congestion!r}: this platform has no TCP_CONGESTION")
    return {
        "sndbuf_requested_bytes": cfg.sndbuf_bytes,
        "rcvbuf_requested_bytes": cfg.rcvbuf_bytes,
        "sndbuf_bytes": sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
        "rcvbuf_bytes": sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
        "tcp_nodelay": bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)),
        "tcp_quickack": quickack,
        "keepalive": bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)),
        "tcp_congestion": congestion,
    }
