"""A server shard: owns some partitions of the parameters and their slice of the optimizer state.

One runs in the coordinator's process (shard 0) and one in each of the workers of rank 1..k-1
(``ps_shards`` = k), as BytePS colocates its servers with the workers (``docs/architecture.md``;
``docs/rationale.md`` gives the bandwidth argument) and ps-lite gives each server a key range
(``src/postoffice.cc``). For step t a shard takes a push of each of its partitions from every worker,
averages the gradients (summed in rank order, as the central server sums them, so ``ps_shards`` 1 and
``all`` agree to the last bit in fp32), applies `wiiide.training.model.MomentumSGD` to that partition (its
momentum buffer lives here only) and sends the partition back to every worker at once: a partition is
answered as soon as its last push arrived, not at the end of the step. Pulls are deltas against the
workers' copy (`wiiide.server.pace.feedback.PullReplica`), compressed by the shard's own policy. With sparse rows
(`wiiide.server.ps.sparse_rows`) a table partition is whole rows, pushed and pulled as the rows touched.

Connections: the coordinator's handshake and session set-up (`wiiide.wire.handshake`: the same frames,
limits, deadlines, socket knobs and TLS; the welcome's MAC covers the shard id instead of a rank) behind a
`wiiide.wire.admission.HandshakeGate`. Each peer has a receiver thread (pushes in) and a sender thread (pulls out).

Pacing (`wiiide.server.ps.paced`, `wiiide.server.ps.shard_pacing`): with ``staleness_bound`` s >= 1 or ``async`` a
shard applies every push as it arrives, scaled by its staleness, and sends the partition back to the
pushing worker only (a delta against its replica; a row partition: the rows changed since its last
pull; with ``ssp_cache`` none while that worker's copy is fresh enough); a partition's step counts its
pushes. With ``adaptive_batch`` in rounds (s = 0) it averages the pushes weighted by their ``samples``.

Shard loss: an update needs every worker's push, so a peer that disconnects mid-run fails the shard
(`failure`: the first cause, `lost`: every one; every other peer gets ``shard_failed``), and the
coordinator goes on in a new incarnation with new shards (`wiiide.server.ps.membership`: the momentum a shard
kept, `partition_states`; `expect_workers`: the workers an incarnation's shards serve).
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from wiiide.codecs.policy import CompressionPolicy
from wiiide.config import RunConfig
from wiiide.errors import ProtocolError
from wiiide.log import TieredLog
from wiiide.lr_schedule import LrRecord, LrSchedule
from wiiide.metrics import NodeMetrics
from wiiide.training.model import MomentumSGD
from wiiide.wire.handshake import accept_hello, send_welcome, tell_refused
from wiiide.wire.node import Connection, Heartbeats
from wiiide.server.ps.checkpoints import CHECKPOINT_AT, ShardCheckpointer
from wiiide.server.pace.feedback import DENSE_KIND, LOSSY_KIND, PullReplica, pulls_as_deltas, received_values
from wiiide.server.ps.local_sgd import load_optimizer_state, shard_optimizer
from wiiide.server.ps.outbox import close_quietly, drain_outbox, frame_step, shard_bind_host  # noqa: F401 (frame_step)
from wiiide.server.ps.partition import Partition
from wiiide.server.ps.shard_pacing import apply_on_arrival, push_samples, rows_rate
from wiiide.server.ps.sparse_rows import ROWS_PULL_KIND, ROWS_PUSH_KIND, RowTable, apply_rows
from wiiide.server.recovery import momentum_to_flat
from wiiide.wire.admission import HandshakeGate, Pending
from wiiide.wire.encode import encode_message, with_meta
from wiiide.wire.messages import Frame, WireTensor
from wiiide.wire.sockets import configure_socket, shard_congestion

ROLE_WORKER = "worker"
ROLE_COORDINATOR = "coordinator"


@dataclass
class _Owned:
    """One partition this shard owns: its parameters, gradient slot, optimizer, the step's pushes and replicas."""

    part: Partition
    param: torch.Tensor
    optimizer: Any  # MomentumSGD, or PartitionOuterStep (wiiide.server.ps.local_sgd.shard_optimizer)
    replica: PullReplica
    step: int = 0
    pushes: dict[int, np.ndarray] = field(default_factory=dict)
    first_push_s: float = 0.0
    samples: dict[int, int] = field(default_factory=dict)  # adaptive_batch in rounds: rank -> samples pushed
    replicas: dict[int, PullReplica] = field(default_factory=dict)  # on arrival: each worker's own copy
    sent: dict[int, int] = field(default_factory=dict)  # on arrival: rank -> the step of the copy sent it
    dirty: dict[int, np.ndarray] = field(default_factory=dict)  # on arrival, rows: rank -> rows changed since its pull
    clocks: dict[int, int] = field(default_factory=dict)  # on arrival: rank -> its clock here (shard_pacing)
    held: dict[int, int] = field(default_factory=dict)  # ssp_cache: rank -> the slowest clock its copy holds


@dataclass
class _Peer:
    conn: Connection
    rank: int
    role: str
    outbox: "queue.Queue" = field(default_factory=queue.Queue)
    push_wire_bytes: int = 0  # the pushes received from it, whole frames (its receiver thread counts)
    pull_wire_bytes: int = 0  # the pulls sent to it (its sender thread counts)


class ShardServer:
    """The shard `shard_id` of a run with `num_workers` workers (see the module docstring).

    Use: `listen` (returns the port), `configure` (partitions and initial parameters, once the plan is
    known), `start` (accepts peers), `close`. `failure` holds the cause once the shard failed.
    """

    def __init__(self, cfg: RunConfig, secret: bytes, metrics: NodeMetrics, log: TieredLog, shard_id: int) -> None:
        self.cfg, self.secret, self.metrics, self.log, self.shard_id = cfg, secret, metrics, log, shard_id
        self.num_workers = cfg.num_workers
        self.worker_ranks = set(range(1, cfg.num_workers + 1))  # whose pushes an update waits for (expect_workers)
        self.policy = CompressionPolicy.from_config(cfg.replace(lossy_warmup_steps=0))
        self.listener: socket.socket | None = None
        self.owned: dict[int, _Owned] = {}
        self.peers: list[_Peer] = []
        self.failure: str | None = None
        self.lost: list[str] = []  # every peer lost, in the order noticed
        self.updates = 0
        self.update_s = 0.0  # averaging, optimizer step and pull encoding, summed over updates
        self.push_spread_s = 0.0  # first to last push of each update, summed
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._gate = HandshakeGate.for_cluster(cfg.max_handshakes, cfg.num_workers + 1, cfg.handshake_timeout_s)
        self._heartbeats: Heartbeats | None = None
        self._warmup_steps = cfg.lossy_warmup_steps
        self._lossy = False
        self._delta_pulls = False
        self.stats: dict = {"shard": shard_id}
        self.checkpointer: ShardCheckpointer | None = None  # made by configure
        self.lrs = LrRecord(LrSchedule.from_config(cfg))  # step t's rate, the same on every shard; configure restarts it
        self.on_arrival = cfg.staleness_bound != 0  # async / SSP: every push applied as it arrives
        self.weighted = cfg.adaptive_batch and not self.on_arrival  # rounds of adaptive batches
        self.table = RowTable.from_config(cfg)  # sparse rows: the table's partitions take rows (wiiide.server.ps.sparse_rows)
        metrics.extra.setdefault("ps", {})["shard"] = self.stats

    # --- set-up -----------------------------------------------------------------------------------
    def listen(self) -> int:
        """Bind ``shard_port`` (0: a free port) and listen; returns the port. Raises OSError."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        configure_socket(sock, self.cfg, shard_congestion(self.cfg))
        try:
            sock.bind((shard_bind_host(self.cfg), self.cfg.shard_port))
            sock.listen(self.cfg.num_workers + self.cfg.max_handshakes + 64)
        except OSError:
            sock.close()
            raise
        self.listener = sock
        port = sock.getsockname()[1]
        self.stats["port"] = port
        return port

    def configure(self, partitions: list[Partition], params: np.ndarray, lossy_pulls: bool,
                  momentum: np.ndarray | None = None, start_step: int = 0) -> None:
        """Own the partitions of `partitions` whose shard is this one, starting from `params` (the whole
        flat float32 vector) at step `start_step` (a restored checkpoint's, with its `momentum`: the
        whole flat float32 vector, or None); `lossy_pulls`: the policy may pick a lossy codec (pulls
        become deltas, dense through the warm-up; a lossless codec other than none makes them deltas too,
        `wiiide.server.pace.feedback.pulls_as_deltas`). Checkpoints every checkpoint_every_steps (`wiiide.server.ps.checkpoints`)."""
        cfg = self.cfg
        for p in partitions:
            if p.shard != self.shard_id:
                continue
            values = torch.from_numpy(np.array(params[p.start:p.stop], dtype=np.float32, copy=True))
            values.grad = torch.zeros_like(values)
            optimizer = shard_optimizer(values, cfg)  # MomentumSGD; local SGD's outer step (wiiide.server.ps.local_sgd)
            if momentum is not None:  # MomentumSGD's buffer, or the outer step's Nesterov buffer
                load_optimizer_state(optimizer, momentum[p.start:p.stop])
            self.owned[p.index] = owned = _Owned(p, values, optimizer, PullReplica(values.numpy()), step=start_step)
            if self.on_arrival:
                owned.replicas = {r: PullReplica(values.numpy()) for r in sorted(self.worker_ranks)}
                owned.sent = dict.fromkeys(owned.replicas, start_step)
        self.checkpointer = ShardCheckpointer(cfg, self.shard_id, max(p.shard for p in partitions) + 1,
                                              [o.part for o in self.owned.values()], self.metrics, self.stats, self.log)
        self.lrs = LrRecord(self.lrs.schedule, start_step)
        self._lossy = lossy_pulls
        self._delta_pulls = lossy_pulls or pulls_as_deltas(cfg)
        self.stats.update({"partitions": len(self.owned), "bytes": sum(o.part.nbytes for o in self.owned.values())})

    def expect_workers(self, ranks) -> None:
        """Serve the workers of these ranks only (a run that lost some, `wiiide.server.ps.membership`): an update
        waits for their pushes alone. Call before `start`."""
        self.worker_ranks = set(ranks)
        self.num_workers = len(self.worker_ranks)

    def partition_states(self) -> list[tuple[int, int, np.ndarray | None, np.ndarray, np.ndarray]]:
        """(index, step, copies of its MomentumSGD buffer or None, of its last update's averaged gradient and of
        its values: float32 (numel,)) per owned partition (`wiiide.server.ps.membership`, `.paced_recovery`)."""
        with self._lock:
            return [(i, o.step, momentum_to_flat(o.optimizer) if isinstance(o.optimizer, MomentumSGD) else None,
                     o.param.grad.numpy().copy(), o.param.detach().numpy().copy())
                    for i, o in sorted(self.owned.items())]

    def start(self) -> "ShardServer":
        """Accept and serve peers on daemon threads; returns self."""
        threading.Thread(target=self._accept_loop, name=f"shard {self.shard_id} acceptor", daemon=True).start()
        self._heartbeats = Heartbeats(lambda: [p.conn for p in list(self.peers)], self.cfg.heartbeat_interval_s).start()
        return self

    def close(self) -> None:
        """Stop serving: close the listener and every peer (their threads end)."""
        self._closing.set()
        if self._heartbeats is not None:
            self._heartbeats.stop()
        if self.listener is not None:
            self.listener.close()
        for peer in list(self.peers):
            peer.outbox.put(None)
            peer.conn.close()
        self.stats.update({"updates": self.updates, "update_s": round(self.update_s, 4),
                           "push_spread_s": round(self.push_spread_s, 4), **self.lrs.to_dict()})
        links = [p for p in self.peers if p.role == ROLE_WORKER and p.rank != self.shard_id]  # not one's own (loopback)
        self.stats["link_wire_bytes"] = {"pushes_received": sum(p.push_wire_bytes for p in links),
                                         "pulls_sent": sum(p.pull_wire_bytes for p in links)}
        with self._lock:
            gaps = [o.replica.max_abs_gap(o.param.numpy()) for o in self.owned.values() if not self._is_rows(o)]
        self.stats.update({"pull_policy": self.policy.record["choices"], "replica_max_abs_gap": max(gaps, default=0.0),
                           "pull_uplink_bps_reported": self.policy.uplink.bps})
        self.policy.close()

    # --- joining ----------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self.listener is not None
        self.listener.settimeout(0.5)
        while not self._closing.is_set():
            for refusal in self._gate.expire(time.monotonic()):
                close_quietly(refusal.pending.sock)
            try:
                sock, addr = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            now = time.monotonic()
            pending = Pending(sock, str(addr[0]), f"{addr[0]}:{addr[1]}", now + self.cfg.handshake_timeout_s)
            decision = self._gate.arrive(pending, now)
            if decision.action == "start":
                threading.Thread(target=self._slot, args=(pending,), daemon=True).start()
            elif decision.refusal is not None:
                self._refused(decision.refusal.pending, decision.refusal.cause)

    def _refused(self, pending: Pending, cause: str) -> None:
        self.metrics.event("shard_connection_refused", shard=self.shard_id, peer=pending.peer, cause=cause[:300])
        self.log.error("shard %d refused %s: %s", self.shard_id, pending.peer, cause[:300])
        close_quietly(pending.sock)

    def _slot(self, pending: Pending | None) -> None:
        while pending is not None:
            peer = None
            try:
                peer = self._handshake(pending)
            except Exception as exc:  # ProtocolError, OSError, or an input that found a bug: a refusal
                self._refused(pending, f"{type(exc).__name__}: {exc}")
            pending, refused = self._gate.finish(pending.address, peer is not None, time.monotonic())
            for refusal in refused:
                self._refused(refusal.pending, refusal.cause)
            if peer is not None:
                threading.Thread(target=self._serve, args=(peer,), name=f"shard {self.shard_id} <- {peer.rank}",
                                 daemon=True).start()
                threading.Thread(target=self._send_loop, args=(peer,), name=f"shard {self.shard_id} -> {peer.rank}",
                                 daemon=True).start()

    def _handshake(self, pending: Pending) -> _Peer:
        """`wiiide.wire.handshake.accept_hello` (TLS first with ``tls`` on), bounded by the pending connection's
        deadline, then the hello's role and rank; the welcome's MAC covers the shard id.

        Raises:
            ProtocolError: a bad version, node id, nonce, MAC, rank or role (the peer is told, in a
                ``refused`` frame); TLSHandshakeError, OSError, DeadlineExceeded.
        """
        cfg = self.cfg
        hello = accept_hello(pending.sock, cfg, self.secret, self.metrics, self.log, pending.peer, pending.deadline,
                             self.policy.pool, shard_congestion(cfg), node_id_max_chars=160)
        try:
            meta, node_id = hello.meta, hello.node_id
            rank, role = meta.get("rank"), meta.get("role")
            if role not in (ROLE_WORKER, ROLE_COORDINATOR) or type(rank) is not int:  # noqa: E721
                raise ProtocolError(f"hello: role {role!r:.40} / rank {rank!r:.40}: expected worker "
                                    f"1..{self.num_workers} or coordinator 0")
            if not node_id.startswith(f"{role}-{rank}@"):
                raise ProtocolError("hello: node_id must start with '<role>-<rank>@' (the MAC covers it)")
            if (role == ROLE_WORKER and rank not in self.worker_ranks) or (role == ROLE_COORDINATOR and rank != 0):
                raise ProtocolError(f"hello: rank {rank} out of range for a {role}")
            with self._lock:
                if any(p.rank == rank and p.role == role for p in self.peers):
                    raise ProtocolError(f"{role} {rank} is already connected to shard {self.shard_id}")
                conn = send_welcome(hello, cfg, self.secret, self.shard_id, {"shard": self.shard_id}, f"{role} {rank}")
                peer = _Peer(conn, rank, role)
                self.peers.append(peer)
                version = getattr(conn.sock, "version", None)  # a TLSStream's, with tls on
                self.stats.setdefault("peer_tls", {})[f"{role} {rank}"] = version() if version else None
            return peer
        except ProtocolError as exc:
            tell_refused(hello.conn, str(exc))
            raise

    # --- serving ----------------------------------------------------------------------------------
    def _send_loop(self, peer: _Peer) -> None:
        drain_outbox(peer.outbox, peer.conn, lambda frame: frame, lambda exc: self._fail(peer, exc),
                     lambda frame, cpu_s: self._pull_sent(peer, frame, cpu_s))

    def _pull_sent(self, peer: _Peer, frame: Frame, cpu_s: float) -> None:
        self.metrics.add_stage_cpu("pull_send", frame_step(frame), cpu_s)
        peer.pull_wire_bytes += frame.wire_nbytes if frame.kind in (DENSE_KIND, LOSSY_KIND, ROWS_PULL_KIND) else 0

    def _serve(self, peer: _Peer) -> None:
        try:
            while True:
                cpu0 = time.thread_time()  # a blocked receive takes none
                msg = peer.conn.receive([DENSE_KIND, LOSSY_KIND, ROWS_PUSH_KIND, "pull_final", CHECKPOINT_AT, "bye"])
                if msg.kind == "bye":  # the peer is done: its disconnect is no failure
                    peer.outbox.put(None)
                    peer.conn.close()
                    return
                if msg.kind == "pull_final":
                    peer.outbox.put(self._final_frame())
                    continue
                if msg.kind == CHECKPOINT_AT:  # the coordinator's time trigger (checkpoint_every_s)
                    if peer.role != ROLE_COORDINATOR or self.checkpointer is None:
                        raise ProtocolError(f"{CHECKPOINT_AT} from {peer.role} {peer.rank}: only the coordinator "
                                            "announces checkpoint steps, after the plan")
                    with self._lock:
                        self.checkpointer.announce(msg.meta.get("step"), max(o.step for o in self.owned.values()))
                    continue
                if peer.role != ROLE_WORKER:
                    raise ProtocolError("only workers push")
                self.policy.observe_received(msg, ("worker", peer.rank))  # network-aware's link estimate
                peer.push_wire_bytes += msg.wire_nbytes
                self.metrics.add_stage_cpu("push_receive", msg.meta.get("step"),
                                           time.thread_time() - cpu0 - msg.decode_cpu_s)
                frame = self._on_push(peer.rank, msg)
                if frame is not None:
                    for other in list(self.peers):  # on arrival, the pushing worker's pull only
                        if other.role == ROLE_WORKER and (not self.on_arrival or other is peer):
                            other.outbox.put(self._to_worker(frame, other.rank))
        except Exception as exc:  # the peer is gone, or sent what it must not: the shard cannot go on
            self._fail(peer, exc)

    def _to_worker(self, frame: Frame, rank: int) -> Frame:
        """The pull `frame` as sent to worker `rank`: with network-aware, its meta also carries the rate that
        worker's pushes arrived at here (`CompressionPolicy.feedback_meta`), for its codec choice on this
        link; the payload buffers are shared by every worker's copy (`wiiide.wire.encode.with_meta`)."""
        if not self.policy.learns_uplink:
            return frame
        return with_meta(frame, self.policy.feedback_meta(("worker", rank)))

    def _on_push(self, rank: int, msg) -> object | None:
        """Record one push; the pull frame when it completed its partition's step, else None.

        Raises:
            ProtocolError: an unknown partition, a wrong step, a second push or a bad tensor.
        """
        step, index = msg.meta.get("step"), msg.meta.get("partition")
        owned = self.owned.get(index) if type(index) is int else None  # noqa: E721
        if owned is None:
            raise ProtocolError(f"push for partition {index!r:.40}, which shard {self.shard_id} does not own")
        cpu0 = time.thread_time()
        if self._is_rows(owned) != (msg.kind == ROWS_PUSH_KIND):
            raise ProtocolError(f"partition {index} takes {'row' if self._is_rows(owned) else 'dense'} pushes, not {msg.kind}")
        if self._is_rows(owned):
            values = self.table.check(msg, owned.part)  # (ids, rows), copied off the reader's buffer
        else:
            values = msg.tensor(f"p{index}")
            if len(msg.tensors) != 1 or values.shape != (owned.part.numel,) or values.dtype != np.float32:
                raise ProtocolError(f"push of partition {index}: {len(msg.tensors)} tensors, {values.shape} "
                                    f"{values.dtype}, expected one ({owned.part.numel},) float32")
            values = received_values(msg)  # the reader reuses its buffer for the next frame
        self.metrics.add_stage_cpu("push_decode", step, msg.decode_cpu_s + time.thread_time() - cpu0)
        with self._lock:
            frame = (apply_on_arrival(self, owned, rank, values, step) if self.on_arrival
                     else self._in_round(owned, rank, values, step, msg.meta))
            if frame is None:
                return None
            ready = (self.checkpointer.offer(index, owned.step, owned.param.numpy(), owned.optimizer)
                     if self.checkpointer is not None else None)
        if ready is not None:  # every partition of this shard reached a checkpoint step: write it, unlocked
            self.checkpointer.write(*ready)
        return frame

    def _in_round(self, owned: _Owned, rank: int, values, step, meta: dict):
        """Rounds: keep `rank`'s push of `step`; the pull frame once every worker's is in, else None. Holds
        the lock. Raises ProtocolError: a wrong step or a second push."""
        index = owned.part.index
        if step != owned.step:
            raise ProtocolError(f"push of partition {index} for step {step!r:.40}, the shard is at step {owned.step}")
        if rank in owned.pushes:
            raise ProtocolError(f"worker {rank} pushed partition {index} twice at step {step}")
        if not owned.pushes:
            owned.first_push_s = time.perf_counter()
        owned.pushes[rank] = values
        if self.weighted:
            owned.samples[rank] = push_samples(meta, index)
        return self._update(owned) if len(owned.pushes) == self.num_workers else None

    def _update(self, owned: _Owned):
        """Average the pushes (in rank order), one optimizer step, the pull frame. Holds the lock."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        self.push_spread_s += t0 - owned.first_push_s  # first to last push: how far apart the workers are
        step, index = owned.step, owned.part.index
        owned.optimizer.lr = self.lrs.schedule.lr(step)
        self.lrs.applied(step, owned.optimizer.lr)
        if self._is_rows(owned):  # the touched rows' SGD (local SGD: rate 1) and their pull; weighted by samples
            meta, lr = {"step": step, "partition": index}, rows_rate(self.cfg, owned.optimizer.lr)
            frame = apply_rows(self.table, owned.part, owned.param, owned.pushes, lr, meta, self.weighted and owned.samples or None)
        else:
            grad = owned.param.grad
            grad.zero_()
            total = sum(owned.samples.values())
            for rank in sorted(owned.pushes):  # the mean; adaptive batches: weighted by samples
                grad.add_(torch.from_numpy(owned.pushes[rank]), alpha=owned.samples[rank] / total if self.weighted else 1)
            if not self.weighted:
                grad.div_(len(owned.pushes))
            owned.optimizer.step()
            dense = not self._delta_pulls or (self._lossy and step < self._warmup_steps)
            frame = owned.replica.frame_for(self.policy, {"step": step, "partition": index}, f"p{index}",
                                            owned.param.numpy(), dense)  # deltas when compressed (pulls_as_deltas)
        owned.pushes.clear()
        owned.samples.clear()
        owned.step += 1
        self.updates += 1
        self.update_s += time.perf_counter() - t0
        self.metrics.add_stage_cpu("update", step, time.thread_time() - cpu0)
        if self.metrics.trace is not None:
            self.metrics.trace.add("update", "update", step, time.perf_counter() - t0, partition=index)
        return frame

    def _is_rows(self, owned: _Owned) -> bool:
        return self.table is not None and self.table.owns(owned.part)

    def _final_frame(self):
        with self._lock:
            tensors = [WireTensor(f"p{i}", o.param.numpy().copy()) for i, o in sorted(self.owned.items())]
            steps = {str(i): o.step for i, o in self.owned.items()}
        return encode_message("final", {"shard": self.shard_id, "steps": steps}, tensors)

    def _fail(self, peer: _Peer, exc: BaseException) -> None:
        if self._closing.is_set():
            return
        cause = f"shard {self.shard_id} lost {peer.role} {peer.rank}: {type(exc).__name__}: {exc}"
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = cause
            self.lost.append(cause)
        peer.conn.close()
        if not first:
            return
        self.metrics.event("shard_failed", shard=self.shard_id, cause=cause[:300])
        self.log.error("%s", cause)
        frame = encode_message("shard_failed", {"shard": self.shard_id, "cause": cause[:500]})
        for other in list(self.peers):
            if other is not peer:
                other.outbox.put(frame)

