"""Who may talk to the coordinator: a shared secret and a mutual HMAC-SHA256 challenge-response.

Handshake, before any other frame (each message is a control frame of `wiiide.wire`, read with a
small frame limit, `HANDSHAKE_MAX_FRAME_BYTES`, and within `handshake_timeout_s`)::

    coordinator -> worker   challenge {protocol_version, nonce_c}
    worker -> coordinator   hello     {protocol_version, node_id, nonce_w, mac_w}
    coordinator -> worker   welcome   {rank, ..., mac_c}     (or the connection is closed)

    mac_w = HMAC-SHA256(secret, "wiiide-hello|<version>|<nonce_c>|<nonce_w>|<node_id>")
    mac_c = HMAC-SHA256(secret, "wiiide-welcome|<version>|<nonce_w>|<nonce_c>|<rank>")

Nonces are 32 random bytes (hex) from `secrets`, fresh per connection, so a recorded exchange cannot be
replayed; both sides prove they hold the secret; the protocol version is inside the MAC. Comparisons
use `hmac.compare_digest`. (The construction follows RFC 2104 HMAC with a per-session challenge, as
in multiprocessing.connection's deliver_challenge/answer_challenge, without its pickle.)

The secret comes from ``WIIIIIDE_SECRET`` or the file named by ``WIIIIIDE_SECRET_FILE`` (a Docker
secret is mounted at /run/secrets/...); it is never part of RunConfig, so it never lands in a report.
"""

from __future__ import annotations

import hmac
import os
import secrets
from hashlib import sha256
from pathlib import Path
from typing import Mapping

from wiiide.errors import ConfigError, ProtocolError
from wiiide.wire.encode import encode_message
from wiiide.wire.format import PROTOCOL_VERSION
from wiiide.wire.messages import Frame

NONCE_BYTES = 32
MIN_SECRET_BYTES = 16
HANDSHAKE_MAX_FRAME_BYTES = 64 * 1024
DEFAULT_SECRET_FILE = "/run/secrets/wiiide_secret"


def load_secret(environ: Mapping[str, str] | None = None) -> bytes:
    """The shared secret from WIIIIIDE_SECRET, else WIIIIIDE_SECRET_FILE, else the Docker secret file.

    Raises:
        ConfigError: no secret anywhere, an unreadable file, or fewer than 16 bytes.
    """
    environ = os.environ if environ is None else environ
    value = environ.get("WIIIIIDE_SECRET", "")
    source = "WIIIIIDE_SECRET"
    if not value:
        path = environ.get("WIIIIIDE_SECRET_FILE") or (DEFAULT_SECRET_FILE if Path(DEFAULT_SECRET_FILE).exists() else "")
        if not path:
            raise ConfigError("no shared secret: set WIIIIIDE_SECRET or WIIIIIDE_SECRET_FILE (the harness and "
                              "`make cluster-up` generate one per cluster)")
        try:
            value = Path(path).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the shared secret file {path}: {exc.strerror or exc}") from None
        source = path
    secret = value.encode("utf-8")
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"the shared secret from {source} is {len(secret)} bytes; use at least {MIN_SECRET_BYTES}")
    return secret


def generate_secret() -> str:
    """A fresh random secret (64 hex characters)."""
    return secrets.token_hex(32)


def new_nonce() -> str:
    """A fresh random challenge: 2 x NONCE_BYTES lowercase hex characters (`secrets.token_hex`)."""
    return secrets.token_hex(NONCE_BYTES)


def _mac(secret: bytes, *parts: object) -> str:
    # 'surrogatepass': any str has bytes to MAC, a lone surrogate included (a node id from a
    # surrogateescape'd environment variable), so computing a MAC never raises UnicodeEncodeError.
    return hmac.new(secret, "|".join(str(p) for p in parts).encode("utf-8", "surrogatepass"), sha256).hexdigest()


def hello_mac(secret: bytes, version: int, nonce_c: str, nonce_w: str, node_id: str) -> str:
    """HMAC-SHA256 (hex, 64 characters) of a worker's hello over the protocol version, both nonces
    and its node id, keyed with the shared secret (bytes).
    """
    return _mac(secret, "wiiide-hello", version, nonce_c, nonce_w, node_id)


def hello_frame(secret: bytes, nonce_c: str, node_id: str) -> tuple[Frame, str]:
    """A worker's hello to a challenge with nonce `nonce_c`: (the frame to send, its fresh nonce_w,
    which the welcome's MAC covers). Raises nothing for any str `node_id` (see `_mac`)."""
    nonce_w = new_nonce()
    return encode_message("hello", {
        "protocol_version": PROTOCOL_VERSION, "node_id": node_id, "nonce": nonce_w,
        "mac": hello_mac(secret, PROTOCOL_VERSION, nonce_c, nonce_w, node_id)}), nonce_w


def welcome_mac(secret: bytes, version: int, nonce_w: str, nonce_c: str, rank: int) -> str:
    """HMAC-SHA256 (hex, 64 characters) of the coordinator's welcome over the protocol version, both
    nonces (in the other order than hello's) and the rank it assigns, keyed with the shared secret.
    """
    return _mac(secret, "wiiide-welcome", version, nonce_w, nonce_c, rank)


def _is_hex(value: object, nchars: int) -> bool:
    return isinstance(value, str) and len(value) == nchars and all(c in "0123456789abcdef" for c in value)


def check_nonce(value: object, what: str) -> str:
    """A nonce from the peer must be 64 lowercase hex characters. Raises ProtocolError."""
    if not _is_hex(value, 2 * NONCE_BYTES):
        raise ProtocolError(f"{what}: malformed nonce")
    return value  # type: ignore[return-value]


def verify(expected: str, received: object, what: str) -> None:
    """Constant-time comparison of MACs (64 lowercase hex characters, as `hello_mac` makes them).

    Whatever `received` is (any JSON value, a string with a lone surrogate), the only error is
    ProtocolError naming `what`; the shape check reveals nothing of the secret.
    """
    if not _is_hex(received, len(expected)) or not hmac.compare_digest(expected.encode(), received.encode()):  # type: ignore[union-attr]
        raise ProtocolError(f"{what}: authentication failed (wrong or missing shared secret)")
