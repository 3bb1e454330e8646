"""One handshake and session set-up for every WIIIIIDE connection: coordinator-worker and worker-shard.

Both sides of every connection go through here, so every connection has the same deadline, frame
limits, socket knobs and TLS:

- the accepting side (`accept_hello`: the coordinator, each `wiiide.server.ps.shard.ShardServer`) applies
  the socket options (`wiiide.wire.sockets.configure_socket`), wraps TLS when ``tls`` is on
  (`wiiide.wire.tls.wrap_server`), sends the challenge and checks the hello (protocol version, node
  id, nonce, MAC: `wiiide.wire.auth`), all by one absolute deadline (accept + ``handshake_timeout_s``)
  and with the 64 KiB handshake frame limit; `send_welcome` then answers with a welcome whose MAC covers
  the id it assigns (a rank, a shard id) and lifts the limits to ``max_frame_bytes`` and
  ``io_timeout_s``. Which connections may handshake at all is the `wiiide.wire.admission.HandshakeGate`
  in front of it;
- the dialling side (`dial`, then `join`: a worker to the coordinator and to each shard, the
  coordinator to the shards) applies the same socket options before connect (the window scale is
  fixed at SYN), wraps TLS naming the peer it expects (its certificate must carry that name), answers
  the challenge and checks the welcome's MAC over the id it expects.

A peer refused after its hello is told why in one ``refused`` frame (`Refused` on the dialling side).
`refusal_reason` gives a failed handshake's short category for the ``connection_refused`` events.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any

from wiiide.config import RunConfig
from wiiide.errors import ProtocolError
from wiiide.log import TieredLog
from wiiide.metrics import NodeMetrics
from wiiide.wire.node import Connection
from wiiide.wire.admission import REASON_DEADLINE
from wiiide.wire.auth import HANDSHAKE_MAX_FRAME_BYTES, check_nonce, hello_frame, hello_mac, new_nonce, verify, welcome_mac
from wiiide.wire.encode import encode_message
from wiiide.wire.format import PROTOCOL_VERSION, DeadlineExceeded
from wiiide.wire.messages import Message
from wiiide.wire.sockets import configure_socket
from wiiide.wire.tls import TLSHandshakeError, wrap_client, wrap_server

REFUSED_SEND_TIMEOUT_S = 0.5  # how long a ``refused`` frame may take to go out before the socket closes


class Refused(ProtocolError):
    """The accepting side refused this hello and said why (its ``refused`` frame)."""


@dataclass
class Hello:
    """An authenticated hello, waiting for its welcome: the connection (still at the handshake's limits),
    the hello's fields, the peer's node id, both nonces (the welcome's MAC covers them), the socket options
    read back, the peer's ``ip:port`` and, with ``tls`` on, the first name its certificate carries."""

    conn: Connection
    meta: dict
    node_id: str
    nonce_c: str
    nonce_w: str
    options: dict
    peer: str
    tls_name: str | None = None


def refusal_reason(exc: BaseException) -> str:
    """A failed handshake's category: ``deadline``, ``tls``, ``auth``, ``protocol``, ``socket`` or ``unexpected``."""
    if isinstance(exc, DeadlineExceeded):
        return REASON_DEADLINE
    if isinstance(exc, TLSHandshakeError):
        return "tls"
    if isinstance(exc, ProtocolError):
        return "auth" if "authentication failed" in str(exc) else "protocol"
    if isinstance(exc, OSError):
        return "socket"
    return "unexpected"


def peer_tls_name(sock: Any) -> str | None:
    """The first subjectAltName (DNS name or IP address) of the certificate the peer of TLS `sock`
    presented and the handshake verified; None without TLS or without a name."""
    getpeercert = getattr(sock, "getpeercert", None)
    cert = getpeercert() if getpeercert is not None else None
    for kind, value in (cert or {}).get("subjectAltName", ()):
        if kind in ("DNS", "IP Address"):
            return str(value)
    return None


def accept_hello(sock: socket.socket, cfg: RunConfig, secret: bytes, metrics: NodeMetrics, log: TieredLog,
                 peer: str, deadline: float, pool=None, congestion: str | None = None,
                 node_id_max_chars: int = 128) -> Hello:
    """The accepting side, up to an authenticated hello, by `deadline` (a `time.monotonic()` instant,
    enforced on every read, however slowly the peer sends). `sock` is taken over; `congestion`: as
    `configure_socket`'s. A peer whose hello arrived but is refused is sent one ``refused`` frame.

    Raises:
        DeadlineExceeded: the deadline passed (also while the connection waited for a slot).
        TLSHandshakeError: ``tls`` on and the peer's certificate or TLS version is not the cluster's.
        ProtocolError: a bad version, node id (1..`node_id_max_chars` characters), nonce or MAC.
        OSError: from the socket.
    """
    remaining_s = deadline - time.monotonic()
    if remaining_s <= 0:
        raise DeadlineExceeded("the deadline passed while the connection waited for a slot")
    sock.settimeout(remaining_s)  # bounds the challenge's send, too
    options = configure_socket(sock, cfg, congestion)
    if cfg.tls:  # on the calling (slot) thread, bounded by the same deadline (wiiide.wire.tls)
        sock = wrap_server(sock, cfg, deadline, peer)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
    conn = Connection(sock, cfg, metrics, log, f"peer {peer}", max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES, pool=pool)
    hello = None
    try:
        nonce_c = new_nonce()
        conn.send([encode_message("challenge", {"protocol_version": PROTOCOL_VERSION, "nonce": nonce_c})])
        hello = conn.receive(["hello"], deadline=deadline)
        version = hello.meta.get("protocol_version")
        if type(version) is not int or version != PROTOCOL_VERSION:  # noqa: E721 (True == 1)
            raise ProtocolError(f"protocol version {version!r:.40}, this node speaks {PROTOCOL_VERSION}")
        node_id = hello.meta.get("node_id")
        if not isinstance(node_id, str) or not 0 < len(node_id) <= node_id_max_chars:
            raise ProtocolError(f"hello: node_id must be a string of 1..{node_id_max_chars} characters")
        nonce_w = check_nonce(hello.meta.get("nonce"), "hello")
        verify(hello_mac(secret, PROTOCOL_VERSION, nonce_c, nonce_w, node_id), hello.meta.get("mac"), "hello")
        if time.monotonic() > deadline:
            raise DeadlineExceeded("the hello arrived after the deadline")
        return Hello(conn, hello.meta, node_id, nonce_c, nonce_w, options, peer, peer_tls_name(sock))
    except Exception as exc:
        if hello is not None and not isinstance(exc, DeadlineExceeded):
            tell_refused(conn, str(exc))
        raise


def tell_refused(conn: Connection, reason: str) -> None:
    """Send a peer that spoke the protocol one ``refused`` frame with `reason` (best effort, within
    `REFUSED_SEND_TIMEOUT_S`); the caller closes the connection."""
    try:
        conn.sock.settimeout(REFUSED_SEND_TIMEOUT_S)
        conn.send([encode_message("refused", {"reason": reason[:300]})])
    except OSError:
        pass


def send_welcome(hello: Hello, cfg: RunConfig, secret: bytes, welcome_id: int, meta: dict, name: str) -> Connection:
    """Welcome an authenticated peer: the welcome carries `meta` and a MAC over `welcome_id` (the rank
    or shard id assigned) and both nonces; the connection then takes frames up to ``max_frame_bytes``
    with ``io_timeout_s`` per read, named `name`. Returns it. Raises OSError (the caller closes it)."""
    conn = hello.conn
    conn.send([encode_message("welcome", {
        **meta, "mac": welcome_mac(secret, PROTOCOL_VERSION, hello.nonce_w, hello.nonce_c, welcome_id)})])
    conn.reader.max_frame_bytes = cfg.max_frame_bytes
    conn.sock.settimeout(cfg.io_timeout_s)
    conn.name = name
    return conn


def dial(cfg: RunConfig, host: str, port: int, connect_timeout_s: float, congestion: str | None = None,
         tls_name: str | None = None) -> tuple[Any, dict]:
    """Connect to host:port with the socket options applied before connect, within `connect_timeout_s`;
    with ``tls`` on, the TLS handshake (within ``handshake_timeout_s``) expecting a certificate that names
    `tls_name` (None: `host`). Returns (the socket or `TLSStream`, the socket options read back).

    Raises:
        OSError: refused, unreachable, timed out (a TLS handshake's deadline too: `DeadlineExceeded`).
        TLSHandshakeError: the peer's certificate is not the cluster's or does not name `tls_name`.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        options = configure_socket(sock, cfg, congestion)  # before connect: the window scale is fixed at SYN
        sock.settimeout(connect_timeout_s)
        sock.connect((host, port))
        if cfg.tls:
            sock = wrap_client(sock, cfg, tls_name or host)
        sock.settimeout(cfg.handshake_timeout_s)
        return sock, options
    except BaseException:
        sock.close()
        raise


def join(conn: Connection, cfg: RunConfig, secret: bytes, node_id: str, welcome_id: int | None, who: str,
         extra: dict | None = None) -> Message:
    """The dialling side on connected `conn`: answer the challenge with a hello as `node_id` (with
    `extra` fields) and check the welcome: its MAC must cover `welcome_id` (None: the rank it assigns,
    an int >= 1). `who` names the peer in errors. Then the connection takes frames up to
    ``max_frame_bytes`` with ``io_timeout_s`` per read. Returns the welcome.

    Raises:
        Refused: the peer refused the hello (with its reason).
        ProtocolError: a bad challenge or welcome (version, nonce, rank, MAC).
        OSError: from the socket (`socket.timeout` after ``handshake_timeout_s`` of silence).
    """
    conn.sock.settimeout(cfg.handshake_timeout_s)
    challenge = conn.receive(["challenge"])
    version = challenge.meta.get("protocol_version")
    if type(version) is not int or version != PROTOCOL_VERSION:  # noqa: E721 (True == 1)
        raise ProtocolError(f"{who} speaks protocol version {version!r:.40}, this node {PROTOCOL_VERSION}")
    nonce_c = check_nonce(challenge.meta.get("nonce"), "challenge")
    hello, nonce_w = hello_frame(secret, nonce_c, node_id, extra)
    conn.send([hello])
    welcome = conn.receive(["welcome", "refused"])
    if welcome.kind == "refused":
        raise Refused(f"{who} refused this node: {str(welcome.meta.get('reason'))[:300]}")
    expected = welcome_id if welcome_id is not None else welcome.meta.get("rank")
    if not isinstance(expected, int) or isinstance(expected, bool) or (welcome_id is None and expected < 1):
        raise ProtocolError(f"welcome carries a bad rank {expected!r:.40}")
    verify(welcome_mac(secret, PROTOCOL_VERSION, nonce_w, nonce_c, expected), welcome.meta.get("mac"),
           f"{who}'s welcome")
    conn.reader.max_frame_bytes = cfg.max_frame_bytes
    conn.sock.settimeout(cfg.io_timeout_s)
    return welcome
