"""The worker: connects to the coordinator, computes gradients on the batches it is given.

Protocol, after ``hello`` -> ``welcome`` (rank, model description): for every step it receives
``params`` (flat float32 vector) and ``batch`` (x float32 (b, f), y int64 (b,); meta: step and
optionally ``local_steps`` H), runs forward and backward (in ``grad_accum_steps`` micro-batches) and
sends ``gradients`` (meta: step, loss, samples) holding the flat float32 gradient ``grad``, or for
H > 1 the model delta ``delta`` after H local SGD steps (`wiiide.server.pace.outer`). ``stop`` ends it.
With H > 1 and a lossy compression policy the parameters arrive instead as pulls (absolute, or a delta
against the copy this worker holds) and deltas go out with an error-feedback residual
(`wiiide.server.pace.compress`). With sparse embedding rows the pushes are the touched rows (H > 1: their
delta) and the parameters arrive as the rows that changed (`wiiide.server.sparse`, `wiiide.server.pace.rows`).

A worker that cannot reach the coordinator retries for `connect_timeout_s`, then exits with code 3
and a message that says so; a worker that loses its coordinator mid-run exits with code 4.
"""

from __future__ import annotations

import os
import socket
import ssl
import time
from functools import partial

import torch
from torch import nn

from wiiide.codecs.policy import CompressionPolicy
from wiiide.config import RunConfig
from wiiide.errors import PeerClosed, ProtocolError
from wiiide.log import TieredLog
from wiiide.lr_schedule import wire_lr
from wiiide.metrics import NodeMetrics
from wiiide.training.model import FlatParams, model_from_spec
from wiiide.wire.handshake import Refused, dial, join
from wiiide.training.models import check_batch, loss_mean, set_activation_checkpointing
from wiiide.wire.node import (
    EXIT_CONNECT,
    EXIT_PEER_LOST,
    Connection,
    Heartbeats,
    NodeFailure,
    run_node,
)
from wiiide.server.pace.compress import PULL_KINDS, DeltaPush, WorkerCopy
from wiiide.server.pace.outer import gradient, local_delta
from wiiide.server.ps.placement import node_cpus
from wiiide.server.sparse import SET_KIND, UPDATE_KIND, SparseRows
from wiiide.tensor_memory import ForwardScope, tensor_memory
from wiiide.wire.tensors import from_wire, to_wire
from wiiide.wire.auth import HANDSHAKE_MAX_FRAME_BYTES, load_secret
from wiiide.wire.tls import TLSHandshakeError, client_context

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
        # every forward and loss (both placements): CPU autocast at mixed_precision, the activation meter once
        self.scope = ForwardScope(cfg.mixed_precision)
        self.metrics.extra.update({"mixed_precision": cfg.mixed_precision,
                                   "activation_checkpointing": cfg.activation_checkpointing})
        # for a restarted coordinator (wiiide.server.recovery): the last step this worker sent gradients for and
        # when it last received parameters (wall clock), sent as the hello's ``rejoin`` hint
        self._last_step: int | None = None
        self._last_params_unix_s = 0.0

    def run(self) -> int:
        """Run to the end and write the metrics file; returns the exit code (`wiiide.wire.node` EXIT_*)."""
        return run_node(self.cfg, self.metrics, self.log, self._main)

    def _connect(self, timeout_s: float) -> socket.socket:
        cfg = self.cfg
        deadline = time.monotonic() + timeout_s
        delay_s, attempts, last_error = CONNECT_FIRST_DELAY_S, 0, None
        while True:
            attempts += 1
            try:  # with tls on, the coordinator's certificate must name coordinator_host (wiiide.wire.handshake.dial)
                sock, options = dial(cfg, cfg.coordinator_host, cfg.port, max(0.5, min(5.0, deadline - time.monotonic())))
                self.metrics.socket_options.append(options)
                self.metrics.event("connected", attempts=attempts)
                return sock
            except OSError as exc:  # a TLS handshake timeout (DeadlineExceeded) too: the coordinator may be busy
                last_error = exc
            except TLSHandshakeError as exc:  # its certificate is not the cluster's, or names another host
                raise NodeFailure(f"the coordinator at {cfg.coordinator_host}:{cfg.port} failed TLS: {exc}",
                                  EXIT_CONNECT) from None
            if time.monotonic() + delay_s > deadline:
                raise NodeFailure(
                    f"could not reach the coordinator at {cfg.coordinator_host}:{cfg.port} within "
                    f"{timeout_s:g} s ({attempts} attempts; last error: {last_error})", EXIT_CONNECT)
            time.sleep(delay_s)
            delay_s = min(delay_s * CONNECT_DELAY_GROWTH, CONNECT_MAX_DELAY_S)

    def _main(self) -> None:
        """Join and train; after losing the coordinator, try to rejoin for io_timeout_s, then give up.

        So a worker dropped by the coordinator (paused, link cut) comes back at the next step, a
        restarted coordinator (wiiide.server.recovery) gets its workers back if it listens again within
        rejoin_timeout_s (0: io_timeout_s), and a lost coordinator ends every worker within
        io_timeout_s + that.
        """
        cfg, metrics = self.cfg, self.metrics
        secret = load_secret()  # ConfigError (exit 2) before connecting when there is none
        if cfg.tls:
            client_context(cfg)  # ConfigError (exit 2) before connecting when a TLS file is bad
        rejoin_s = cfg.rejoin_timeout_s or cfg.io_timeout_s
        join_deadline = time.monotonic() + cfg.connect_timeout_s
        lost = None
        while True:
            try:
                sock = self._connect(max(0.0, join_deadline - time.monotonic()) if lost is None else rejoin_s)
            except NodeFailure as exc:
                if lost is None:
                    raise
                raise NodeFailure(f"lost the coordinator at {cfg.coordinator_host}:{cfg.port} ({lost}) and "
                                  f"could not rejoin within {rejoin_s:g} s (rejoin_timeout_s, 0: io_timeout_s): "
                                  f"{exc}", EXIT_PEER_LOST) from None
            try:
                self._session(Connection(sock, cfg, metrics, self.log, "coordinator",
                                         max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES, pool=self.policy.pool), secret)
                return
            except _Lost as exc:
                if metrics.rank is None:  # never joined: try again until connect_timeout_s (a paused coordinator)
                    if time.monotonic() >= join_deadline:
                        raise NodeFailure(f"lost the coordinator at {cfg.coordinator_host}:{cfg.port} during the "
                                          f"handshake and could not join within connect_timeout_s="
                                          f"{cfg.connect_timeout_s:g} s: {exc}", EXIT_PEER_LOST) from None
                    metrics.event("handshake_retry", cause=str(exc))
                    self.log.error("the handshake with the coordinator broke off (%s); trying again", exc)
                    continue
                lost = str(exc)
                metrics.event("coordinator_lost", cause=lost)
                self.log.error("lost the coordinator (%s); trying to rejoin for %g s", lost, rejoin_s)

    def _session(self, conn: Connection, secret: bytes) -> None:
        """One connection: handshake, then train until ``stop``. Raises _Lost when the link breaks."""
        cfg, metrics = self.cfg, self.metrics
        heartbeats = model = None
        try:
            extra: dict = {"pid": os.getpid(), "cpus": node_cpus()}  # cpus: where the shards go (wiiide.server.ps.placement)
            if self._last_step is not None:
                extra["rejoin"] = {"last_step": self._last_step, "last_params_unix_s": self._last_params_unix_s}
            try:
                welcome = join(conn, cfg, secret, self.node_id[:128], None, "the coordinator", extra)
            except Refused as exc:
                raise NodeFailure(f"the coordinator at {cfg.coordinator_host}:{cfg.port}: {exc}", EXIT_CONNECT) from None
            rank = welcome.meta["rank"]  # join checked it (an int >= 1 its MAC covers)
            spec = welcome.meta.get("model") or {}
            try:
                model = model_from_spec(spec)
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
            try:  # this worker's own knob (the config refuses it for other models)
                set_activation_checkpointing(model, cfg.activation_checkpointing)
            except ValueError as exc:
                raise NodeFailure(f"the coordinator's model: {exc}", EXIT_CONNECT) from None
            metrics.rank = rank
            self.log.info("joined as worker %d of %s", rank, welcome.meta.get("num_workers"))
            heartbeats = Heartbeats(lambda: [conn], cfg.heartbeat_interval_s).start()
            ps_shards = welcome.meta.get("ps_shards", 1)
            if type(ps_shards) is not int or not 1 <= ps_shards <= rank + 256:  # noqa: E721 (True == 1)
                raise ProtocolError(f"welcome carries a bad ps_shards {ps_shards!r:.40}")
            if ps_shards == 1:
                self._train(conn, model, spec["type"], spec.get("sparse_rows") is True and spec["type"] == "embedding")
            else:  # sharded servers (wiiide/server/ps/)
                from wiiide.server.ps.session import run_worker

                run_worker(self, conn, model, welcome.meta, secret)
        except (PeerClosed, ConnectionError, socket.timeout, ssl.SSLError) as exc:  # SSLError: a TLS alert, a bad record
            cause = (f"no frame for io_timeout_s={cfg.io_timeout_s:g} s" if isinstance(exc, socket.timeout) else str(exc))
            raise _Lost(cause) from None
        finally:
            if heartbeats is not None:
                heartbeats.stop()
            conn.close()
            if model is not None:  # a worker holds no optimizer state: the server's optimizer has it
                self.metrics.extra["tensor_memory"] = tensor_memory(model, None, self.scope.activation_bytes)

    def _train(self, conn: Connection, model: nn.Module, kind: str = "mlp", sparse_rows: bool = False) -> None:
        metrics = self.metrics
        flat = FlatParams(model)
        sparse = SparseRows(model, flat.numel) if sparse_rows else None
        has_params = False
        copy = WorkerCopy(flat.numel)  # the pace server's compressed pulls (wiiide.server.pace.compress)
        push = DeltaPush(self.policy)  # local SGD's deltas, with an error-feedback residual
        while True:
            msg = conn.receive(["params", "batch", "stop", *PULL_KINDS])
            self.policy.observe_received(msg)
            if msg.kind == "stop":
                self.log.info("stop after %d steps: %s", metrics.steps, msg.meta.get("reason"))
                return
            if msg.kind == "params" and msg.meta.get("update") in (UPDATE_KIND, SET_KIND):
                if sparse is None or not has_params:
                    raise ProtocolError("a sparse params update before any full parameters, or for a dense model")
                if msg.meta["update"] == SET_KIND:  # the pace server's changed rows (wiiide.server.pace.rows)
                    sparse.set_rows(msg, flat.params)
                else:
                    sparse.apply_update(msg, flat.params)
                continue
            if msg.kind in PULL_KINDS:
                has_params = True
                flat.load(torch.from_numpy(copy.apply(msg)))
                self._last_params_unix_s = time.time()
                continue
            if msg.kind == "params":
                has_params = True
                params = msg.tensor("params")
                if params.shape != (flat.numel,):
                    raise ProtocolError(f"params of shape {params.shape}, expected ({flat.numel},)")
                flat.load(torch.from_numpy(params))
                self._last_params_unix_s = time.time()
                continue
            step = msg.meta.get("step")
            t0, cpu0 = time.perf_counter(), time.thread_time()
            if len(msg.tensors) != 2:
                raise ProtocolError(f"batch holds {len(msg.tensors)} tensors, expected x and y")
            x, y = from_wire(msg.tensors[0], copy=False), from_wire(msg.tensors[1], copy=False)
            try:
                check_batch(kind, x, y)
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
            local_steps = msg.meta.get("local_steps", 1)
            if type(local_steps) is not int or not 1 <= local_steps <= x.shape[0]:  # noqa: E721 (True == 1)
                raise ProtocolError(f"batch: local_steps must be an integer 1..{x.shape[0]}, got {local_steps!r:.40}")
            # local SGD's inner rate of this task (the pace server's schedule), else the configured one
            lr = wire_lr(msg.meta["lr"], "batch") if "lr" in msg.meta else self.cfg.learning_rate
            try:  # wrong feature count, label out of range, a sequence too long
                if sparse is None:
                    update, loss_value = self._update(model, flat, x, y, local_steps, kind, lr)
                elif local_steps == 1:  # the table's gradient as the batch's rows (wiiide.server.sparse)
                    ids, rows_grad, loss_value = sparse.gradient(model, flat, x, y, self.cfg.grad_accum_steps,
                                                                 partial(loss_mean, kind), self.scope)
                    rest = flat.grads[sparse.table_numel:]
                else:  # local SGD on rows: the touched rows' delta, the copy put back at what was sent
                    ids, rows_grad, rest, loss_value = sparse.local_delta(
                        model, flat, x, y, local_steps, lr, self.cfg.grad_accum_steps, partial(loss_mean, kind),
                        self.scope)
                if sparse is not None and self.cfg.debug_step_sleep_s > 0 and self.cfg.debug_sleep_worker_rank in (0, metrics.rank):
                    time.sleep(self.cfg.debug_step_sleep_s * local_steps)  # a test's straggler, as `_update` sleeps
            except (RuntimeError, IndexError, ValueError) as exc:
                raise ProtocolError(f"batch does not fit the model: {exc}") from None
            compute_s = time.perf_counter() - t0
            metrics.add_compute(step, compute_s, time.thread_time() - cpu0)
            # compute_s: this task's wall time on the worker (the pace server's adaptive batch sizes)
            meta = {"step": step, "loss": loss_value, "samples": int(x.shape[0]), "compute_s": compute_s,
                    **self.policy.feedback_meta()}
            if sparse is not None:
                frame = sparse.push_frame(meta, "grad" if local_steps == 1 else "delta", ids, rows_grad, rest)
            elif local_steps > 1:
                frame = push.frame(meta, update[1])
            else:
                frame = self.policy.encode("gradients", meta, [to_wire(*update)])
            conn.send([frame])
            if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
                self._last_step = min(step, 10**15)  # the coordinator refuses a larger hint
            metrics.record_worker_step(int(x.shape[0]), loss_value, time.perf_counter() - t0, batches=local_steps)
            self.log.step(metrics.steps, "step %s: loss %.4f", step, metrics.losses[-1])


    def _update(self, model: nn.Module, flat: FlatParams, x: torch.Tensor, y: torch.Tensor,
                local_steps: int, kind: str = "mlp", lr: float | None = None) -> tuple[tuple[str, torch.Tensor], float]:
        """The push for one batch: (("grad", mean gradient) or ("delta", model delta after `local_steps`
        local SGD steps at rate `lr`, default learning_rate), mean loss), in grad_accum_steps micro-batches
        each (`wiiide.server.pace.outer`)."""
        cfg = self.cfg
        sleep_s = cfg.debug_step_sleep_s if cfg.debug_sleep_worker_rank in (0, self.metrics.rank) else 0.0
        if local_steps == 1:
            loss_value = gradient(model, flat, x, y, cfg.grad_accum_steps, loss_fn=partial(loss_mean, kind),
                                  scope=self.scope)
            if sleep_s > 0:
                time.sleep(sleep_s)
            return ("grad", flat.grads), loss_value
        delta, loss_value = local_delta(model, flat, x, y, local_steps, cfg.learning_rate if lr is None else lr,
                                        cfg.grad_accum_steps, sleep_s, loss_fn=partial(loss_mean, kind), scope=self.scope)
        return ("delta", delta), loss_value


def main(cfg: RunConfig) -> int:
    """`Worker(cfg).run()`: the exit code."""
    return Worker(cfg).run()
