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
    ``tcp_nodelay``, ``tcp_quickack`` (None where the platform has no TCP_QUICKACK) and ``keepalive``.
    Raises OSError from setsockopt.
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
    return {
        "sndbuf_requested_bytes": cfg.sndbuf_bytes,
        "rcvbuf_requested_bytes": cfg.rcvbuf_bytes,
        "sndbuf_bytes": sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
        "rcvbuf_bytes": sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
        "tcp_nodelay": bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)),
        "tcp_quickack": quickack,
        "keepalive": bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)),
    }
