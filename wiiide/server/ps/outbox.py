"""The plumbing of a node's connections to the shards: dialling and authenticating to a shard
(`connect_shard`, the dialling side of `wiiide.wire.handshake`), a sender thread's loop over its outbox
(shared by the shards' pull senders, `wiiide.server.ps.shard`, and the workers' push senders,
`wiiide.server.ps.client`), the step a push or pull frame carries, and where a shard listens.
"""

from __future__ import annotations

import queue
import time
from typing import Any, Callable

from wiiide.config import RunConfig
from wiiide.errors import ProtocolError
from wiiide.wire.handshake import dial, join
from wiiide.log import TieredLog
from wiiide.metrics import NodeMetrics
from wiiide.wire.node import Connection, NodeFailure
from wiiide.server.pace.feedback import DENSE_KIND, LOSSY_KIND
from wiiide.wire.auth import HANDSHAKE_MAX_FRAME_BYTES
from wiiide.wire.messages import Frame
from wiiide.wire.sockets import shard_congestion
from wiiide.wire.tls import TLSHandshakeError

CONNECT_RETRY_S = 0.05


def drain_outbox(outbox: "queue.Queue", conn: Connection, to_frame: Callable[[Any], Any],
                 on_error: Callable[[Exception], None],
                 on_sent: Callable[[Frame, float], None] | None = None) -> None:
    """A sender thread's loop: send `to_frame(item)` for each item of `outbox` until a None; the first
    error (OSError, or a codec's in `to_frame`) goes to `on_error` and ends the loop. `on_sent` is told
    each frame sent and the thread's CPU seconds its send took (`time.thread_time`, `to_frame` not in it)."""
    while True:
        item = outbox.get()
        if item is None:
            return
        try:
            frame = to_frame(item)
            cpu0 = time.thread_time()
            conn.send([frame])
            if on_sent is not None:
                on_sent(frame, time.thread_time() - cpu0)
        except Exception as exc:
            on_error(exc)
            return


def frame_step(frame: Frame) -> Any:
    """The step a push or pull `frame` carries (its header's ``meta.step``, as `encode_message` built
    it); None for any other frame, which `NodeMetrics.add_stage_cpu` then leaves out."""
    if frame.kind not in (DENSE_KIND, LOSSY_KIND) or frame.header is None:
        return None
    return (frame.header.get("meta") or {}).get("step")


class ShardFailed(NodeFailure):
    """A shard (or the connection to it) failed: the sharded run cannot go on."""


def connect_shard(cfg: RunConfig, secret: bytes, metrics: NodeMetrics, log: TieredLog, host: str, port: int,
                  shard: int, role: str, rank: int, node_id: str, pool=None, tls_name: str | None = None) -> Connection:
    """Connect (retrying for connect_timeout_s) and authenticate to shard `shard` at host:port through
    `wiiide.wire.handshake` (`dial`, `join`): the same socket knobs, deadlines, limits and, with ``tls`` on,
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


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def shard_bind_host(cfg: RunConfig) -> str:
    """Where a shard listens: `bind_host`, or every interface when the cluster is not on loopback
    (workers keep the default 127.0.0.1 bind host in containers, but their peers are elsewhere)."""
    if cfg.bind_host in LOOPBACK_HOSTS and cfg.coordinator_host not in LOOPBACK_HOSTS:
        return "0.0.0.0"
    return cfg.bind_host


def close_quietly(sock: Any) -> None:
    """Close `sock`, ignoring OSError (the peer is gone either way)."""
    try:
        sock.close()
    except OSError:
        pass
