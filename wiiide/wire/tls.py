"""TLS 1.3 on every WIIIIIDE connection (the ``tls`` knob): integrity and secrecy after the handshake.

The HMAC challenge-response of `wiiide.wire.auth` authenticates a peer once; without TLS, every byte after
it can be read or changed on the way. With ``tls`` on, each connection is TLS 1.3 (the standard
library's `ssl`, OpenSSL underneath) with *mutual* authentication against a per-cluster CA:

- every node has its own certificate and key (``tls_cert_file``, ``tls_key_file``, PEM), signed by the
  cluster's CA (``tls_ca_file``, PEM); the harness makes them per run (`harness.run.certs`);
- the server side requires a client certificate that chains to that CA (``CERT_REQUIRED``), the
  client side checks the server's chain *and* its name: the certificate's subjectAltName must name
  the host the client dialled (``server_name``: the coordinator's host, a peer's node name);
- only TLS 1.3 (``minimum_version = TLSv1_3``): a TLS 1.2-only peer is refused in the handshake;
  no session tickets (``num_tickets = 0``): nothing is resumed, and no post-handshake record is
  sent while one thread reads and another writes;
- only the cluster's CA is trusted (the system's CA store is never loaded).

The HMAC handshake then runs inside TLS, unchanged: the shared secret still decides who may join.

Deadlines: `wrap_server` runs the TLS handshake on the calling thread (the coordinator's slot thread,
never its accept thread) with the socket's timeout cut to what is left of the connection's absolute
deadline; CPython's `SSLSocket.do_handshake` bounds the whole call by that timeout (a deadline
computed once, `Modules/_ssl.c`), so a ClientHello sent one byte per second cannot stretch it.

The transport is `wiiide.wire.tls_stream.TLSStream`; `wrap_server` and `wrap_client` return one.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from pathlib import Path
from typing import Any, Callable

from wiiide.config import RunConfig
from wiiide.errors import ConfigError, ProtocolError
from wiiide.wire.format import DeadlineExceeded
from wiiide.wire.tls_stream import TLS_REASONS, TLSStream


class TLSHandshakeError(ProtocolError):
    """The TLS handshake failed: the peer's certificate does not chain to the cluster's CA or does
    not name the host, the peer offered no certificate, only TLS 1.2 or older, or spoke plaintext.
    The connection is closed; nothing else is affected."""


_FILE_FIELDS = ("tls_ca_file", "tls_cert_file", "tls_key_file")
_contexts: dict[tuple[bool, str, str, str], ssl.SSLContext] = {}
_contexts_lock = threading.Lock()


def _context(cfg: RunConfig, server_side: bool) -> ssl.SSLContext:
    files = tuple(getattr(cfg, name) for name in _FILE_FIELDS)
    missing = [name for name, value in zip(_FILE_FIELDS, files) if not value]
    if missing:
        raise ConfigError(f"{missing[0]}: empty; with tls on, tls_ca_file, tls_cert_file and tls_key_file must "
                          "each name a PEM file (the harness writes them per cluster)")
    for name, value in zip(_FILE_FIELDS, files):
        if not Path(value).is_file():
            raise ConfigError(f"{name}={value!r}: no such file; allowed: a readable PEM file")
    key = (server_side, *files)
    with _contexts_lock:
        ctx = _contexts.get(key)
        if ctx is not None:
            return ctx
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED  # both sides: mutual authentication
        if server_side:
            ctx.num_tickets = 0
        else:
            ctx.check_hostname = True
        ca_file, cert_file, key_file = files
        try:
            ctx.load_verify_locations(cafile=ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"tls_ca_file={ca_file!r}: not a readable PEM CA certificate ({exc})") from None
        try:
            ctx.load_cert_chain(cert_file, key_file)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"tls_cert_file={cert_file!r} / tls_key_file={key_file!r}: not a readable PEM "
                              f"certificate and its matching private key ({exc})") from None
        _contexts[key] = ctx
        return ctx


def server_context(cfg: RunConfig) -> ssl.SSLContext:
    """The server side's context: TLS 1.3 only, this node's certificate, client certificates required
    and checked against ``tls_ca_file``. Built once per set of files and cached (thread-safe).

    Raises:
        ConfigError: a file field is empty, missing or not valid PEM (naming the field).
    """
    return _context(cfg, server_side=True)


def client_context(cfg: RunConfig) -> ssl.SSLContext:
    """The client side's context: TLS 1.3 only, this node's certificate offered, the server's chain
    checked against ``tls_ca_file`` and its subjectAltName against the name dialled. Cached.

    Raises:
        ConfigError: as `server_context`.
    """
    return _context(cfg, server_side=False)


def _handshake_stream(sock: socket.socket, tls: ssl.SSLObject, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO,
                      deadline: float, who: str) -> TLSStream:
    """`sock` under TLS (`TLSStream`) once the handshake is done by `deadline`; close `sock` and raise on
    any failure (the errors of `_handshake`)."""
    stream = TLSStream(sock, tls, incoming, outgoing)
    return _handshake(stream, lambda: stream._run_handshake(deadline), deadline, who)


def _handshake(tls_sock: Any, run: Callable[[], None], deadline: float, who: str) -> Any:
    """Run the TLS handshake of `tls_sock` (`run`) by `deadline`; close it and raise on any failure."""
    try:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise DeadlineExceeded(f"the deadline passed before the TLS handshake with {who} started")
        tls_sock.settimeout(remaining_s)
        run()
        tls_sock.settimeout(max(0.001, deadline - time.monotonic()))
        return tls_sock
    except DeadlineExceeded:
        tls_sock.close()
        raise
    except socket.timeout:
        tls_sock.close()
        raise DeadlineExceeded(f"TLS handshake with {who} not complete by the deadline") from None
    except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
        tls_sock.close()  # the peer closed mid-handshake (a busy coordinator, say): a lost connection, retried
        raise ConnectionAbortedError(f"{who} closed the connection during the TLS handshake") from None
    except ssl.SSLError as exc:
        tls_sock.close()
        # SSLCertVerificationError says why the chain or the name failed; other reasons get a gloss
        detail = getattr(exc, "verify_message", None) or TLS_REASONS.get(str(exc.reason))
        raise TLSHandshakeError(f"TLS handshake with {who} failed: {exc.reason or exc}"
                                + (f" ({detail})" if detail else "")) from None
    except BaseException:
        tls_sock.close()
        raise


def wrap_server(sock: socket.socket, cfg: RunConfig, deadline: float | None = None,
                peer: str = "the peer", memory_bio: bool = True) -> TLSStream | ssl.SSLSocket:
    """Accepted `sock` as the server side of a TLS 1.3 connection, the handshake done by `deadline`
    (a `time.monotonic()` instant; None: ``handshake_timeout_s`` from now). Call it on the thread
    that handles the connection, never on an accept loop. `sock` is taken over: use the returned
    `TLSStream` (``memory_bio=False``: an `ssl.SSLSocket`, the previous transport, for benchmarks),
    whose timeout is what was left of the deadline; set your own.

    Raises:
        ConfigError: the TLS files cannot be loaded.
        TLSHandshakeError: the peer's certificate is missing, from another CA, or the peer speaks
            TLS 1.2 or older, or plaintext (the returned socket is never made; `sock` is closed).
        DeadlineExceeded: the handshake was not complete by `deadline` (closed, too).
        ConnectionAbortedError: the peer closed the connection during the handshake.
        OSError: from the socket.
    """
    ctx = server_context(cfg)
    deadline = time.monotonic() + cfg.handshake_timeout_s if deadline is None else deadline
    if not memory_bio:
        tls_sock = ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return _handshake(tls_sock, tls_sock.do_handshake, deadline, peer)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    return _handshake_stream(sock, ctx.wrap_bio(incoming, outgoing, server_side=True), incoming, outgoing,
                             deadline, peer)


def wrap_client(sock: socket.socket, cfg: RunConfig, server_name: str,
                deadline: float | None = None, memory_bio: bool = True) -> TLSStream | ssl.SSLSocket:
    """Connected `sock` as the client side of a TLS 1.3 connection to `server_name` (the host name or
    address dialled; the server's certificate must carry it as a subjectAltName), the handshake done
    by `deadline` (None: ``handshake_timeout_s`` from now). `sock` is taken over: use the returned
    `TLSStream` (``memory_bio=False``: an `ssl.SSLSocket`).

    A server that refuses *this* node's certificate does so after the client's side of the handshake
    is complete (TLS 1.3): the client sees it as an `ssl.SSLError` (`TLSRecordError`) on its first read.

    Raises:
        ConfigError, TLSHandshakeError, DeadlineExceeded, OSError: as `wrap_server`.
    """
    ctx = client_context(cfg)
    deadline = time.monotonic() + cfg.handshake_timeout_s if deadline is None else deadline
    if not memory_bio:
        tls_sock = ctx.wrap_socket(sock, server_side=False, do_handshake_on_connect=False, server_hostname=server_name)
        return _handshake(tls_sock, tls_sock.do_handshake, deadline, server_name)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    return _handshake_stream(sock, ctx.wrap_bio(incoming, outgoing, server_hostname=server_name), incoming,
                             outgoing, deadline, server_name)
