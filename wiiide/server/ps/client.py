"""A node's connections to every server shard: pushes out from backward hooks, pulls in.

A worker pushes each partition's gradient to the partition's shard the moment backward has produced
it: per-parameter hooks (``Tensor.register_post_accumulate_grad_hook``) count down the parameters
each partition overlaps, as DDP's Reducer marks a bucket ready when its last gradient arrives, so
the last layers' partitions are on the wire while backward still runs. Each shard connection has a
sender thread (encodes with error feedback, `wiiide.server.pace.feedback.ErrorFeedback`, and sends) and a
receiver thread (decodes pulls into an inbox): full duplex. The main thread applies the pulls (an
absolute value or a delta) once backward is over and all partitions of the step are in.

Sparse rows (`wiiide.server.ps.sparse_rows`): a table partition's touched rows out after backward, changed rows in.

The coordinator uses the same client with role ``coordinator`` (no pushes) to pull the final
parameters (``pull_final``).

Handshake (`wiiide.server.ps.outbox.connect_shard`): the dialling side of `wiiide.wire.handshake` (TLS with ``tls``
on); the hello's node id is ``<role>-<rank>@<node id>`` (so the MAC covers the rank) and the shard's
welcome MAC covers its shard id.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from wiiide.codecs.policy import CompressionPolicy
from wiiide.config import RunConfig
from wiiide.errors import ProtocolError
from wiiide.log import TieredLog
from wiiide.metrics import NodeMetrics
from wiiide.training.model import FlatParams
from wiiide.wire.node import Connection, Heartbeats
from wiiide.server.ps.checkpoints import CHECKPOINT_AT
from wiiide.server.pace.feedback import DENSE_KIND, LOSSY_KIND, ErrorFeedback, received_values
from wiiide.server.ps.partition import Partition
from wiiide.server.ps.outbox import ShardFailed, connect_shard, drain_outbox, frame_step
from wiiide.server.ps.shard_pacing import CACHED_KIND
from wiiide.server.ps.sparse_rows import ROWS_PULL_KIND, RowTable, WorkerRows, step_gradient
from wiiide.wire.encode import encode_message, with_meta
from wiiide.wire.sockets import congestion_of, tcp_cwnd_bytes

BYE = encode_message("bye")
PULL_FINAL = encode_message("pull_final")


PUSH_NOTSENT_LOWAT_BYTES = 16 * 1024  # push_schedule ordered: unsent bytes a push may leave behind when the next starts
PUSH_CWND_SAMPLES = 4096  # pushes whose connection's congestion window is kept (push_cwnd_record)


@dataclass
class _Link:
    shard: int
    conn: Connection
    policy: CompressionPolicy
    outbox: "queue.Queue" = field(default_factory=queue.Queue)
    lost: bool = False  # its connection broke: `close` does not wait for its outbox


def push_meta(policy: CompressionPolicy, step: int, index: int) -> dict:
    """The meta of a push of partition `index` at `step` on a link whose pushes `policy` encodes: with
    network-aware (`CompressionPolicy.learns_uplink`) also the rate the shard's pulls arrived at here
    (`CompressionPolicy.feedback_meta`), which the shard's policy takes as its uplink to this worker."""
    meta = {"step": step, "partition": index}
    if policy.learns_uplink:
        meta.update(policy.feedback_meta())
    return meta


class ShardClient:
    """Connections to every shard (`addresses[s]` = (host, port, TLS name: the name its certificate must
    carry, "" for the host) of shard s) for a node of `role`/`rank`.

    Workers call `attach` (the model, the partitions), then per step `begin_step`, backward (the hooks
    push), `finish_step` (waits for and applies the pulls). The coordinator calls `pull_final`.
    `close` says goodbye to every shard.
    """

    def __init__(self, cfg: RunConfig, secret: bytes, metrics: NodeMetrics, log: TieredLog,
                 addresses: Sequence[tuple[str, int, str]], role: str, rank: int, node_id: str) -> None:
        self.cfg, self.metrics, self.log = cfg, metrics, log
        self.links: list[_Link] = []
        self.inbox: queue.Queue = queue.Queue()
        self.feedback = ErrorFeedback("push")
        self._closing = threading.Event()
        self._partitions: list[Partition] = []
        self._flat: FlatParams | None = None
        self._rows: WorkerRows | None = None  # sparse rows: the table's partitions (wiiide.server.ps.sparse_rows)
        self._step = 0
        self._samples: int | None = None  # adaptive batches: the step's samples, in every push's meta
        self.staleness = 0  # async / SSP: the largest staleness the shards reported for the last step's pushes
        self.cached = 0  # ssp_cache: how many of the last step's pulls the copy held served (`CACHED_KIND`)
        self.versions: list[int | None] = []  # async / SSP: partition i's version in this copy (its last pull's)
        self._dense = True
        self._lossy = False
        self._ordered = cfg.push_schedule == "ordered"
        self._rank = rank
        # Each push's congestion window (bytes) as it starts: what TCP may have in flight (push_cwnd_record).
        self._push_cwnd_bytes: deque[int] = deque(maxlen=PUSH_CWND_SAMPLES)
        # push_schedule ordered: the pushes in backward's order (the encoder's input), then their frames (the
        # sender's): the next pushes are encoded while one is on the wire.
        self._pushes: queue.Queue = queue.Queue()
        self._encoded: queue.Queue = queue.Queue()
        # Heartbeats from the first link on: a shard whose node has not yet had its plan (sent one node after
        # the other, 26 MB each for the 26 MB model) may answer after io_timeout_s; the others must wait.
        self._heartbeats = Heartbeats(lambda: [link.conn for link in self.links], cfg.heartbeat_interval_s).start()
        policy = None
        try:
            for shard, (host, port, tls_name) in enumerate(addresses):
                policy = CompressionPolicy.from_config(cfg.replace(lossy_warmup_steps=0))
                conn = connect_shard(cfg, secret, metrics, log, host, port, shard, role, rank, node_id, policy.pool,
                                     tls_name or None)
                if self._ordered and hasattr(socket, "TCP_NOTSENT_LOWAT"):  # a send returns once its bytes left
                    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, PUSH_NOTSENT_LOWAT_BYTES)
                self.links.append(_Link(shard, conn, policy))
                policy = None
        except BaseException:
            self._heartbeats.stop()
            for link in self.links:
                link.conn.close()
                link.policy.close()
            if policy is not None:
                policy.close()
            raise
        for link in self.links:
            threading.Thread(target=self._receive_loop, args=(link,), name=f"pull <- {link.shard}", daemon=True).start()
            threading.Thread(target=self._send_loop, args=(link,), name=f"push -> {link.shard}", daemon=True).start()
        if self._ordered:
            threading.Thread(target=self._ordered_encode_loop, name="pushes, encoder", daemon=True).start()
            threading.Thread(target=self._ordered_push_loop, name="pushes, ordered", daemon=True).start()
        others = [link for link in self.links if link.shard != rank]
        if others:  # what shard_tcp_congestion put in force (one's own shard is on loopback)
            metrics.extra.setdefault("ps", {})["tcp_congestion"] = congestion_of(others[0].conn.sock)

    # --- worker -----------------------------------------------------------------------------------
    def attach(self, model: nn.Module, flat: FlatParams, partitions: Sequence[Partition], lossy: bool,
               hooks: bool = True) -> None:
        """Register the hooks that push each partition once every parameter overlapping it has its gradient.

        `lossy`: the policy may choose a lossy codec (after ``lossy_warmup_steps`` steps); `hooks` False:
        none (local SGD's backward passes push nothing: `push_all` pushes the round's model delta).
        """
        self._flat, self._partitions, self._lossy = flat, list(partitions), lossy
        self.versions = [None] * len(self._partitions)
        table = RowTable.from_config(self.cfg)
        self._rows = WorkerRows(table, model, flat.numel, partitions) if table is not None else None
        starts = np.array([p.start for p in partitions])
        overlaps: list[list[int]] = []
        offset = 0
        params = list(model.parameters())
        for p in params:
            first = int(np.searchsorted(starts, offset, side="right")) - 1
            covered = []
            i = first
            while i < len(partitions) and partitions[i].start < offset + p.numel():
                covered.append(i)
                i += 1
            # a row partition is pushed by `gradient`, not by the hooks (the table gets no dense gradient)
            overlaps.append([i for i in covered if table is None or not table.owns(partitions[i])])
            offset += p.numel()
        self._needed = [0] * len(partitions)
        for covered in overlaps:
            for i in covered:
                self._needed[i] += 1
        self._remaining = list(self._needed)
        self._hooks = [p.register_post_accumulate_grad_hook(lambda _p, covered=covered: self._grad_ready(covered))
                       for p, covered in zip(params, overlaps) if hooks]  # close removes them

    def begin_step(self, step: int, micro_batches: int = 1, samples: int | None = None) -> None:
        """Arm the hooks for `step` (call before backward) of `micro_batches` backward passes (gradient
        accumulation, ``grad_accum_steps``): each partition is pushed once, after the last pass has
        accumulated into every parameter it overlaps. `samples` (the batch's; None: not sent) goes in
        every push's meta, for shards that weight pushes by it (adaptive batches in rounds)."""
        self._step, self._samples = step, samples
        self._dense = not self._lossy or step < self.cfg.lossy_warmup_steps
        self._remaining = [n * micro_batches for n in self._needed]

    def gradient(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro_batches: int, loss_fn,
                 scope: Any = None) -> float:
        """The batch's mean loss, its gradient pushed as it is made (`wiiide.server.ps.sparse_rows.step_gradient`;
        `scope`: the worker's `wiiide.tensor_memory.ForwardScope`)."""
        return step_gradient(self._rows, model, self._flat, x, y, micro_batches, loss_fn, self._step,
                             self._send_rows, scope)

    def _send_rows(self, part: Partition, frame) -> None:
        """Queue a row partition's push, with the armed step's ``samples`` (weighted as the dense pushes)."""
        extra = {"samples": self._samples} if self._samples is not None else {}
        self.links[part.shard].outbox.put(with_meta(frame, extra))

    def _grad_ready(self, covered: list[int]) -> None:
        # Tail first, as backward runs and as DDP's Reducer fills its buckets: with partition_balance
        # pipeline the coordinator's range is the tail, so its pushes leave first.
        for i in reversed(covered):
            self._remaining[i] -= 1
            if self._remaining[i] == 0:
                self._enqueue(self._partitions[i])

    def _enqueue(self, part: Partition) -> None:
        """Queue the push of `part` (its values in ``flat.grads``) for the step armed by `begin_step`."""
        (self._pushes if self._ordered else self.links[part.shard].outbox).put((self._step, part, self._dense))

    def push_all(self, step: int, samples: int | None = None, touched: torch.Tensor | None = None) -> None:
        """Push every partition of ``flat.grads`` for `step` at once, tail first, without backward's hooks:
        local SGD's model delta (`wiiide.server.ps.local_sgd`; `samples` as `begin_step`; with sparse rows
        a row partition's push is the rows of `touched`, int64 table rows); `finish_step` then waits for
        the pulls. The senders read ``flat.grads`` until every shard has answered: leave it unchanged."""
        self.begin_step(step, 0, samples)
        for part in reversed(self._partitions):
            if self._rows is None or not self._rows.table.owns(part):
                self._enqueue(part)
        if self._rows is not None:
            rows = self._flat.grads[:self._rows.table.numel].view(-1, self._rows.table.dim)[touched]
            self._rows.push(touched, rows, step, self._send_rows)

    @property
    def rows(self) -> WorkerRows | None:
        """The sparse rows' worker side (`wiiide.server.ps.sparse_rows.WorkerRows`), None without them."""
        return self._rows

    def finish_step(self, step: int) -> float:
        """Wait for every partition's pull of `step` and apply it; returns the seconds waited.

        Raises:
            ShardFailed: a shard failed or a connection broke; ProtocolError: a pull for another step.
        """
        assert self._flat is not None
        if any(self._remaining):
            raise ProtocolError(f"step {step}: backward left {sum(1 for r in self._remaining if r)} partitions "
                                "without a gradient (a parameter unused by the loss?)")
        t0 = time.perf_counter()
        params = self._flat.params
        self.staleness = self.cached = 0
        for _ in range(len(self._partitions)):
            kind, meta, values = self._next()
            index = meta.get("partition")
            if meta.get("step") != step or type(index) is not int or not 0 <= index < len(self._partitions):  # noqa: E721
                raise ProtocolError(f"pull for step {meta.get('step')!r:.40} partition {index!r:.40}, expected step {step}")
            part = self._partitions[index]
            staleness = meta.get("staleness", 0)
            self.staleness = max(self.staleness, staleness if type(staleness) is int else 0)  # noqa: E721
            if type(meta.get("version")) is int:  # noqa: E721 (wiiide.server.ps.paced_recovery)
                self.versions[index] = meta["version"]
            if kind == CACHED_KIND:  # ssp_cache: the copy held serves the next task (wiiide.server.ps.shard_pacing)
                self.cached += 1
                continue
            if kind == "rows":  # a row partition's changed rows (checked by the receiver: WorkerRows.read)
                self._rows.apply(params, part, *values, copy_in=meta.get("set") is True)
                continue
            if values.shape != (part.numel,):
                raise ProtocolError(f"pull of partition {index}: {values.shape}, expected ({part.numel},)")
            target = params[part.start:part.stop]
            cpu0 = time.thread_time()
            with torch.no_grad():
                if meta.get("delta"):
                    target += torch.from_numpy(values)
                else:
                    target.copy_(torch.from_numpy(values))
            self.metrics.add_stage_cpu("pull_decode", step, time.thread_time() - cpu0)
        return time.perf_counter() - t0

    def _next(self, timeout_s: float | None = None):
        try:
            item = self.inbox.get(timeout=timeout_s or self.cfg.io_timeout_s * 3)
        except queue.Empty:
            raise ShardFailed(f"no pull from the shards for {timeout_s or self.cfg.io_timeout_s * 3:g} s") from None
        if isinstance(item, BaseException):
            raise item
        return item

    def _sample_cwnd(self, link: _Link) -> None:
        """Keep the congestion window of `link`'s connection as a push to it starts (push_cwnd_record)."""
        if link.shard != self._rank:  # one's own shard is on loopback
            cwnd = tcp_cwnd_bytes(link.conn.sock)
            if cwnd is not None:
                self._push_cwnd_bytes.append(cwnd)

    def _push_frame(self, link: _Link, step: int, part: Partition, dense: bool):
        """The push of `part`'s gradient (with the push residual: `ErrorFeedback.encode`) for `link`."""
        cpu0 = time.thread_time()
        values = self._flat.grads[part.start:part.stop].numpy()
        meta = push_meta(link.policy, step, part.index)
        if self._samples is not None:
            meta["samples"] = self._samples
        frame = self.feedback.encode(link.policy, meta, f"p{part.index}", values, dense)[0]
        self.metrics.add_stage_cpu("push_encode", step, time.thread_time() - cpu0)
        return frame

    def _send_loop(self, link: _Link) -> None:
        def to_frame(item):
            if not isinstance(item, tuple):
                return item  # a ready frame (bye, pull_final, checkpoint_at)
            self._sample_cwnd(link)
            return self._push_frame(link, *item)

        drain_outbox(link.outbox, link.conn, to_frame, lambda exc: self._push_failed(link, exc), self._sent)

    def _sent(self, frame, cpu_s: float) -> None:
        self.metrics.add_stage_cpu("push_send", frame_step(frame), cpu_s)

    def _push_failed(self, link: _Link, exc: Exception) -> None:
        link.lost = True
        self.inbox.put(ShardFailed(f"push to shard {link.shard} failed: {type(exc).__name__}: {exc}"))

    def _ordered_encode_loop(self) -> None:
        """push_schedule ordered: encode every push (error feedback and codec) in the order backward made
        them, ahead of `_ordered_push_loop`. With TCP_NOTSENT_LOWAT the link has only
        `PUSH_NOTSENT_LOWAT_BYTES` (1.3 ms at 100 Mbit/s) left to send when a send returns: a push encoded
        only then (error feedback and int4 on a 0.65 MB partition: 0.4-0.6 ms on a quiet core, `timeit`,
        several times that with nine containers on two cores) would leave the link idle between every
        two pushes."""
        while True:
            item = self._pushes.get()
            if item is None:
                self._encoded.put(None)
                return
            step, part, dense = item
            link = self.links[part.shard]
            try:
                self._encoded.put((link, self._push_frame(link, step, part, dense)))
            except Exception as exc:
                if not self._closing.is_set():
                    self._push_failed(link, exc)
                self._encoded.put(None)
                return

    def _ordered_push_loop(self) -> None:
        """push_schedule ordered: send every push, encoded by `_ordered_encode_loop`, in the order backward
        made them, on its shard's connection, one after the other; with TCP_NOTSENT_LOWAT a send returns
        only once all but `PUSH_NOTSENT_LOWAT_BYTES` of it have left the socket, so a worker's link
        carries one partition's push at a time and every worker pushes a partition at about the same time."""
        while True:
            item = self._encoded.get()
            if item is None:
                return
            link, frame = item
            self._sample_cwnd(link)
            try:
                cpu0 = time.thread_time()
                link.conn.send([frame])
                self._sent(frame, time.thread_time() - cpu0)
            except Exception as exc:
                if not self._closing.is_set():
                    self._push_failed(link, exc)
                return

    def _receive_loop(self, link: _Link) -> None:
        try:
            while not self._closing.is_set():
                cpu0 = time.thread_time()  # a blocked receive takes none
                msg = link.conn.receive([DENSE_KIND, LOSSY_KIND, ROWS_PULL_KIND, CACHED_KIND, "final", "shard_failed"])
                if msg.kind == "shard_failed":
                    raise ShardFailed(f"shard {link.shard} failed: {str(msg.meta.get('cause'))[:500]}")
                if msg.kind == "final":
                    arrays = {t.name: np.array(t.array, dtype=np.float32, copy=True) for t in msg.tensors}
                    self.inbox.put(("final", msg.meta, arrays))
                    continue
                if msg.kind == CACHED_KIND:
                    self.inbox.put((CACHED_KIND, msg.meta, None))
                    continue
                if msg.kind == ROWS_PULL_KIND and self._rows is not None:
                    self.inbox.put(("rows", msg.meta, self._rows.read(msg)[1:]))
                    continue
                if len(msg.tensors) != 1 or msg.tensors[0].dtype != "float32":
                    raise ProtocolError("a pull carries one float32 tensor")
                link.policy.observe_received(msg)  # network-aware: this link's estimate (its pushes use link.policy)
                step = msg.meta.get("step")
                self.metrics.add_stage_cpu("pull_receive", step, time.thread_time() - cpu0 - msg.decode_cpu_s)
                cpu0 = time.thread_time()
                values = received_values(msg)
                self.metrics.add_stage_cpu("pull_decode", step, msg.decode_cpu_s + time.thread_time() - cpu0)
                self.inbox.put(("pulled", msg.meta, values))
        except Exception as exc:
            link.lost = link.lost or not isinstance(exc, ShardFailed)  # a shard's shard_failed: its link still works
            if not self._closing.is_set():
                cause = exc if isinstance(exc, ShardFailed) else ShardFailed(
                    f"lost shard {link.shard} ({link.conn.name}): {type(exc).__name__}: {exc}")
                self.inbox.put(cause)

    # --- coordinator ------------------------------------------------------------------------------
    def pull_final(self, partitions: Sequence[Partition], numel: int) -> np.ndarray:
        """The shards' exact current parameters, as one flat float32 vector of `numel`.

        Raises:
            ShardFailed / ProtocolError: a shard failed or answered with other partitions.
        """
        for link in self.links:
            link.outbox.put(PULL_FINAL)
        out = np.zeros(numel, dtype=np.float32)
        seen = set()
        for _ in self.links:
            kind, meta, arrays = self._next()
            if kind != "final":
                raise ProtocolError(f"expected the shards' final parameters, got {kind!r}")
            for name, values in arrays.items():
                index = int(name[1:]) if name[1:].isdigit() else -1
                if not 0 <= index < len(partitions) or values.shape != (partitions[index].numel,):
                    raise ProtocolError(f"final parameters: bad partition {name!r:.40} {values.shape}")
                out[partitions[index].start:partitions[index].stop] = values
                seen.add(index)
        if len(seen) != len(partitions):
            raise ProtocolError(f"final parameters cover {len(seen)} of {len(partitions)} partitions")
        return out

    def announce_checkpoint(self, step: int) -> None:
        """The coordinator's time trigger: every shard checkpoints at `step` (`ShardCheckpointer.announce`)."""
        frame = encode_message(CHECKPOINT_AT, {"step": int(step)})
        for link in self.links:
            link.outbox.put(frame)

    def policy_records(self) -> list[dict]:
        """Each link's push policy choices (codec counts by kind)."""
        return [link.policy.record["choices"] for link in self.links]

    def push_cwnd_record(self) -> dict[str, int] | None:
        """The pushes' congestion window as each push started (TCP_INFO, `wiiide.wire.sockets.tcp_cwnd_bytes`), over
        the latest `PUSH_CWND_SAMPLES` pushes to other nodes: ``median_bytes``, ``p90_bytes``, ``samples``; None before
        any. The round model (`harness.analysis.point_model`) takes the median as how far ordered pushes run ahead."""
        samples = list(self._push_cwnd_bytes)
        return {"median_bytes": int(np.median(samples)), "p90_bytes": int(np.percentile(samples, 90)),
                "samples": len(samples)} if samples else None

    def uplink_records(self) -> list[float | None]:
        """Each link's uplink as its shard reported it (bit/s, `CompressionPolicy.uplink`; None: no report)."""
        return [link.policy.uplink.bps for link in self.links]

    def close(self) -> None:
        """Say goodbye to every shard, stop the threads and remove the hooks `attach` registered."""
        self._closing.set()
        for hook in getattr(self, "_hooks", []):
            hook.remove()
        self._heartbeats.stop()
        self._pushes.put(None)
        for link in self.links:
            link.outbox.put(BYE)
            link.outbox.put(None)
        time.sleep(0)  # let the senders run
        for link in self.links:
            deadline = time.monotonic() + 1.0
            while not link.lost and not link.outbox.empty() and time.monotonic() < deadline:
                time.sleep(0.005)
            link.conn.close()
            link.policy.close()
