"""The coordinator: WIIIIIDE's parameter server.

It holds the model and the optimizer, loads the data, accepts `num_workers` workers over TCP and runs
synchronous rounds. One step:

1. encode the current parameters once (the policy's codec for ``params``) and send them, with each
   worker's own mini-batch (``batch``), to every live worker;
2. receive every live worker's ``gradients`` (flat float32 vector, its loss);
3. average the gradients (the mean over workers, as DDP's all-reduce does), apply one optimizer step.

The run stops after `duration_s` seconds or `max_steps` steps; the coordinator then sends ``stop``,
evaluates on the held-out split and writes its metrics (held-out accuracy, per-worker batch counts).

A worker whose connection fails or who sends a malformed frame is closed and dropped from the round;
the run goes on with the rest (and fails when none are left).
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
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
from wiiide.data import BatchSampler, load_dataset
from wiiide.errors import ProtocolError
from wiiide.log import TieredLog
from wiiide.metrics import NodeMetrics
from wiiide.model import (
    FlatParams,
    MomentumSGD,
    build_mlp,
    evaluate,
    model_spec,
    num_parameters,
)
from wiiide.node import (
    EXIT_CONNECT,
    EXIT_PEER_LOST,
    Connection,
    Heartbeats,
    NodeFailure,
    run_node,
    touch,
    wait_for_start_gate,
)
from wiiide.protocol import PROTOCOL_VERSION, WireTensor, encode_message
from wiiide.sockets import configure_socket
from wiiide.tensors import to_wire

TRAINING_MARKER = "coordinator.training"  # written into metrics_dir when the first step starts


@dataclass
class _Joining:
    """A connection that passed the handshake, waiting for the main thread to admit it."""

    conn: Connection
    node_id: str
    nonce_c: str
    nonce_w: str
    options: dict
    peer: str


@dataclass
class WorkerSlot:
    """One joined worker: its rank (1..num_workers), connection, node id, batches trained and whether it is alive."""

    rank: int
    conn: Connection
    node_id: str
    batches: int = 0
    alive: bool = True


class Coordinator:
    """The parameter server: accepts and authenticates workers, sends parameters and batches each step,
    averages the gradients, updates the model and evaluates it at the end (`wiiide.model.evaluate`).

    Its `CompressionPolicy` chooses the codec of each frame it sends, and its codec pool decodes the
    chunked payloads it receives (passed to every `Connection`).
    """

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.log = TieredLog(cfg, "coordinator")
        self.metrics = NodeMetrics("coordinator", cfg.node_id or socket.gethostname())
        self.metrics.rank = 0
        self.policy = CompressionPolicy.from_config(cfg, self.metrics.extra)
        self.workers: list[WorkerSlot] = []
        self.listener: socket.socket | None = None
        self.secret = b""
        self._joining: queue.Queue[_Joining] = queue.Queue()
        self._closing = threading.Event()
        self._handshake_slots = threading.BoundedSemaphore(cfg.max_handshakes)
        self._heartbeats: Heartbeats | None = None
        self._spec: dict = {}

    # ------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Run to the end and write the metrics file; returns the exit code (`wiiide.node` EXIT_*)."""
        return run_node(self.cfg, self.metrics, self.log, self._main)

    def _main(self) -> None:
        cfg = self.cfg
        self.secret = load_secret()  # ConfigError (exit 2) before anything listens when there is none
        try:
            data = load_dataset(cfg)
            model = build_mlp(data.num_features, cfg.hidden_sizes, data.num_classes, cfg.seed)
            flat = FlatParams(model)
            optimizer = MomentumSGD(model.parameters(), lr=cfg.learning_rate, momentum=cfg.momentum)
            spec = model_spec(data.num_features, cfg.hidden_sizes, data.num_classes)
            self.metrics.extra.update({
                "dataset": data.name, "train_samples": len(data.y_train), "test_samples": len(data.y_test),
                "num_parameters": num_parameters(model), "gradient_bytes": flat.numel * 4,
                "compression": cfg.compression, "log_tier": cfg.log_tier, "num_workers": cfg.num_workers,
            })
            self.log.info("model %s: %d parameters (%.1f KB of gradient); data %s: %d train / %d test",
                          spec["hidden_sizes"], flat.numel, flat.numel * 4 / 1e3, data.name,
                          len(data.y_train), len(data.y_test))
            self._listen()
            self._accept_workers(spec)
            wait_for_start_gate(cfg, self.metrics, self.log)  # links shaped before any training traffic
            self._train(data, model, flat, optimizer)
            self._stop_workers("finished")
            accuracy, test_loss = evaluate(model, data.x_test, data.y_test)
            self.metrics.extra.update({"test_accuracy": accuracy, "test_loss": test_loss})
            self.log.info("held-out accuracy %.4f, loss %.4f after %d steps", accuracy, test_loss, self.metrics.steps)
        finally:
            self.metrics.extra["batches_per_worker"] = {str(w.rank): w.batches for w in self.workers}
            self.metrics.extra["workers_connected"] = len(self.workers)
            self._closing.set()
            if self._heartbeats is not None:
                self._heartbeats.stop()
            for w in self.workers:
                w.conn.close()
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
        sock.listen(max(16, cfg.num_workers * 2))
        self.listener = sock
        touch(cfg.ready_file)
        self.log.info("listening on %s:%d for %d workers", cfg.bind_host, cfg.port, cfg.num_workers)

    # --- joining: an acceptor thread authenticates, the main thread admits ------------------------
    def _accept_loop(self) -> None:
        """Accept connections for the whole run; each one is authenticated on a short-lived thread."""
        assert self.listener is not None
        self.listener.settimeout(0.5)
        while not self._closing.is_set():
            try:
                sock, addr = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # the listener was closed: the run is over
            peer = f"{addr[0]}:{addr[1]}"
            if not self._handshake_slots.acquire(blocking=False):
                self._refuse(sock, peer, f"more than max_handshakes={self.cfg.max_handshakes} connections handshaking")
                continue
            threading.Thread(target=self._handshake, args=(sock, peer), name=f"handshake {peer}", daemon=True).start()

    def _refuse(self, sock: socket.socket, peer: str, cause: str) -> None:
        self.log.error("refused connection from %s: %s", peer, cause)
        self.metrics.event("connection_refused", peer=peer, cause=cause)
        try:
            sock.close()
        except OSError:
            pass

    def _handshake(self, sock: socket.socket, peer: str) -> None:
        """Challenge-response (wiiide.auth) within handshake_timeout_s and a 64 KiB frame limit."""
        cfg = self.cfg
        deadline = time.monotonic() + cfg.handshake_timeout_s
        hello = None
        try:
            sock.settimeout(cfg.handshake_timeout_s)
            options = configure_socket(sock, cfg)
            conn = Connection(sock, cfg, self.metrics, self.log, f"peer {peer}", max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES,
                              pool=self.policy.pool)
            nonce_c = new_nonce()
            conn.send([encode_message("challenge", {"protocol_version": PROTOCOL_VERSION, "nonce": nonce_c})])
            hello = conn.receive(["hello"])
            version = hello.meta.get("protocol_version")
            if type(version) is not int or version != PROTOCOL_VERSION:  # noqa: E721 (True == 1)
                raise ProtocolError(f"protocol version {version!r}, this coordinator speaks {PROTOCOL_VERSION}")
            node_id = hello.meta.get("node_id")
            if not isinstance(node_id, str) or not 0 < len(node_id) <= 128:
                raise ProtocolError("hello: node_id must be a string of 1..128 characters")
            nonce_w = check_nonce(hello.meta.get("nonce"), "hello")
            verify(hello_mac(self.secret, PROTOCOL_VERSION, nonce_c, nonce_w, node_id), hello.meta.get("mac"), "hello")
            if time.monotonic() > deadline:
                raise ProtocolError(f"handshake took longer than handshake_timeout_s={cfg.handshake_timeout_s:g} s")
            self._joining.put(_Joining(conn, node_id, nonce_c, nonce_w, options, peer))
        except (ProtocolError, OSError) as exc:
            if hello is not None:  # a peer that speaks the protocol is told why, in one frame
                try:
                    conn.send([encode_message("refused", {"reason": str(exc)[:300]})])
                except OSError:
                    pass
            self._refuse(sock, peer, f"{type(exc).__name__}: {exc}")
        finally:
            self._handshake_slots.release()

    def _admit(self, joining: "_Joining") -> None:
        """Give an authenticated worker a rank (its old one if it comes back) and welcome it."""
        cfg = self.cfg
        # A worker that comes back (same node id) gets its old rank; a new one takes a free rank, or
        # the slot of a lost worker once every rank has been handed out.
        old = next((w for w in self.workers if not w.alive and w.node_id == joining.node_id), None)
        if old is None:
            if sum(w.alive for w in self.workers) >= cfg.num_workers:
                self._refuse(joining.conn.sock, joining.peer, f"all {cfg.num_workers} worker slots are taken")
                return
            if len(self.workers) >= cfg.num_workers:
                old = next(w for w in self.workers if not w.alive)
        rank = old.rank if old is not None else len(self.workers) + 1
        conn = joining.conn
        try:
            conn.send([encode_message("welcome", {
                "rank": rank, "world_size": cfg.num_workers + 1, "num_workers": cfg.num_workers, "model": self._spec,
                "mac": welcome_mac(self.secret, PROTOCOL_VERSION, joining.nonce_w, joining.nonce_c, rank),
            })])
        except OSError as exc:
            self._refuse(conn.sock, joining.peer, f"welcome failed: {exc}")
            return
        conn.name = f"worker {rank}"
        conn.reader.max_frame_bytes = cfg.max_frame_bytes
        conn.sock.settimeout(cfg.io_timeout_s)
        self.metrics.socket_options.append({"rank": rank, **joining.options})
        if old is not None:
            old.conn, old.node_id, old.alive = conn, joining.node_id, True
            self.metrics.event("worker_rejoined", rank=rank, node_id=joining.node_id, peer=joining.peer,
                               step=self.metrics.steps)
            self.log.info("worker %d rejoined from %s (%s) at step %d", rank, joining.peer, joining.node_id,
                          self.metrics.steps)
        else:
            self.workers.append(WorkerSlot(rank, conn, joining.node_id))
            self.metrics.event("worker_joined", rank=rank, node_id=joining.node_id, peer=joining.peer)
            self.log.info("worker %d joined from %s (%s); %d of %d", rank, joining.peer, joining.node_id,
                          len(self.workers), cfg.num_workers)

    def _admit_waiting(self) -> None:
        """Admit every worker that finished its handshake since the last call (rejoins mid-run)."""
        while True:
            try:
                joining = self._joining.get_nowait()
            except queue.Empty:
                return
            self._admit(joining)

    def _accept_workers(self, spec: dict) -> None:
        cfg = self.cfg
        self._spec = spec
        self._acceptor = threading.Thread(target=self._accept_loop, name="acceptor", daemon=True)
        self._acceptor.start()
        self._heartbeats = Heartbeats(lambda: [w.conn for w in self.workers if w.alive], cfg.heartbeat_interval_s).start()
        deadline = time.monotonic() + cfg.connect_timeout_s
        while sum(w.alive for w in self.workers) < cfg.num_workers:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NodeFailure(
                    f"only {sum(w.alive for w in self.workers)} of {cfg.num_workers} workers connected within "
                    f"connect_timeout_s={cfg.connect_timeout_s:g} s; are the workers running, pointed at this "
                    f"host and port {cfg.port}, and given the same shared secret?", EXIT_CONNECT)
            try:
                self._admit(self._joining.get(timeout=min(remaining, 0.5)))
            except queue.Empty:
                continue

    def _drop(self, worker: WorkerSlot, cause: Exception) -> None:
        worker.alive = False
        worker.conn.close()
        self.metrics.event("worker_lost", rank=worker.rank, node_id=worker.node_id, cause=f"{type(cause).__name__}: {cause}")
        self.log.error("dropped worker %d: %s: %s", worker.rank, type(cause).__name__, cause)

    def _live(self) -> list[WorkerSlot]:
        """The live workers; when none is left, wait up to connect_timeout_s for one to come back."""
        live = [w for w in self.workers if w.alive]
        if not live:
            self.log.error("every worker is lost; waiting up to %g s for one to come back", self.cfg.connect_timeout_s)
            try:
                self._admit(self._joining.get(timeout=self.cfg.connect_timeout_s))
            except queue.Empty:
                pass
            live = [w for w in self.workers if w.alive]
            if not live:
                raise NodeFailure("every worker was lost and none came back within connect_timeout_s="
                                  f"{self.cfg.connect_timeout_s:g} s; see the events in the metrics", EXIT_PEER_LOST)
        return live

    def _train(self, data, model: nn.Module, flat: FlatParams, optimizer: MomentumSGD) -> None:
        cfg, metrics = self.cfg, self.metrics
        sampler = BatchSampler(len(data.y_train), cfg.batch_size, cfg.seed)
        grad_sum = torch.zeros(flat.numel, dtype=torch.float32)
        start = time.perf_counter()
        step = 0
        self.log.info("training for %g s%s", cfg.duration_s, f" or {cfg.max_steps} steps" if cfg.max_steps else "")
        # a marker for whoever drives the run (the harness times its fault injection from it)
        touch(str(Path(cfg.metrics_dir) / TRAINING_MARKER))
        while True:
            if time.perf_counter() - start >= cfg.duration_s or (cfg.max_steps and step >= cfg.max_steps):
                break
            t_step = time.perf_counter()
            self._admit_waiting()  # workers that came back rejoin with the current parameters
            params_frame = self.policy.encode("params", {"step": step}, [to_wire("params", flat.params)])
            live = self._live()
            for w in live:
                idx = sampler.next_indices()
                batch = [WireTensor("x", data.x_train[idx]), WireTensor("y", data.y_train[idx])]
                batch_frame = self.policy.encode("batch", {"step": step}, batch)
                try:
                    w.conn.send([params_frame, batch_frame])
                except OSError as exc:
                    self._drop(w, exc)
            grad_sum.zero_()
            losses, contributors = [], 0
            for w in self._live():
                try:
                    msg = w.conn.receive(["gradients"])
                    self.policy.observe_received(msg)
                    if msg.meta.get("step") != step:
                        raise ProtocolError(f"gradients for step {msg.meta.get('step')!r}, expected {step}")
                    grad = msg.tensor("grad")
                    if grad.shape != (flat.numel,) or grad.dtype != np.float32:
                        raise ProtocolError(f"gradient of shape {grad.shape} {grad.dtype}, expected ({flat.numel},) float32")
                    loss = msg.meta.get("loss", float("nan"))
                    if isinstance(loss, bool) or not isinstance(loss, (int, float)):
                        raise ProtocolError(f"gradients: 'loss' must be a number, got {type(loss).__name__}")
                except (ProtocolError, OSError) as exc:
                    self._drop(w, exc)
                    continue
                grad_sum += torch.from_numpy(grad)
                losses.append(float(loss))
                contributors += 1
                w.batches += 1
            if contributors == 0:
                self._live()  # raises: nobody left
                continue
            flat.grads.copy_(grad_sum).div_(contributors)
            optimizer.step()
            step += 1
            metrics.steps = step
            metrics.batches += contributors
            metrics.samples += contributors * sampler.batch_size
            metrics.step_times_s.append(time.perf_counter() - t_step)
            metrics.losses.append(sum(losses) / len(losses))
            if step % 50 == 0:
                metrics.sample_rss()
            self.log.step(step, "step %d: loss %.4f, %d workers, %.1f batches/s", step, metrics.losses[-1],
                          contributors, metrics.batches / (time.perf_counter() - start))
        metrics.train_time_s = time.perf_counter() - start
        metrics.extra["epochs"] = sampler.epochs_done

    def _stop_workers(self, reason: str) -> None:
        frame = encode_message("stop", {"reason": reason, "steps": self.metrics.steps})
        for w in self.workers:
            if w.alive:
                try:
                    w.conn.send([frame])
                except OSError as exc:
                    self._drop(w, exc)


def main(cfg: RunConfig) -> int:
    """`Coordinator(cfg).run()`: the exit code."""
    return Coordinator(cfg).run()
