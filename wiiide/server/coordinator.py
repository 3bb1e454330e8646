"""The coordinator: WIIIIIDE's parameter server.

It holds the model and the optimizer, loads the data, accepts `num_workers` workers over TCP and runs
synchronous rounds. One step:

1. encode the current parameters once (the policy's codec for ``params``) and send them, with each
   worker's own mini-batch (``batch``), to every live worker;
2. receive every live worker's ``gradients`` (flat float32 vector, its loss);
3. average the gradients (the mean over workers, as DDP's all-reduce does), apply one optimizer step.

With ``staleness_bound`` != 0, ``local_steps`` > 1 or ``adaptive_batch``, `wiiide.server.pace.server.PaceServer`
runs the training on the same connections instead: workers at their own pace (bounded staleness,
asynchronous updates, local SGD, adaptive batch sizes).

The run stops after `duration_s` seconds or `max_steps` steps; the coordinator then sends ``stop``,
evaluates on the held-out split and writes its metrics (held-out accuracy, per-worker batch counts).

A worker whose connection fails or who sends a malformed frame is closed and dropped from the round;
the run goes on with the rest (and fails when none are left).

Checkpoints (`wiiide.server.recovery`, off unless checkpoint_every_steps / checkpoint_every_s): after a step
the parameters and momentum may be written; a restarted coordinator restores the newest checkpoint
that verifies, waits rejoin_timeout_s for its workers and trains on from that step.

Joining (`wiiide.server.joining`, which `Coordinator` inherits): an acceptor thread accepts connections for the whole run and a `wiiide.wire.admission.HandshakeGate`
decides which handshake now (on a slot thread), which wait and which are refused at once; each
handshake must be complete `handshake_timeout_s` after accept, an absolute deadline enforced on every
read (with ``tls`` on, the TLS handshake runs first on the slot thread, within the same deadline:
`wiiide.wire.tls`). Any failure in a handshake, an unforeseen exception included, is a ``connection_refused`` event
with a short ``reason`` and its ``cause``, never a dead thread.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from wiiide.codecs.policy import CompressionPolicy
from wiiide.config import RunConfig
from wiiide.training.data import BatchSampler, load_dataset
from wiiide.errors import ProtocolError
from wiiide.training.evaluation import evaluator_for, record_held_out, stop_at_target
from wiiide.log import TieredLog
from wiiide.metrics import NodeMetrics
from wiiide.lr_schedule import LrRecord, LrSchedule
from wiiide.training.model import FlatParams, MomentumSGD, evaluate, num_parameters
from wiiide.training.models import build_model, model_spec
from wiiide.wire.node import (
    Heartbeats,
    NodeFailure,
    Terminated,
    close_after_delivery,
    run_node,
    touch,
    wait_for_start_gate,
)
from wiiide.server.joining import CoordinatorJoining, WorkerSlot, _Joining
from wiiide.server.pace.server import PaceServer, uses_pace
from wiiide.server.ps.digest import params_digest
from wiiide.server.recovery import ServerRecovery
from wiiide.server.sparse import SparseRows
from wiiide.wire.tensors import to_wire
from wiiide.wire.admission import HandshakeGate
from wiiide.wire.auth import load_secret
from wiiide.wire.encode import encode_message
from wiiide.wire.messages import WireTensor
from wiiide.wire.sockets import configure_socket
from wiiide.wire.tls import server_context
from wiiide.training.workload import sparse_comm_expected, workload_record

TRAINING_MARKER = "coordinator.training"  # written into metrics_dir when the first step starts
# Connections the kernel may queue before accept(), beyond the workers and the handshake slots: a burst
# of 500 junk connects must not make a worker's connect wait for SYN retransmissions (1 s, 3 s, ...).
# Linux caps it at net.core.somaxconn (4096 since 5.4).
LISTEN_BACKLOG_MARGIN = 1024


class Coordinator(CoordinatorJoining):
    """The parameter server: accepts and authenticates workers, sends parameters and batches each step,
    averages the gradients, updates the model and evaluates it at the end (`wiiide.training.model.evaluate`).

    Its `CompressionPolicy` chooses the codec of each frame it sends, and its codec pool decodes the
    chunked payloads it receives (passed to every `Connection`).
    """

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.log = TieredLog(cfg, "coordinator")
        self.metrics = NodeMetrics("coordinator", cfg.node_id or socket.gethostname())
        self.metrics.rank = 0
        self.metrics.track_host_cpu()  # the machine's CPU over the timed steps (the round model's cores)
        self.policy = CompressionPolicy.from_config(cfg, self.metrics.extra)
        self.workers: list[WorkerSlot] = []
        self.listener: socket.socket | None = None
        self.secret = b""
        self._joining: queue.Queue[_Joining] = queue.Queue()
        self.welcome_extra: dict = {}  # merged into every welcome's meta (a sharded run's rejoins)
        self._closing = threading.Event()
        self._gate = HandshakeGate.for_cluster(cfg.max_handshakes, cfg.num_workers, cfg.handshake_timeout_s)
        self._heartbeats: Heartbeats | None = None
        self._spec: dict = {}
        self.evaluator = None  # wiiide.training.evaluation.BackgroundEvaluator when eval_every_s > 0
        self.sparse: SparseRows | None = None
        self.recovery: ServerRecovery | None = None  # checkpoints and restore (wiiide.server.recovery), made in _main

    # ------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Run to the end and write the metrics file; returns the exit code (`wiiide.wire.node` EXIT_*)."""
        return run_node(self.cfg, self.metrics, self.log, self._main)

    def _main(self) -> None:
        cfg = self.cfg
        terminated = False
        self.secret = load_secret()  # ConfigError (exit 2) before anything listens when there is none
        if cfg.tls:
            server_context(cfg)  # ConfigError (exit 2) before anything listens when a TLS file is bad
            self.metrics.extra["tls"] = "TLSv1.3"
        try:
            data = load_dataset(cfg)
            model = build_model(cfg, data.num_features, data.num_classes)
            flat = FlatParams(model)
            optimizer = MomentumSGD(model.parameters(), lr=cfg.learning_rate, momentum=cfg.momentum)
            spec = model_spec(cfg, data.num_features, data.num_classes)
            self.sparse = SparseRows(model, flat.numel) if cfg.sparse_embedding else None
            if self.sparse is not None:
                spec["sparse_rows"] = True  # the worker pushes rows and applies sparse updates
                self.metrics.extra["comm"] = {"expected": sparse_comm_expected(cfg, flat.numel)}
            self.metrics.extra.update(workload_record(cfg, data, model))
            self.recovery = ServerRecovery(cfg, self.metrics, self.log)
            # the sharded servers restore their own checkpoints once the plan is known (wiiide.server.ps.checkpoints)
            start_step, trained_s = self.recovery.restore(flat, optimizer) if cfg.ps_shards == "1" else (0, 0.0)
            self.metrics.extra.update({
                "dataset": data.name, "train_samples": len(data.y_train), "test_samples": len(data.y_test),
                "num_parameters": num_parameters(model), "gradient_bytes": flat.numel * 4,
                "compression": cfg.compression, "log_tier": cfg.log_tier, "num_workers": cfg.num_workers,
            })
            self.log.info("model %s: %d parameters (%.1f KB of gradient); data %s: %d train / %d test",
                          spec, flat.numel, flat.numel * 4 / 1e3, data.name,
                          len(data.y_train), len(data.y_test))
            self._listen()
            self._accept_workers(spec, restarted=self.recovery.incarnation > 1)
            wait_for_start_gate(cfg, self.metrics, self.log)  # links shaped before any training traffic
            self.evaluator = evaluator_for(cfg, lambda: build_model(cfg, data.num_features, data.num_classes), data)
            if self.cfg.ps_shards != "1":  # sharded servers (wiiide/server/ps/): the shards train, this node keeps the barrier
                from wiiide.server.ps.session import run_coordinator

                run_coordinator(self, data, model, flat, TRAINING_MARKER)
            else:
                if uses_pace(cfg):  # workers at their own pace (wiiide.server.pace.server)
                    touch(str(Path(cfg.metrics_dir) / TRAINING_MARKER))
                    PaceServer(self, data, flat, optimizer).run()
                else:
                    self._train(data, model, flat, optimizer, start_step, trained_s)
                self._stop_workers("finished")
            result = evaluate(model, data.x_test, data.y_test, data.task)
            self.metrics.extra.update({**result.to_metrics(), "params_digest": params_digest(flat.params.numpy())})
            self.log.info("held-out %s after %d steps", result.log_text(), self.metrics.steps)
        except Terminated:
            terminated = True
            raise
        finally:
            self.metrics.extra["batches_per_worker"] = {str(w.rank): w.batches for w in self.workers}
            self.metrics.extra["workers_connected"] = len(self.workers)
            self._closing.set()
            if self._heartbeats is not None:
                self._heartbeats.stop()
            # the stop frames (a sharded run's carry the parameters) may still be on their way
            alive = [w.conn for w in self.workers if w.alive and not terminated]
            for w in self.workers:
                if w.conn not in alive:
                    w.conn.close()
            for name in close_after_delivery(alive, cfg.io_timeout_s):
                self.log.warning("%s did not take its last frames within %g s (io_timeout_s); closed", name,
                                 cfg.io_timeout_s)
            if self.listener is not None:
                self.listener.close()

    # ------------------------------------------------------------------------------------------
    def _listen(self) -> None:
        cfg = self.cfg
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        configure_socket(sock, cfg)  # accepted sockets inherit the buffer sizes (window scaling)
        try:
            sock.bind((cfg.bind_host, cfg.port))
        except OSError as exc:
            sock.close()
            raise NodeFailure(f"cannot listen on {cfg.bind_host}:{cfg.port}: {exc}") from None
        sock.listen(cfg.num_workers + cfg.max_handshakes + LISTEN_BACKLOG_MARGIN)
        self.listener = sock
        touch(cfg.ready_file)
        self.log.info("listening on %s:%d for %d workers", cfg.bind_host, cfg.port, cfg.num_workers)


    def _train(self, data, model: nn.Module, flat: FlatParams, optimizer: MomentumSGD, start_step: int = 0,
               trained_s: float = 0.0) -> None:
        """Train from `start_step` (a restored checkpoint's; its `trained_s` seconds count towards
        duration_s) until duration_s or max_steps; a restored run draws its batches from a stream seeded
        with seed + start_step."""
        cfg, metrics = self.cfg, self.metrics
        sampler = BatchSampler(len(data.y_train), cfg.batch_size, cfg.seed + start_step)
        lrs = LrRecord(LrSchedule.from_config(cfg), start_step)  # step t's rate: a pure function of t
        grad_sum = torch.zeros(flat.numel if self.sparse is None else 0, dtype=torch.float32)
        start = time.perf_counter() - trained_s
        step = start_step
        self.log.info("training for %g s%s", cfg.duration_s, f" or {cfg.max_steps} steps" if cfg.max_steps else "")
        # a marker for whoever drives the run (the harness times its fault injection from it)
        touch(str(Path(cfg.metrics_dir) / TRAINING_MARKER))
        evaluator = self.evaluator.start(start) if self.evaluator else None
        while True:
            if time.perf_counter() - start >= cfg.duration_s or (cfg.max_steps and step >= cfg.max_steps):
                break
            if stop_at_target(cfg, evaluator):
                self.log.info("held-out target reached: training ends at step %d (stop_at_target)", step)
                break
            if evaluator:  # a copy of the parameters between steps, evaluated on another thread
                evaluator.offer(step, metrics.samples, flat.params)
            t_step = time.perf_counter()
            self._admit_waiting()  # workers that came back rejoin with the current parameters
            live, sent = self._live(), []
            sparse = self.sparse
            params_frame = (self.policy.encode("params", {"step": step}, [to_wire("params", flat.params)])
                            if sparse is None or sparse.needs_full([w.conn for w in live]) else None)
            for w in live:
                idx = sampler.next_indices()
                batch = [WireTensor("x", data.x_train[idx]), WireTensor("y", data.y_train[idx])]
                batch_frame = self.policy.encode("batch", {"step": step, **self.policy.feedback_meta(w.node_id)}, batch)
                try:
                    frame = params_frame if sparse is None else sparse.params_frame(
                        w.conn, step, flat.params, lrs.schedule.lr(step - 1), params_frame)
                    w.conn.send([frame, batch_frame])
                    sent.append((w, w.conn))
                except OSError as exc:
                    self.drop(w, exc)
            if sparse is None:
                grad_sum.zero_()
            else:  # the sparse path sums the pushed rows itself, no pass over the table
                sparse.begin_step()
            losses, contributors = [], 0
            # only the connections this step's batch went to: a worker admitted in between (a rejoin)
            # waits for parameters, and waiting for its gradients would hang both (heartbeats keep the
            # two connections alive); it gets the next step's
            for w, conn in sent:
                if not w.alive or w.conn is not conn:
                    continue
                try:
                    msg = w.conn.receive(["gradients"])
                    self.policy.observe_received(msg, w.node_id)
                    if msg.meta.get("step") != step:
                        raise ProtocolError(f"gradients for step {msg.meta.get('step')!r}, expected {step}")
                    grad = msg.tensor("grad") if sparse is None else None
                    if grad is not None and (grad.shape != (flat.numel,) or grad.dtype != np.float32):
                        raise ProtocolError(f"gradient of shape {grad.shape} {grad.dtype}, expected ({flat.numel},) float32")
                    loss = msg.meta.get("loss", float("nan"))
                    if isinstance(loss, bool) or not isinstance(loss, (int, float)):
                        raise ProtocolError(f"gradients: 'loss' must be a number, got {type(loss).__name__}")
                    loss = float(loss)  # OverflowError for an integer beyond a float (10**400)
                    if sparse is not None:
                        sparse.add_gradients(msg)  # checks every tensor before adding
                except Exception as exc:  # ProtocolError, OSError, or what else a frame can provoke: a drop with its cause
                    self.drop(w, exc)
                    continue
                if grad is not None:
                    grad_sum += torch.from_numpy(grad)
                losses.append(float(loss))
                contributors += 1
                w.batches += 1
            if contributors == 0:
                self._live()  # waits for a worker to come back (admitted for the next step), or raises
                continue
            optimizer.lr = lrs.schedule.lr(step)
            lrs.applied(step, optimizer.lr)
            t_update = time.perf_counter()
            if sparse is None:
                flat.grads.copy_(grad_sum).div_(contributors)
                optimizer.step()
            else:  # plain SGD on the touched rows and the MLP (momentum is refused with sparse rows)
                sparse.step(flat.params, flat.grads, contributors, optimizer.lr)
            if metrics.trace is not None:
                metrics.trace.add("update", "update", step, time.perf_counter() - t_update)
            step += 1
            metrics.steps = step
            metrics.batches += contributors
            metrics.samples += contributors * sampler.batch_size
            metrics.record_step_time(time.perf_counter() - t_step)
            metrics.losses.append(sum(losses) / len(losses))
            if step % 50 == 0:
                metrics.sample_rss()
            if self.recovery is not None:
                self.recovery.after_step(step, flat, optimizer, time.perf_counter() - start)
            self.log.step(step, "step %d: loss %.4f, %d workers, %.1f batches/s", step, metrics.losses[-1],
                          contributors, metrics.batches / (time.perf_counter() - start - trained_s))
        metrics.train_time_s = time.perf_counter() - start - trained_s  # this incarnation's, as its batches
        metrics.extra["epochs"] = sampler.epochs_done
        metrics.extra.update(lrs.to_dict())
        if evaluator:
            evaluator.finish(step, metrics.samples, flat.params)
            record_held_out(metrics, evaluator)

    def _stop_workers(self, reason: str) -> None:
        frame = encode_message("stop", {"reason": reason, "steps": self.metrics.steps})
        for w in self.workers:
            if w.alive:
                try:
                    w.conn.send([frame])
                except OSError as exc:
                    self.drop(w, exc)


def main(cfg: RunConfig) -> int:
    """`Coordinator(cfg).run()`: the exit code."""
    return Coordinator(cfg).run()


