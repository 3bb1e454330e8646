"""Reading frames from a socket (`FrameReader`), within size limits and an absolute deadline.

A frame is received with `recv_into` into one buffer per frame (or one buffer reused for every frame,
`reuse_buffers`), each `recv_into` asking for all that is left of the frame part up to
`recv_chunk_bytes` (`DEFAULT_RECV_CHUNK_BYTES`, 64 MiB: seed 001's 256 KiB chunks cost a 16 MiB frame
about half its throughput between two containers, bench-wire's ``chunk`` raw variant against
``whole``; asking for more allocates nothing, the kernel returns what it has). Decoded tensors are numpy
views of that buffer when uncompressed: no copy and no `bytes()` round trip between the socket and the
arrays. The nodes' readers take each frame whole (`FrameReader(whole_frames=True)`: prefix, header and
payload in one buffer, one request per frame in a stream of equal frames; bench-wire measured it
against exact reads). With `read_ahead_bytes` a reader of exact parts also takes, in the recv that ends
a frame, up to that many bytes of what follows.
"""

from __future__ import annotations

import fcntl
import socket
import ssl
import termios
import time
from typing import Any

from wiiide.codecs.chunked import CodecPool
from wiiide.errors import PeerClosed, ProtocolError
from wiiide.wire.decode import decode_payload, parse_header
from wiiide.wire.format import (
    DEFAULT_RECV_CHUNK_BYTES,
    MAGIC,
    MAX_HEADER_BYTES,
    PREFIX,
    PREFIX_NBYTES,
    PROTOCOL_VERSION,
    WHOLE_FRAME_FIRST_GUESS_BYTES,
    DeadlineExceeded,
)
from wiiide.wire.messages import Message


class FrameReader:
    """Reads frames from one connected socket, enforcing the size limits.

    Args:
        sock: a connected, blocking socket (a timeout may be set on it).
        max_frame_bytes: largest header + payload accepted; also the largest decoded tensor bytes.
        recv_chunk_bytes: the most one `recv_into` call asks for (`DEFAULT_RECV_CHUNK_BYTES`, 64 MiB; seed
            001 had 256 KiB, measured slower by bench-wire).
        quickack: re-arm TCP_QUICKACK after each frame (Linux clears it after use).
        reuse_buffers: receive every payload into one buffer kept by the reader (grown as needed)
            instead of a new one per frame. Saves the allocation and page faults of a fresh buffer
            (about 10 % of the time of a 64 MiB frame here), but an uncompressed message's arrays are
            then only valid until the next read: use it where each message is consumed (copied,
            summed) before the next one is read, as the coordinator and the worker do.
        pool: the codec thread pool chunked payloads are decoded on (a node passes its compression
            policy's `pool`); None: chunks are decoded one after the other in the calling thread.
        read_ahead_bytes: 0 (the default): every part of a frame is read exactly, nothing past it. N > 0:
            the call that reads the end of a frame also asks the kernel for up to N more bytes
            (`socket.recvmsg_into` scattering into the frame and a fixed N-byte buffer of this reader),
            so that in a stream the next frame's prefix, header and first payload bytes come with the
            same system call: one `recv` per frame instead of three. Only what the kernel already holds
            is taken (a recv returns once it has copied something). Those bytes are checked as every
            frame is (prefix, then header, before any is used), but up to N bytes of a frame are then
            read before its header is validated, into that fixed buffer (nothing is allocated from an
            unchecked size). The bytes read ahead belong to this reader: use one reader per connection
            for its whole life, as the nodes do. Ignored on a TLS socket (no `recvmsg_into`).
        whole_frames: read each frame whole, the way bench-wire's fastest raw loop (``whole``) reads a
            message: prefix, header and payload land in one buffer kept by the reader, and each `recv_into`
            asks for the whole frame at once, the last frame's size being the guess before the prefix is
            known (`WHOLE_FRAME_FIRST_GUESS_BYTES` for the first). A stream of equal frames then costs one
            request per frame and no copy; bytes past a frame (when a frame is shorter than the guess)
            stay in that buffer for the next read. Requires `reuse_buffers` (the payload is a view of the
            reader's buffer, valid until the next read) and a kernel socket; ignored otherwise. Bytes of
            a following frame may be read before its prefix and header are checked, into that buffer only
            (it grows only to a frame's validated size, never from an unchecked one). The bytes read past
            a frame belong to this reader: one reader per connection for its whole life, as the nodes
            do. `read_ahead_bytes` is ignored when this is on.
    """

    def __init__(self, sock: socket.socket, max_frame_bytes: int, recv_chunk_bytes: int = DEFAULT_RECV_CHUNK_BYTES,
                 quickack: bool = False, reuse_buffers: bool = False, pool: CodecPool | None = None,
                 read_ahead_bytes: int = 0, whole_frames: bool = False) -> None:
        self.sock = sock
        self.pool = pool
        self.max_frame_bytes = max_frame_bytes
        self.recv_chunk_bytes = recv_chunk_bytes
        self.quickack = quickack and hasattr(socket, "TCP_QUICKACK")
        self.reuse_buffers = reuse_buffers
        self._prefix = bytearray(PREFIX_NBYTES)
        self._queued_buf = bytearray(4)  # FIONREAD's answer, reused
        tls = isinstance(sock, ssl.SSLSocket) or not hasattr(sock, "recvmsg_into")
        self.read_ahead_bytes = 0 if tls else max(0, int(read_ahead_bytes))
        self._ahead = memoryview(bytearray(self.read_ahead_bytes))
        self._ahead_start = self._ahead_end = 0  # bytes of the stream read ahead, not yet used: _ahead[start:end]
        self._payload_buf = bytearray(0)
        self.whole_frames = bool(whole_frames) and reuse_buffers and not tls
        if self.whole_frames:
            self.read_ahead_bytes = 0
        self._frame_buf = bytearray(WHOLE_FRAME_FIRST_GUESS_BYTES if self.whole_frames else 0)
        self._frame_view = memoryview(self._frame_buf)
        self._frame_start = self._frame_end = 0  # whole_frames: bytes of the stream read, not yet used
        self._frame_guess_nbytes = WHOLE_FRAME_FIRST_GUESS_BYTES
        self._drained = False  # whole_frames: the last recv_into came back short (the kernel's queue was empty)
        self.last_payload_recv_s = 0.0
        self.last_payload_queued_nbytes = 0

    def _recv_exact(self, view: memoryview, *, at_boundary: bool = False, deadline: float | None = None,
                    last: bool = False) -> None:
        """Fill `view`: first from the bytes read ahead, then from the socket. `last`: `view` ends a frame,
        so with `read_ahead_bytes` its final recv also asks for what follows (see the class)."""
        pos, n = 0, view.nbytes
        held = self._ahead_end - self._ahead_start
        if held:
            pos = min(held, n)
            view[:pos] = self._ahead[self._ahead_start:self._ahead_start + pos]
            self._ahead_start += pos
            if pos == n:
                return
            self._ahead_start = self._ahead_end = 0
        chunk = self.recv_chunk_bytes
        ahead = self._ahead if last and self.read_ahead_bytes else None
        while pos < n:
            if ahead is not None and n - pos <= chunk:
                got = _recv_within(self.sock, lambda: self.sock.recvmsg_into([view[pos:], ahead])[0], deadline,
                                   pos, n, at_boundary)
                if got > n - pos:
                    self._ahead_start, self._ahead_end = 0, got - (n - pos)
                    got = n - pos
            else:
                got = _recv_within(self.sock, lambda: self.sock.recv_into(view[pos:pos + min(chunk, n - pos)]),
                                   deadline, pos, n, at_boundary)
            pos += got

    def read_raw(self, deadline: float | None = None) -> tuple[dict[str, Any], memoryview, int]:
        """Read one frame: (parsed and validated header, payload view, frame bytes on the wire).

        `deadline` (a `time.monotonic()` instant) bounds the whole read in wall time whatever the peer
        sends and however slowly; the socket's own timeout is restored afterwards.

        Raises:
            ProtocolError: a malformed frame (PeerClosed on EOF).
            DeadlineExceeded: the deadline passed before the frame was complete (a TimeoutError).
            OSError: from the socket (socket.timeout after the socket's timeout without a byte).
        """
        if deadline is None:
            return self._read_raw(None)
        saved_timeout_s = self.sock.gettimeout()
        try:
            return self._read_raw(deadline)
        finally:
            try:
                self.sock.settimeout(saved_timeout_s)
            except OSError:
                pass

    def buffered_nbytes(self) -> int:
        """Bytes of the stream this reader took from its socket past the frames it returned (read-ahead or
        whole-frame reads): the next frame may already be here while `select` on the socket sees nothing."""
        return (self._ahead_end - self._ahead_start) + (self._frame_end - self._frame_start)

    def _fill(self, need_end: int, ask_end: int, deadline: float | None) -> None:
        """whole_frames: receive into the frame buffer until it holds `need_end` bytes from its start, each
        `recv_into` asking for everything up to `ask_end` (>= need_end, <= the buffer's size). Without a
        deadline the socket is called directly (no closure, no deadline arithmetic per recv)."""
        view, end, sock = self._frame_view, self._frame_end, self.sock
        while end < need_end:
            if deadline is None:
                try:
                    got = sock.recv_into(view[end:ask_end])
                except BlockingIOError:  # the kernel's receive timeout (`wiiide.wire.sockets.set_io_timeout`)
                    raise _timed_out() from None
                if not got:
                    raise _peer_closed(end, need_end, True)
            else:
                got = _recv_within(sock, lambda: sock.recv_into(view[end:ask_end]), deadline, end, need_end, True)
            # A TCP recv returns less than it asked for only once the receive queue is empty (tcp_recvmsg
            # stops when no segment is left): nothing was queued past these bytes at that moment.
            self._drained = got < ask_end - end
            end += got
            self._frame_end = end

    def _read_raw_whole(self, deadline: float | None) -> tuple[dict[str, Any], memoryview, int]:
        """`_read_raw` for `whole_frames` (see the class): one buffer, whole-frame requests."""
        start, end = self._frame_start, self._frame_end
        self._drained = False  # only a recv of this read tells about the queue now
        if start:  # what the last read took past its frame moves to the front: this frame starts at 0
            self._frame_view[:end - start] = self._frame_view[start:end]
            self._frame_start, self._frame_end = 0, end - start
        ask_end = min(max(self._frame_guess_nbytes, PREFIX_NBYTES), len(self._frame_buf))
        self._fill(PREFIX_NBYTES, ask_end, deadline)
        magic, version, _flags, header_nbytes, payload_nbytes = PREFIX.unpack_from(self._frame_buf)
        self._check_prefix(magic, version, header_nbytes, payload_nbytes)
        frame_nbytes = PREFIX_NBYTES + header_nbytes + payload_nbytes
        if frame_nbytes > len(self._frame_buf):  # grown only to a validated size; what was read comes along
            grown = bytearray(frame_nbytes)
            grown[:self._frame_end] = self._frame_view[:self._frame_end]
            self._frame_buf, self._frame_view = grown, memoryview(grown)
        header_end = PREFIX_NBYTES + header_nbytes
        self._fill(header_end, frame_nbytes, deadline)
        header = parse_header(self._frame_buf[PREFIX_NBYTES:header_end], self.max_frame_bytes)
        held = min(self._frame_end, frame_nbytes) - header_end
        if held < payload_nbytes and not self._drained:
            # The payload did not all come with the header, and the recv that brought the header filled
            # what it asked for, so more may be queued: ask the kernel (FIONREAD). When the payload came
            # with the header, or that recv came back short (the queue was empty then), what is held is
            # what was queued: no ioctl, so a stream of frames makes only the raw loop's recv calls.
            held += _queued_nbytes(self.sock, self._queued_buf)
        self.last_payload_queued_nbytes = min(held, payload_nbytes)
        t0 = time.perf_counter()
        self._fill(frame_nbytes, frame_nbytes, deadline)
        self.last_payload_recv_s = time.perf_counter() - t0
        if self.quickack:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        self._frame_start = frame_nbytes if self._frame_end > frame_nbytes else 0
        if not self._frame_start:
            self._frame_end = 0
        self._frame_guess_nbytes = frame_nbytes
        return header, self._frame_view[header_end:frame_nbytes], frame_nbytes

    def _check_prefix(self, magic: bytes, version: int, header_nbytes: int, payload_nbytes: int) -> None:
        """Raise ProtocolError unless a frame prefix's fields are acceptable to this reader."""
        if magic != MAGIC:
            raise ProtocolError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}): not a WIIIIIDE peer")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {version} not supported (this node speaks {PROTOCOL_VERSION})")
        if header_nbytes == 0 or header_nbytes > MAX_HEADER_BYTES:
            raise ProtocolError(f"header of {header_nbytes} bytes is outside 1..{MAX_HEADER_BYTES}")
        if header_nbytes + payload_nbytes > self.max_frame_bytes:
            raise ProtocolError(
                f"frame of {header_nbytes + payload_nbytes} bytes exceeds max_frame_bytes={self.max_frame_bytes}"
            )

    def _read_raw(self, deadline: float | None) -> tuple[dict[str, Any], memoryview, int]:
        if self.whole_frames:
            return self._read_raw_whole(deadline)
        self._recv_exact(memoryview(self._prefix), at_boundary=True, deadline=deadline)
        magic, version, _flags, header_nbytes, payload_nbytes = PREFIX.unpack(self._prefix)
        self._check_prefix(magic, version, header_nbytes, payload_nbytes)
        header_buf = bytearray(header_nbytes)
        self._recv_exact(memoryview(header_buf), deadline=deadline, last=payload_nbytes == 0)
        header = parse_header(header_buf, self.max_frame_bytes)
        if self.reuse_buffers:
            if len(self._payload_buf) < payload_nbytes:
                self._payload_buf = bytearray(payload_nbytes)
            payload = memoryview(self._payload_buf)[:payload_nbytes]
        else:
            payload = memoryview(bytearray(payload_nbytes))
        held = self._ahead_end - self._ahead_start
        self.last_payload_queued_nbytes = min(_queued_nbytes(self.sock, self._queued_buf) + held, payload_nbytes)
        t0 = time.perf_counter()
        self._recv_exact(payload, deadline=deadline, last=True)
        self.last_payload_recv_s = time.perf_counter() - t0
        if self.quickack:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        return header, payload, PREFIX_NBYTES + header_nbytes + payload_nbytes

    def read_message(self, deadline: float | None = None) -> Message:
        """Read and decode one message, within `deadline` (a `time.monotonic()` instant) when given.

        Raises ProtocolError (PeerClosed on EOF), DeadlineExceeded or OSError (see `read_raw`).
        """
        header, payload, wire_nbytes = self.read_raw(deadline)
        if header["codec"] == "none":  # views of the payload, no codec work: its CPU is its wall time
            msg = decode_payload(header, payload, self.pool)
            msg.decode_cpu_s = msg.decode_s
        else:
            cpu0 = time.thread_time()
            msg = decode_payload(header, payload, self.pool)
            msg.decode_cpu_s = time.thread_time() - cpu0
        msg.wire_nbytes = wire_nbytes
        msg.payload_recv_s = self.last_payload_recv_s
        msg.payload_queued_nbytes = self.last_payload_queued_nbytes
        return msg


def _recv_within(sock: socket.socket, recv: Any, deadline: float | None, have_nbytes: int, need_nbytes: int,
                 at_boundary: bool) -> int:
    """Call `recv` (one receive on `sock`, returning the bytes it took) within `deadline`; `have_nbytes` of
    the `need_nbytes` of a frame (part) are in so far. An absolute deadline, not a timeout per recv: a
    peer sending one byte per second cannot stretch the read (the socket's timeout is cut to what is
    left of it). Returns the bytes received (> 0).

    Raises:
        DeadlineExceeded: the deadline passed. PeerClosed: EOF (its message says whether mid-frame;
            `at_boundary` with nothing in yet: between frames). OSError: from the socket.
    """
    if deadline is not None:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise DeadlineExceeded(f"read deadline passed with {have_nbytes} of {need_nbytes} bytes of a frame "
                                   "part received")
        sock.settimeout(remaining_s)
    try:
        got = recv()
    except BlockingIOError:  # the kernel's receive timeout (`wiiide.wire.sockets.set_io_timeout`)
        raise _timed_out() from None
    except socket.timeout:
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlineExceeded(f"read deadline passed with {have_nbytes} of {need_nbytes} bytes of a frame "
                                   "part received") from None
        raise
    if not got:
        raise _peer_closed(have_nbytes, need_nbytes, at_boundary)
    return got


def _timed_out() -> socket.timeout:
    """The error of a receive the kernel timed out (EAGAIN on a blocking socket with SO_RCVTIMEO): the
    `socket.timeout` a Python timeout raises, so callers treat both alike."""
    return socket.timeout("timed out")


def _peer_closed(have_nbytes: int, need_nbytes: int, at_boundary: bool) -> PeerClosed:
    """The error of an EOF with `have_nbytes` of `need_nbytes` of a frame (part) in: between frames when
    `at_boundary` and nothing is in yet, else in the middle of a frame."""
    if at_boundary and have_nbytes == 0:
        return PeerClosed("peer closed the connection")
    return PeerClosed(f"peer closed the connection in the middle of a frame ({have_nbytes} of {need_nbytes} bytes)")


def _queued_nbytes(sock: socket.socket, buf: bytearray | None = None) -> int:
    """Bytes waiting in `sock`'s receive queue (ioctl FIONREAD, SIOCINQ on TCP; Linux tcp(7)); 0 when the
    socket cannot tell (not a kernel socket, or the call failed). One system call, no data read.
    `buf`: a 4-byte bytearray the answer is written into (reused by a reader; None: a new one)."""
    try:
        if buf is None:
            buf = bytearray(4)
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
        return int.from_bytes(buf, "little", signed=True) if buf else 0
    except (OSError, ValueError, AttributeError, TypeError):
        return 0
