"""The worker: connects to the coordinator, computes gradients on the batches it is given.

Protocol, after ``hello`` -> ``welcome`` (rank, model description): for every step it receives
``params`` (flat float32 vector) and ``batch`` (x float32 (b, f), y int64 (b,)), runs forward and
backward, and sends ``gradients`` (flat float32 vector; meta: step, loss, samples). ``stop`` ends it.

A worker that cannot reach the coordinator retries for `connect_timeout_s`, then exits with code 3
and a message that says so; a worker that loses its coordinator mid-run exits with code 4.
"""

from __future__ import annotations

import os
import socket
import time

import torch
from torch import nn

from wiiide.auth import (
    HANDSHAKE_MAX_FRAME_BYTES,
    check_nonce,
    hello_mac,
    load_secret,
    new_nonce,
    verify,
    welcome_mac,
)
from wiiide.codecs.policy import CompressionPolicy
from wiiide.config import RunConfig
from wiiide.errors import PeerClosed, ProtocolError
from wiiide.log import TieredLog
from wiiide.metrics import NodeMetrics
from wiiide.model import FlatParams, model_from_spec
from wiiide.node import (
    EXIT_CONNECT,
    EXIT_PEER_LOST,
    Connection,
    Heartbeats,
    NodeFailure,
    run_node,
)
from wiiide.protocol import PROTOCOL_VERSION, encode_message
from wiiide.sockets import configure_socket
from wiiide.tensors import from_wire, to_wire

# Connect retries: 50 ms, growing by half each time to at most 250 ms, until the timeout. Nine nodes
# start within seconds of each other, so the coordinator listens soon; a long backoff (it was 2 s)
# only delays the first step. A refused connect costs microseconds on the coordinator's host.
CONNECT_FIRST_DELAY_S = 0.05
CONNECT_DELAY_GROWTH = 1.5
CONNECT_MAX_DELAY_S = 0.25


class _Lost(Exception):
    """The connection to the coordinator broke (closed, reset, or silent for io_timeout_s)."""


class Worker:
    """A worker: connects and authenticates to the coordinator, then per step receives parameters and a
    batch, computes the gradient and sends it back; after a lost connection it rejoins (within io_timeout_s).

    Its `CompressionPolicy` encodes the gradients, and its codec pool decodes the chunked payloads it
    receives (passed to its `Connection`).
    """

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.node_id = cfg.node_id or socket.gethostname()
        self.log = TieredLog(cfg, f"worker[{self.node_id}]")
        self.metrics = NodeMetrics("worker", self.node_id)
        self.policy = CompressionPolicy.from_config(cfg, self.metrics.extra)

    def run(self) -> int:
        """Run to the end and write the metrics file; returns the exit code (`wiiide.node` EXIT_*)."""
        return run_node(self.cfg, self.metrics, self.log, self._main)

    def _connect(self, timeout_s: float) -> socket.socket:
        cfg = self.cfg
        deadline = time.monotonic() + timeout_s
        delay_s, attempts, last_error = CONNECT_FIRST_DELAY_S, 0, None
        while True:
            attempts += 1
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                options = configure_socket(sock, cfg)  # before connect: the window scale is fixed at SYN
                sock.settimeout(max(0.5, min(5.0, deadline - time.monotonic())))
                sock.connect((cfg.coordinator_host, cfg.port))
                sock.settimeout(cfg.io_timeout_s)
                self.metrics.socket_options.append(options)
                self.metrics.event("connected", attempts=attempts)
                return sock
            except OSError as exc:
                sock.close()
                last_error = exc
            if time.monotonic() + delay_s > deadline:
                raise NodeFailure(
                    f"could not reach the coordinator at {cfg.coordinator_host}:{cfg.port} within "
                    f"{timeout_s:g} s ({attempts} attempts; last error: {last_error})", EXIT_CONNECT)
            time.sleep(delay_s)
            delay_s = min(delay_s * CONNECT_DELAY_GROWTH, CONNECT_MAX_DELAY_S)

    def _main(self) -> None:
        """Join and train; after losing the coordinator, try to rejoin for io_timeout_s, then give up.

        So a worker dropped by the coordinator (paused, link cut) comes back at the next step, and a
        lost coordinator ends every worker within 2 x io_timeout_s.
        """
        cfg, metrics = self.cfg, self.metrics
        secret = load_secret()  # ConfigError (exit 2) before connecting when there is none
        lost = None
        while True:
            try:
                sock = self._connect(cfg.connect_timeout_s if lost is None else cfg.io_timeout_s)
            except NodeFailure as exc:
                if lost is None:
                    raise
                raise NodeFailure(f"lost the coordinator at {cfg.coordinator_host}:{cfg.port} ({lost}) and "
                                  f"could not rejoin within io_timeout_s={cfg.io_timeout_s:g} s: {exc}",
                                  EXIT_PEER_LOST) from None
            try:
                self._session(Connection(sock, cfg, metrics, self.log, "coordinator",
                                         max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES, pool=self.policy.pool), secret)
                return
            except _Lost as exc:
                if metrics.rank is None:  # never joined: nothing to rejoin
                    raise NodeFailure(f"lost the coordinator at {cfg.coordinator_host}:{cfg.port} during the "
                                      f"handshake: {exc}", EXIT_PEER_LOST) from None
                lost = str(exc)
                metrics.event("coordinator_lost", cause=lost)
                self.log.error("lost the coordinator (%s); trying to rejoin for %g s", lost, cfg.io_timeout_s)

    def _session(self, conn: Connection, secret: bytes) -> None:
        """One connection: handshake, then train until ``stop``. Raises _Lost when the link breaks."""
        cfg, metrics = self.cfg, self.metrics
        heartbeats = None
        try:
            conn.sock.settimeout(cfg.handshake_timeout_s)
            challenge = conn.receive(["challenge"])
            version = challenge.meta.get("protocol_version")
            if type(version) is not int or version != PROTOCOL_VERSION:  # noqa: E721 (True == 1)
                raise ProtocolError(f"the coordinator speaks protocol version {version!r}, this worker {PROTOCOL_VERSION}")
            nonce_c = check_nonce(challenge.meta.get("nonce"), "challenge")
            nonce_w = new_nonce()
            conn.send([encode_message("hello", {
                "protocol_version": PROTOCOL_VERSION, "node_id": self.node_id[:128], "pid": os.getpid(),
                "nonce": nonce_w, "mac": hello_mac(secret, PROTOCOL_VERSION, nonce_c, nonce_w, self.node_id[:128]),
            })])
            welcome = conn.receive(["welcome", "refused"])
            if welcome.kind == "refused":
                raise NodeFailure(f"the coordinator at {cfg.coordinator_host}:{cfg.port} refused this worker: "
                                  f"{str(welcome.meta.get('reason'))[:300]}", EXIT_CONNECT)
            rank = welcome.meta.get("rank")
            if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
                raise ProtocolError(f"welcome carries a bad rank {rank!r}")
            verify(welcome_mac(secret, PROTOCOL_VERSION, nonce_w, nonce_c, rank), welcome.meta.get("mac"),
                   "the coordinator's welcome")
            try:
                model = model_from_spec(welcome.meta.get("model") or {})
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
            conn.reader.max_frame_bytes = cfg.max_frame_bytes
            conn.sock.settimeout(cfg.io_timeout_s)
            metrics.rank = rank
            self.log.info("joined as worker %d of %s", rank, welcome.meta.get("num_workers"))
            heartbeats = Heartbeats(lambda: [conn], cfg.heartbeat_interval_s).start()
            self._train(conn, model)
        except (PeerClosed, ConnectionError, socket.timeout) as exc:
            cause = (f"no frame for io_timeout_s={cfg.io_timeout_s:g} s" if isinstance(exc, socket.timeout) else str(exc))
            raise _Lost(cause) from None
        finally:
            if heartbeats is not None:
                heartbeats.stop()
            conn.close()

    def _train(self, conn: Connection, model: nn.Module) -> None:
        metrics = self.metrics
        flat = FlatParams(model)
        while True:
            msg = conn.receive(["params", "batch", "stop"])
            self.policy.observe_received(msg)
            if msg.kind == "stop":
                self.log.info("stop after %d steps: %s", metrics.steps, msg.meta.get("reason"))
                return
            if msg.kind == "params":
                params = msg.tensor("params")
                if params.shape != (flat.numel,):
                    raise ProtocolError(f"params of shape {params.shape}, expected ({flat.numel},)")
                flat.load(torch.from_numpy(params))
                continue
            step = msg.meta.get("step")
            t0 = time.perf_counter()
            if len(msg.tensors) != 2:
                raise ProtocolError(f"batch holds {len(msg.tensors)} tensors, expected x and y")
            x, y = from_wire(msg.tensors[0], copy=False), from_wire(msg.tensors[1], copy=False)
            if x.dim() != 2 or x.dtype != torch.float32 or y.shape != (x.shape[0],) or y.dtype != torch.int64:
                raise ProtocolError("batch must hold x (b, f) float32 and y (b,) int64")
            flat.grads.zero_()
            try:
                loss = nn.functional.cross_entropy(model(x), y)
            except (RuntimeError, IndexError) as exc:  # wrong feature count or label out of range
                raise ProtocolError(f"batch does not fit the model: {exc}") from None
            loss.backward()
            loss_value = loss.item()
            metrics.compute_time_s += time.perf_counter() - t0
            frame = self.policy.encode("gradients", {"step": step, "loss": loss_value, "samples": int(x.shape[0]),
                                                     **self.policy.feedback_meta()},
                                       [to_wire("grad", flat.grads)])
            conn.send([frame])
            metrics.steps += 1
            metrics.batches += 1
            metrics.samples += int(x.shape[0])
            metrics.losses.append(loss_value)
            metrics.step_times_s.append(time.perf_counter() - t0)
            if metrics.steps % 50 == 0:
                metrics.sample_rss()
            self.log.step(metrics.steps, "step %s: loss %.4f", step, metrics.losses[-1])


def main(cfg: RunConfig) -> int:
    """`Worker(cfg).run()`: the exit code."""
    return Worker(cfg).run()
