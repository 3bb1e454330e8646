"""Dialling a server shard (`wiiide.ps.shard`) from a node's shard client (`wiiide.ps.client`): connect,
retrying until the shard serves, and authenticate through `wiiide.handshake`."""

from __future__ import annotations

import time

from wiiide.config import RunConfig
from wiiide.errors import ProtocolError
from wiiide.handshake import dial, join
from wiiide.log import TieredLog
from wiiide.metrics import NodeMetrics
from wiiide.node import Connection, NodeFailure
from wiiide.wire.auth import HANDSHAKE_MAX_FRAME_BYTES
from wiiide.wire.sockets import shard_congestion
from wiiide.wire.tls import TLSHandshakeError

CONNECT_RETRY_S = 0.05


class ShardFailed(NodeFailure):
    """A shard (or the connection to it) failed: the sharded run cannot go on."""


def connect_shard(cfg: RunConfig, secret: bytes, metrics: NodeMetrics, log: TieredLog, host: str, port: int,
                  shard: int, role: str, rank: int, node_id: str, pool=None, tls_name: str | None = None) -> Connection:
    """Connect (retrying for connect_timeout_s) and authenticate to shard `shard` at host:port through
    `wiiide.handshake` (`dial`, `join`): the same socket knobs, deadlines, limits and, with ``tls`` on,
    TLS as the connection to the coordinator; the shard's certificate must name `tls_name` (None: `host`).

    A shard that accepts the connection but is silent for handshake_timeout_s is taken as not serving
    yet (its node starts it once it has its plan, and the coordinator sends the plans one after the
    other) and is tried again until connect_timeout_s.

    Raises:
        ShardFailed: unreachable, refused, silent until connect_timeout_s, a certificate or a welcome
            that does not authenticate the shard.
    """
    deadline = time.monotonic() + cfg.connect_timeout_s
    last: Exception | None = None
    hello_id = f"{role}-{rank}@{node_id}"[:160]  # the MAC covers the rank and role
    while time.monotonic() < deadline:
        try:
            sock, _ = dial(cfg, host, port, cfg.handshake_timeout_s, shard_congestion(cfg), tls_name)
        except TLSHandshakeError as exc:
            raise ShardFailed(f"shard {shard} at {host}:{port} failed TLS: {exc}") from None
        except OSError as exc:  # refused, or a TLS handshake not served yet (DeadlineExceeded)
            last = exc
            time.sleep(CONNECT_RETRY_S)
            continue
        conn = Connection(sock, cfg, metrics, log, f"shard {shard}", max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES,
                          pool=pool)
        try:
            join(conn, cfg, secret, hello_id, shard, f"shard {shard}", {"rank": rank, "role": role})
            return conn
        except TimeoutError as exc:  # accepted by the kernel, not yet served: again
            conn.close()
            last = exc
        except (ProtocolError, OSError) as exc:
            conn.close()
            raise ShardFailed(f"handshake with shard {shard} at {host}:{port} failed: {type(exc).__name__}: "
                              f"{exc}") from None
    raise ShardFailed(f"could not reach shard {shard} at {host}:{port} within connect_timeout_s="
                      f"{cfg.connect_timeout_s:g} s: {last}")
