"""The raw socket loops: the best a Python socket can do, in a few variants, the fastest one kept as the limit.

A raw trial moves `count` messages of `size` bytes with no framing at all. Every variant uses
preallocated buffers only (the payload's own memoryview on the sender; one buffer the size of a message,
or one chunk, reused on the receiver), `recv_into` and no per-message allocation; they differ in how the
bytes are handed to the kernel and taken from it:

- sender ``sendall``: `socket.sendall` of the payload's memoryview (CPython loops in C until all is sent);
- sender ``sendmsg``: `socket.sendmsg` of the memoryview, re-sliced only after a partial send;
- receiver ``whole``: `recv_into` the message buffer asking for all that is left of the message;
- receiver ``chunk``: `recv_into` the message buffer at most `chunk_bytes` per call, through views made
  once per trial (`RAW_CHUNK_BYTES`, 256 KiB: seed 001's `FrameReader` chunks);
- receiver ``scratch``: `recv_into` one chunk-sized buffer over and over, the bytes thrown away (iperf3's
  way: no message-sized buffer is ever touched, so it is the upper bound of a Python receiver);
- sender ``sendmsg-split`` and receiver ``framed``: the raw loop with a frame's shape and none of its
  work, to tell where frames lose time: the sender hands the first `FRAME_HEAD_BYTES` and the rest as
  two buffers of one `sendmsg` (a frame's prefix + header, then its payload); the receiver reads 16
  bytes, then up to `FRAME_HEAD_BYTES`, then the rest, each exactly (`wiiide.wire.reader.FrameReader`'s
  three reads). Messages of at most `FRAME_HEAD_BYTES` go whole.

`RAW_VARIANTS` lists those measured; the frames section keeps, per size, the variant with the highest
median as the raw reference and reports every one.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class RawVariant:
    """One raw loop: how the source sends (``sendall`` / ``sendmsg``) and how the sink receives
    (``whole`` / ``chunk`` / ``scratch``, see the module's docstring)."""

    send: str
    recv: str

    @property
    def name(self) -> str:
        """``<send>/<recv>``, e.g. ``sendmsg/whole``: the key of the report's ``raw_variants``."""
        return f"{self.send}/{self.recv}"


RAW_CHUNK_BYTES = 256 * 1024  # the chunk and scratch receivers' recv size (iperf3 reads 128 KiB)
FRAME_HEAD_BYTES = 150  # a gradient frame's 16-byte prefix and its JSON header, about 134 bytes
RAW_VARIANTS = (RawVariant("sendall", "whole"), RawVariant("sendmsg", "whole"),
                RawVariant("sendall", "chunk"), RawVariant("sendall", "scratch"),
                RawVariant("sendmsg-split", "whole"), RawVariant("sendall", "framed"))
SENDS = ("sendall", "sendmsg", "sendmsg-split")
RECVS = ("whole", "chunk", "scratch", "framed")


def send_raw(sock: socket.socket, buf: memoryview, count: int, send: str) -> None:
    """Send `count` copies of `buf` (a C-contiguous byte memoryview) the `send` way (``sendall``/``sendmsg``).

    Raises:
        ValueError: unknown `send`. OSError: the connection failed.
    """
    if send == "sendall":
        for _ in range(count):
            sock.sendall(buf)
    elif send == "sendmsg":
        nbytes = buf.nbytes
        for _ in range(count):
            sent = sock.sendmsg((buf,))
            while sent < nbytes:  # a partial send: slice only then
                sent += sock.sendmsg((buf[sent:],))
    elif send == "sendmsg-split":
        nbytes = buf.nbytes
        parts = (buf[:FRAME_HEAD_BYTES], buf[FRAME_HEAD_BYTES:]) if nbytes > FRAME_HEAD_BYTES else (buf,)
        for _ in range(count):
            sent = sock.sendmsg(parts)
            while sent < nbytes:
                sent += sock.sendmsg((buf[sent:],))
    else:
        raise ValueError(f"raw send {send!r}: one of {SENDS}")


def recv_raw(sock: socket.socket, buf: memoryview, size_bytes: int, count: int, recv: str,
             chunk_bytes: int) -> None:
    """Receive `count` messages of `size_bytes` bytes the `recv` way into `buf` (a writable byte
    memoryview of at least `size_bytes`, and at least `chunk_bytes` for ``scratch``).

    Raises:
        ValueError: unknown `recv`. ConnectionError: the peer closed before all bytes arrived.
    """
    if recv == "scratch":
        scratch = buf[:min(chunk_bytes, buf.nbytes)]
        step = scratch.nbytes
        left = size_bytes * count
        while left:
            got = sock.recv_into(scratch, step if left >= step else left)
            if not got:
                raise ConnectionError("source closed during a raw trial")
            left -= got
        return
    if recv == "framed" and size_bytes > FRAME_HEAD_BYTES:
        views = [buf[:16], buf[16:FRAME_HEAD_BYTES], buf[FRAME_HEAD_BYTES:size_bytes]]
    elif recv in ("whole", "framed"):
        views = [buf[:size_bytes]]
    elif recv == "chunk":
        views = [buf[i:min(i + chunk_bytes, size_bytes)] for i in range(0, size_bytes, chunk_bytes)]
    else:
        raise ValueError(f"raw recv {recv!r}: one of {RECVS}")
    for _ in range(count):
        for view in views:
            got = sock.recv_into(view)
            want = view.nbytes
            while got < want:  # the kernel had less than asked: the rest, sliced only now
                more = sock.recv_into(view[got:])
                if not more:
                    raise ConnectionError("source closed during a raw trial")
                got += more
