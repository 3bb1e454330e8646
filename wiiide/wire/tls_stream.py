"""TLS 1.3 as a socket-like stream (`TLSStream`): the transport of `wiiide.wire.tls`'s connections.

TLS on an `ssl.SSLObject` between two `ssl.MemoryBIO`s over the plain
socket, not an `ssl.SSLSocket`. `SSLSocket.recv_into` returns at most one 16 KiB record, each
`SSL_read` doing its own read system calls for the record's header and body (about 128 per MiB), and
`SSLSocket.sendall` writes record by record (one `send` per 16 KiB record): with the GIL and a shared
2-core machine, those record-sized calls, not AES-GCM (a few GB/s here), were what TLS cost
(README, "What it costs"). `TLSStream` reads up to `RECV_CIPHERTEXT_BYTES` of ciphertext per system
call (from `RECV_FIRST_BYTES`, grown while reads fill it) and decrypts every whole record in it
straight into the caller's buffer (`SSLObject.read`, no
system call per record), and encrypts a whole slice of a frame (`SEND_SLICE_BYTES`) into the outgoing
BIO before one `sendall`. No `SSLObject` call blocks on I/O, so one lock guards every one of them: a
heartbeat thread may write while the main thread reads (OpenSSL does not promise that for concurrent
calls on one SSL object; here they never are). `wiiide.wire.tls.wrap_server` and `wrap_client` return a `TLSStream`;
``memory_bio=False`` gives the previous `SSLSocket` (kept for ``bench-tls``'s side-by-side comparison).
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from typing import Any, Sequence

from wiiide.wire.send import coalesced

# OpenSSL's reason codes for a failed handshake or record, in the terms of this package (`wiiide.wire.tls` too)
TLS_REASONS = {
    "UNSUPPORTED_PROTOCOL": "the peer offers only TLS 1.2 or older; TLS 1.3 is required",
    "TLSV1_ALERT_PROTOCOL_VERSION": "the peer does not speak TLS 1.3",
    "WRONG_VERSION_NUMBER": "not a TLS record: a plaintext peer, or tls is off on its side",
    "HTTP_REQUEST": "not a TLS record: a plaintext peer",
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "the peer offered no certificate; one signed by the cluster's CA is required",
    "TLSV1_ALERT_UNKNOWN_CA": "the peer does not trust this node's certificate (another cluster's CA?)",
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "the peer requires a certificate signed by its cluster's CA",
}


RECV_FIRST_BYTES = 64 * 1024  # the ciphertext one recv system call of a new TLSStream reads at most
RECV_CIPHERTEXT_BYTES = 1024 * 1024  # ... and of one that has seen large frames (a 1 MiB buffer per connection)
SEND_SLICE_BYTES = 1024 * 1024  # plaintext encrypted per sendall (bounds the ciphertext held at once)


class TLSRecordError(ssl.SSLError):
    """A TLS record from the peer failed (a bad MAC: changed or forged on the way, a malformed record,
    or an alert the peer sent). An `ssl.SSLError`, hence an OSError: callers close that connection."""


def _record_error(exc: ssl.SSLError, what: str) -> TLSRecordError:
    """`exc` (from a read or write of a TLS record) as a `TLSRecordError` that says what happened: an
    alert from the peer (it refused what this side sent, or its certificate check failed), or a record
    this side refused."""
    reason = str(exc.reason or exc)
    if "_ALERT_" in reason:  # SSLV3_ALERT_BAD_RECORD_MAC, TLSV1_ALERT_UNKNOWN_CA, TLSV13_ALERT_...
        detail = TLS_REASONS.get(reason, "it refused what this side sent")
        message = f"the peer ended the TLS connection with an alert: {reason} ({detail})"
    else:
        detail = TLS_REASONS.get(reason, "a record changed or forged on the way")
        message = f"{what}: {reason} ({detail}); the connection is closed"
    error = TLSRecordError(exc.errno, message)
    error.reason, error.library = exc.reason, exc.library
    return error


class TLSStream:
    """One TLS 1.3 connection as a socket-like object: an `ssl.SSLObject` between two `ssl.MemoryBIO`s
    over a connected, blocking plain socket (see the module's docstring for why).

    What `wiiide.wire.reader`, `wiiide.wire.send` and the nodes use: `recv_into`, `recv`, `sendall`, `send_buffers` (the TLS
    path of `send_frames`), `pending`, `settimeout`/`gettimeout`, `setsockopt`/`getsockopt`, `fileno`,
    `getpeername`/`getsockname`, `close`, `version`, `cipher`, `getpeercert`; a context manager.
    Nothing else of the plain socket is exposed, so no byte can leave or arrive around TLS.

    Timeouts follow `socket`'s: the timeout bounds each whole `recv_into`/`recv` call (however many
    system calls it takes, as `SSLSocket` does) and each `sendall`; `socket.timeout` when it passes.

    Threads: any number may call at once. Every `SSLObject`/BIO call holds one lock (none blocks on
    I/O); a send holds a second lock from encryption to its last byte on the socket, so records leave
    in the order they were made. Only one thread may read at a time (the nodes' main thread).

    Build it with `wrap_server` or `wrap_client` (they run the handshake).
    """

    def __init__(self, sock: socket.socket, tls: ssl.SSLObject, incoming: ssl.MemoryBIO,
                 outgoing: ssl.MemoryBIO) -> None:
        self._sock = sock
        self._tls, self._incoming, self._outgoing = tls, incoming, outgoing
        self._tls_lock = threading.Lock()  # every SSLObject and BIO call
        self._send_lock = threading.Lock()  # encrypt + send, so records leave in order
        # what one recv system call reads: RECV_FIRST_BYTES, 4x larger after each read that filled it (a
        # stream of large frames), up to RECV_CIPHERTEXT_BYTES; a connection of small frames stays small
        self._recv_view = memoryview(bytearray(RECV_FIRST_BYTES))
        self._timeout_s = sock.gettimeout()

    # -- the socket's own knobs -------------------------------------------------------------------
    def settimeout(self, timeout_s: float | None) -> None:
        """Bound each later read and send call by `timeout_s` (None: block). Raises OSError."""
        self._sock.settimeout(timeout_s)
        self._timeout_s = timeout_s

    def gettimeout(self) -> float | None:
        """The timeout set with `settimeout` (seconds, or None)."""
        return self._timeout_s

    def setsockopt(self, *args: Any) -> None:
        """`socket.setsockopt` on the plain socket (TCP and socket options). Raises OSError."""
        self._sock.setsockopt(*args)

    def getsockopt(self, *args: Any) -> Any:
        """`socket.getsockopt` on the plain socket. Raises OSError."""
        return self._sock.getsockopt(*args)

    def fileno(self) -> int:
        """The plain socket's file descriptor (-1 once closed)."""
        return self._sock.fileno()

    def getpeername(self) -> Any:
        """The peer's address. Raises OSError."""
        return self._sock.getpeername()

    def getsockname(self) -> Any:
        """This side's address. Raises OSError."""
        return self._sock.getsockname()

    def version(self) -> str | None:
        """The negotiated protocol, e.g. ``TLSv1.3``."""
        return self._tls.version()

    def cipher(self) -> tuple[str, str, int] | None:
        """(cipher suite, protocol, secret bits), e.g. ``('TLS_AES_256_GCM_SHA384', 'TLSv1.3', 256)``."""
        return self._tls.cipher()

    def getpeercert(self, binary_form: bool = False) -> Any:
        """The peer's certificate, as `ssl.SSLSocket.getpeercert`."""
        return self._tls.getpeercert(binary_form)

    def pending(self) -> int:
        """Bytes already read from the socket and not yet returned: plaintext of the current record plus
        ciphertext buffered behind it (a TLSStream reads ahead, so `select` on `fileno` may say "not
        readable" while a whole frame waits here: poll this first)."""
        with self._tls_lock:
            return self._tls.pending() + self._incoming.pending

    def close(self) -> None:
        """Close the plain socket (no close_notify, as `SSLSocket.close`). Raises OSError."""
        self._sock.close()

    def shutdown(self, how: int) -> None:
        """`socket.shutdown` of the plain socket. Raises OSError."""
        self._sock.shutdown(how)

    def __enter__(self) -> "TLSStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- reading --------------------------------------------------------------------------------------
    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        """Decrypt up to `nbytes` (0: the buffer's size) plaintext bytes into `buffer` (a writable
        buffer); returns how many, at least 1, or 0 once the peer closed the connection (close_notify
        or the TCP connection's end). Reads ciphertext only when no whole record is buffered, up to
        `RECV_CIPHERTEXT_BYTES` per system call, and then returns every whole record it holds.

        Raises:
            TLSRecordError: a record failed its check (changed on the way) or the peer sent an alert.
            socket.timeout: the timeout passed before a byte could be decrypted.
            OSError: from the socket.
        """
        if flags:
            raise ValueError("TLSStream.recv_into takes no flags")
        view = memoryview(buffer).cast("B")
        n = nbytes or view.nbytes
        if n <= 0:
            return 0
        view = view[:n]
        deadline = None if self._timeout_s is None else time.monotonic() + self._timeout_s
        system_calls = 0
        try:
            while True:
                got = self._decrypt_into(view)
                if got is not None:
                    return got
                if deadline is not None and system_calls:
                    # the rest of the call's timeout (as SSLSocket: one deadline per call, so a peer
                    # that trickles a record byte by byte cannot stretch it)
                    remaining_s = deadline - time.monotonic()
                    if remaining_s <= 0:
                        raise socket.timeout("timed out")
                    self._sock.settimeout(remaining_s)
                system_calls += 1
                k = self._sock.recv_into(self._recv_view)
                with self._tls_lock:
                    if k:
                        self._incoming.write(self._recv_view[:k])
                    else:
                        self._incoming.write_eof()
                if k == self._recv_view.nbytes < RECV_CIPHERTEXT_BYTES:  # it was full: more is coming at once
                    self._recv_view = memoryview(bytearray(min(4 * k, RECV_CIPHERTEXT_BYTES)))
        finally:
            if deadline is not None and system_calls > 1:
                self._sock.settimeout(self._timeout_s)

    def recv(self, bufsize: int) -> bytes:
        """Up to `bufsize` decrypted bytes (b"" once the peer closed). Raises as `recv_into`."""
        buf = bytearray(bufsize)
        return bytes(buf[:self.recv_into(buf)])

    def _decrypt_into(self, view: memoryview) -> int | None:
        """Every whole buffered record into `view` (up to its size): the bytes written, 0 at the
        peer's end, None when a record must be read from the socket first."""
        pos, n = 0, view.nbytes
        with self._tls_lock:
            try:
                while pos < n:
                    pos += self._tls.read(n - pos, view[pos:])
            except ssl.SSLWantReadError:
                if not pos and not self._incoming.eof:
                    return None
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                pass  # close_notify, or the connection's end (mid-record: the frame reader says where)
            except ssl.SSLError as exc:
                self._send_alert_locked()
                raise _record_error(exc, "TLS record from the peer refused") from None
            pending_out = self._outgoing.pending
        if pending_out:  # e.g. a TLS 1.3 KeyUpdate's answer (none is requested here)
            self._send_encrypted([])
        return pos

    def _send_alert_locked(self) -> None:
        """Best effort: put the alert OpenSSL wrote after a failed record on the wire (lock held)."""
        try:
            alert = self._outgoing.read()
            if alert:
                self._sock.setblocking(False)  # never wait for a peer that does not read
                try:
                    self._sock.send(alert)
                finally:
                    self._sock.settimeout(self._timeout_s)
        except OSError:
            pass

    # -- writing ------------------------------------------------------------------------------------
    def sendall(self, data: Any) -> None:
        """Encrypt and send all of `data` (a bytes-like object). Raises OSError (socket.timeout after
        the timeout), TLSRecordError after the connection failed."""
        self._send_encrypted([memoryview(data).cast("B")])

    def send_buffers(self, buffers: Sequence[Any]) -> int:
        """Encrypt and send `buffers` in order, as one stream: small ones joined into one record
        (`wiiide.wire.send.coalesced`), the ciphertext sent with one `sendall` per `SEND_SLICE_BYTES` of
        plaintext (a frame's header travels in the same system call as its payload's first slice).
        Returns the plaintext bytes sent. Raises as `sendall`."""
        views = [memoryview(b).cast("B") for b in buffers]
        self._send_encrypted(views)
        return sum(v.nbytes for v in views)

    def _send_encrypted(self, views: list[memoryview]) -> None:
        with self._send_lock:
            for part in coalesced(views):
                view = memoryview(part)
                for start in range(0, view.nbytes, SEND_SLICE_BYTES):
                    if self._encrypt(view[start:start + SEND_SLICE_BYTES]) >= SEND_SLICE_BYTES:
                        self._send_ciphertext()
            self._send_ciphertext()  # the rest, and anything the reader left in the outgoing BIO

    def _encrypt(self, plaintext: memoryview) -> int:
        """Encrypt `plaintext` into the outgoing BIO (send lock held); returns the ciphertext bytes it holds."""
        with self._tls_lock:
            try:
                self._tls.write(plaintext)
            except ssl.SSLError as exc:
                raise _record_error(exc, "TLS write failed") from None
            return self._outgoing.pending

    def _send_ciphertext(self) -> None:
        """Send what the outgoing BIO holds with one `sendall` (send lock held). Raises OSError."""
        with self._tls_lock:
            ciphertext = self._outgoing.read()
        if ciphertext:
            self._sock.sendall(ciphertext)

    # -- the handshake --------------------------------------------------------------------------------
    def _run_handshake(self, deadline: float) -> None:
        """Run the handshake over the BIOs, each socket call bounded by what is left of `deadline`.
        Raises ssl.SSLError, socket.timeout (deadline), OSError; the caller maps them."""
        while True:
            with self._tls_lock:
                try:
                    self._tls.do_handshake()
                    done = True
                except ssl.SSLWantReadError:
                    done = False
                except ssl.SSLError:
                    self._send_alert_locked()  # tell the peer why, as SSLSocket does
                    raise
                out = self._outgoing.read()
            if out:
                self._settimeout_to(deadline)
                self._sock.sendall(out)
            if done:
                return
            self._settimeout_to(deadline)
            data = self._sock.recv(65536)
            with self._tls_lock:
                if data:
                    self._incoming.write(data)
                else:
                    self._incoming.write_eof()

    def _settimeout_to(self, deadline: float) -> None:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise socket.timeout("timed out")
        self._sock.settimeout(remaining_s)
