"""The TCP connection between the two peers: socket options, connecting with retries, control frames.

A trial starts with a ``trial`` control frame from the source (its ``mode``, ``count`` and ``size``
in bytes) and ends with the sink's ``ack``; ``done`` ends the session. Control frames are WIIIIIDE
frames (`wiiide.wire`), uncompressed, with their fields in the header's ``meta``.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from wiiide.units import MIB
from wiiide.wire.encode import encode_message
from wiiide.wire.reader import FrameReader
from wiiide.wire.send import send_frames

PORT = 29611  # the sink's port in the docker backend (the local backend picks a free one)
SOCKET_BUFFER_BYTES = 8 * MIB  # SO_SNDBUF and SO_RCVBUF asked of both ends (the kernel may cap them)


def configure_socket(sock: socket.socket) -> None:
    """Ask for `SOCKET_BUFFER_BYTES` send and receive buffers, and TCP_NODELAY on an IP socket.

    Raises:
        OSError: the kernel refused an option.
    """
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def connect(host: str, port: int, timeout_s: float) -> socket.socket:
    """A configured TCP connection to `host`:`port`, retried every 0.2 s until `timeout_s` seconds have passed.

    Raises:
        OSError: the last connection error once the deadline has passed.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        configure_socket(sock)
        try:
            sock.connect((host, port))
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def send_control(sock: socket.socket, kind: str, **meta: Any) -> None:
    """Send one uncompressed control frame of `kind` (``trial``, ``ack``, ``done``) with `meta` in its header.

    Raises:
        OSError: the connection failed.
    """
    send_frames(sock, [encode_message(kind, meta)])


def read_ack(reader: FrameReader) -> dict[str, Any]:
    """The next frame's ``meta``, which must be an ``ack`` (the sink's ``recv_s``/``decode_s`` in seconds, if any).

    Raises:
        ConnectionError: the next frame is not an ``ack``.
        ProtocolError: (wiiide) the frame is malformed.
    """
    msg = reader.read_message()
    if msg.kind != "ack":
        raise ConnectionError(f"expected an ack, got {msg.kind!r}")
    return msg.meta
