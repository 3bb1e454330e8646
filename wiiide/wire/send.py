"""Sending frames: one scatter-gather `socket.sendmsg` per frame on a kernel socket (prefix, header and
the tensors' own buffers, no concatenation copy when uncompressed). A TLS connection
(`wiiide.wire.tls_stream.TLSStream`) has no `sendmsg`: it encrypts the frames' buffers itself (`send_buffers`);
on an `ssl.SSLSocket` each large buffer goes out with `sendall` and the small ones are joined.
"""

from __future__ import annotations

import socket
import ssl
from typing import Any, Iterator, Sequence

from wiiide.wire.messages import Frame


def send_frames(sock: socket.socket, frames: Sequence[Frame]) -> int:
    """Send frames with scatter-gather `sendmsg`, one call while the kernel takes everything.

    Returns the number of bytes sent. Raises OSError (e.g. BrokenPipeError) from the socket.
    """
    send_buffers = getattr(sock, "send_buffers", None)
    if send_buffers is None and len(frames) == 1 and not isinstance(sock, ssl.SSLSocket):
        # One frame on a kernel socket (the nodes' case): its buffers as they are, the views and sums below
        # only after a partial send (a frame's Python between two sends costs throughput, see _TEMPLATES).
        buffers = frames[0].buffers
        head = buffers[0]
        if type(head) is bytes and len(buffers) <= _IOV_MAX:
            total = len(head) + frames[0].payload_nbytes
            try:
                sent = sock.sendmsg(buffers)
            except BlockingIOError:  # the kernel's send timeout passed before a byte went out
                raise socket.timeout("timed out") from None
            if sent == total:
                return total
            return sent + _send_rest([memoryview(b).cast("B") for b in buffers], sent, sock)
    buffers = [memoryview(b).cast("B") for f in frames for b in f.buffers]
    total = sum(b.nbytes for b in buffers)
    if send_buffers is not None:  # wiiide.wire.tls_stream.TLSStream: encrypts and sends the frames itself
        send_buffers(buffers)
        return total
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg on SSLSocket (wiiide.wire.tls, memory_bio=False)
        _send_buffers_tls(sock, buffers)
        return total
    sent = _send_rest(buffers, 0, sock)
    assert sent == total
    return total


_IOV_MAX = 1024  # the most buffers one sendmsg takes on Linux


def _send_rest(buffers: list[memoryview], sent: int, sock: socket.socket) -> int:
    """Send what is left of `buffers` (byte views) once their first `sent` bytes are out; returns the
    bytes this call sent. Raises OSError from the socket."""
    sent_total = 0
    while True:
        # Drop what went out; keep the rest of a partly sent buffer.
        while buffers and sent >= buffers[0].nbytes:
            sent -= buffers[0].nbytes
            buffers.pop(0)
        if sent:
            buffers[0] = buffers[0][sent:]
        if not buffers:
            return sent_total
        try:
            sent = sock.sendmsg(buffers[:_IOV_MAX])
        except BlockingIOError:  # the kernel's send timeout (`wiiide.wire.sockets.set_io_timeout`)
            raise socket.timeout("timed out") from None
        sent_total += sent


TLS_COALESCE_BYTES = 64 * 1024  # buffers below this are joined before a TLS write (one record, not one each)


def coalesced(buffers: Sequence[memoryview], small_nbytes: int = TLS_COALESCE_BYTES) -> Iterator[Any]:
    """`buffers` in order (C-contiguous byte views), each buffer of at least `small_nbytes` as it is and
    each run of smaller ones between them (prefixes, headers) joined into one `bytes`: a TLS write makes
    at least one record of its own, so small buffers are joined first."""
    small: list[memoryview] = []
    for buf in buffers:
        if buf.nbytes < small_nbytes:
            small.append(buf)
            continue
        if small:
            yield b"".join(small) if len(small) > 1 else small[0]
            small = []
        yield buf
    if small:
        yield b"".join(small) if len(small) > 1 else small[0]


def _send_buffers_tls(sock: ssl.SSLSocket, buffers: list[memoryview]) -> None:
    """`sendall` each buffer of `coalesced(buffers)`. Raises OSError."""
    for part in coalesced(buffers):
        sock.sendall(part)

