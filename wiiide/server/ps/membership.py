"""Membership of a sharded run (``ps_shards`` > 1): a worker lost mid-run, and the run going on without it.

A worker lost mid-run (killed, its link cut, silent for ``io_timeout_s``) takes its pushes and, when it
hosts one, its shard with it. The run goes on, as torchft's per-step quorum does (its ``manager.py``: a
new quorum when a member leaves, the state recovered live from a healthy peer), in *incarnations*:

1. **Noticed.** A shard that loses a peer fails and tells its other peers (`wiiide.server.ps.shard`); each
   worker then reports ``ps_failed`` to the coordinator, whose barrier also sees the lost connection.
   The coordinator closes its shard and client, waits `wiiide.server.ps.session.LOSS_GRACE_S` for the other
   peers' reports, and declares incarnation n + 1 (`Membership.recover`).
2. **State from a healthy peer.** At the barrier's step B every worker holds the whole model: its copy,
   assembled from the pulls of step B - 1, is the same on every worker (every worker applies the same
   pull frames). Each worker keeps the copies of its latest `SNAPSHOTS_KEPT` steps
   (`wiiide.server.ps.survivor.StepSnapshots`).
   The coordinator sends ``ps_recover`` {"step": B} to every worker still connected; each answers
   ``ps_state`` with the SHA-256 of its copy of step B, the newest step it finished, and the momentum of
   the partitions of its old shard that are at step B; the lowest rank also sends the copy itself
   (``send_params``; if it is lost meanwhile, the next is asked). A worker that does not answer is
   dropped (`Coordinator.drop`).
3. **Re-plan.** The shards are re-planned over the surviving nodes (``ps_shards: all``: the coordinator
   and every survivor; an integer k: at most k), told by ``ps_rehost`` {"ps_shards", "shard"}, and the
   usual join, plan and ready follow (`wiiide.server.ps.session`): each new shard starts from the copy of step B
   and, for the partitions whose momentum survived, that momentum (the lost shard's momentum restarts at
   zero, as do the error-feedback residuals). The barrier goes on at step B with the batch stream seeded
   with seed + B.
4. **Checked.** Every worker's ``ps_ready`` carries the SHA-256 of its copy and of each shard's slice of
   it (`copy_digests`); the coordinator pulls every partition from the new shards and records the
   digests of every shard and every worker's copy, and whether they agree (``digests_equal``).

Under async and a staleness bound no step has the same copy on every worker: step 2 then takes the
surviving shards' partitions and, for the lost shard's, the survivors' newest copies
(`wiiide.server.ps.paced_recovery`); steps 3 and 4 are the same.

Why a peer's copy and not the newest checkpoint: the copy is the state of the last step the barrier
passed, so only the step in flight is lost (a checkpoint loses up to ``checkpoint_every_steps``); it
needs no checkpoints and no folder every node reads; and it is already on every survivor. What a
checkpoint has that it lacks, the lost shard's momentum, restarts at zero.

The record (`Membership.records`, the coordinator's ``ps.recoveries``): per recovery the incarnation,
the lost ranks and the cause, the step resumed, ``steps_lost`` (steps a survivor finished beyond B,
whose work is redone), ``recovery_s`` (the loss noticed to the first step of the new incarnation), the
momentum partitions kept, and the digests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from wiiide.errors import ProtocolError, WiiideError
from wiiide.training.evaluation import record_held_out
from wiiide.wire.node import EXIT_PEER_LOST, NodeFailure
from wiiide.server.ps.digest import params_digest
from wiiide.server.ps.paced_recovery import assemble
from wiiide.server.ps.partition import Partition, resolve_shards
from wiiide.server.ps.placement import place_shards
from wiiide.server.ps.plan import PS_FAILED
from wiiide.wire.tensors import to_wire
from wiiide.wire.encode import encode_message

PS_RECOVER = "ps_recover"  # coordinator -> worker: {"step", "incarnation", "send_params", "on_arrival"}: PS_STATE
PS_STATE = "ps_state"  # worker -> coordinator: {"step", "sha256", "latest_step", "momentum"}; params, m<i> (on
# arrival also "versions", "owned" and s<i>: wiiide.server.ps.paced_recovery.worker_answer)
PS_REHOST = "ps_rehost"  # coordinator -> worker: {"ps_shards", "shard": id or None, "incarnation"}
SNAPSHOTS_KEPT = 4  # a survivor is at most HANDOUT_AHEAD + 1 steps past the barrier
STALE_KINDS = ("step_done", PS_FAILED)  # a worker's frames of the old incarnation still on their way


class Replan(WiiideError):
    """The barrier drained its steps for a worker that came back: start the next incarnation with it."""


def sha256_of(values: np.ndarray) -> str:
    """The SHA-256 of a float32 vector's bytes (`wiiide.server.ps.digest.params_digest`)."""
    return params_digest(values)["sha256"]


def copy_digests(params: np.ndarray, partitions: Sequence[Partition], num_shards: int) -> dict:
    """{"sha256": of the whole flat float32 (numel,) vector, "shards": [the SHA-256 of shard s's
    partitions of it, concatenated in partition order, for s in 0..num_shards-1]}."""
    shards = [sha256_of(np.concatenate([params[p.start:p.stop] for p in partitions if p.shard == s]
                                       or [np.zeros(0, np.float32)])) for s in range(num_shards)]
    return {"sha256": sha256_of(params), "shards": shards}


@dataclass
class RestoredState:
    """What a new incarnation starts from: the step, the flat float32 (numel,) parameters and momentum
    (None when momentum is 0)."""

    step: int
    params: np.ndarray
    momentum: np.ndarray | None


@dataclass
class Incarnation:
    """One incarnation of a sharded run: its number (1 first), its workers (`WorkerSlot`s, by rank), its
    shard count, which worker hosts which shard (rank -> shard id; shard 0 is the coordinator's) and the
    state it starts from (None for the first: a fresh start or the checkpoints)."""

    number: int
    workers: list
    num_shards: int
    hosts: dict[int, int]
    state: RestoredState | None = None
    record: dict | None = None  # its recovery record, until its first step
    noticed_s: float = 0.0  # perf_counter when the loss that started it was noticed
    extra: dict = field(default_factory=dict)  # what the first incarnation decided (piece rule, probe)
    partitions: list = field(default_factory=list)  # its plan's, once made


class Membership:
    """The coordinator's side (module docstring). `coord` gives cfg, metrics, log, `members()` and `drop()`."""

    def __init__(self, coord, numel: int, num_shards: int) -> None:
        self.coord, self.numel = coord, numel
        workers = [w for w in coord.members() if w.alive]
        hosts = self._place(workers, num_shards)
        self.current = Incarnation(1, workers, len(hosts) + 1, hosts)
        self.records: list[dict] = []
        self.train_start_s: float | None = None  # the first incarnation's training start (duration_s counts from it)
        self.noticed_s = 0.0
        self.replan = False  # a worker waits to rejoin: the barrier hands out no more batches
        self.in_row = 0  # recoveries since the last step
        self.unreported = 0  # on-arrival pacing: tasks handed out and not reported when the loss ended the loop
        coord.welcome_extra["ps_rehost"] = True  # a worker admitted from now on waits for its ps_rehost
        self._rehost(workers, len(hosts) + 1, hosts, 1)  # every worker's welcome said: wait for it

    def _place(self, workers: Sequence, k: int) -> dict[int, int]:
        """Rank -> shard of the workers that host one (`wiiide.server.ps.placement.place_shards`: the most CPU),
        kept in the coordinator's metrics as ``ps.placement``."""
        all_nodes = str(self.coord.cfg.ps_shards).strip().lower() == "all"
        hosts = place_shards([(w.rank, w.cpus) for w in workers], k, all_nodes)
        self.coord.metrics.extra.setdefault("ps", {})["placement"] = {
            "cpus": {str(w.rank): w.cpus for w in workers}, "hosts": {str(r): s for r, s in hosts.items()},
            "short_of_cpu": sorted(w.rank for w in workers if w.rank not in hosts) if all_nodes else []}
        return hosts

    def _rehost(self, workers: Sequence, k: int, hosts: dict[int, int], number: int) -> None:
        """Tell every worker of incarnation `number` the shard count and the shard it hosts (``ps_rehost``);
        a failed send drops that worker (the incarnation's join then fails and starts another)."""
        for w in workers:
            try:
                w.conn.send([encode_message(PS_REHOST, {"ps_shards": k, "shard": hosts.get(w.rank),
                                                        "incarnation": number})])
            except OSError as exc:
                self.coord.drop(w, exc)

    def rejoin_due(self) -> bool:
        """True (and from then on) once a worker that came back waits to be admitted (`joining_waits`)."""
        self.replan = self.replan or self.coord.joining_waits()
        return self.replan

    def after_barrier(self) -> None:
        """The barrier ran out of steps: raises Replan when it stopped for a worker coming back."""
        if self.replan:
            raise Replan("a worker came back: the next incarnation readmits it")

    def notice(self) -> None:
        """A loss was just noticed (before the grace period)."""
        self.noticed_s = time.perf_counter()

    def recover(self, cause: str, shard) -> Incarnation:
        """Declare the next incarnation after a loss: state from a surviving worker's copy, momentum
        from the shards that kept it (`shard`: the coordinator's own, closed), a new placement.

        Raises:
            NodeFailure (exit 4): no worker left, none holds the barrier's step, or too many recoveries.
        """
        coord, cfg, log = self.coord, self.coord.cfg, self.coord.log
        step, number = coord.metrics.steps, self.current.number + 1
        on_arrival = cfg.staleness_bound != 0  # every push applied as it arrives (wiiide.server.ps.paced_recovery)
        self.replan, self.in_row = False, self.in_row + 1
        if self.in_row > cfg.num_workers + 1:
            raise NodeFailure(f"sharded run: {self.in_row - 1} recoveries without a step, the last after: {cause}",
                              EXIT_PEER_LOST)
        before, partitions = {w.rank for w in self.current.workers}, self.current.partitions
        momentum = np.zeros(self.numel, np.float32) if cfg.momentum != 0 else None
        kept = 0 if on_arrival else self._take_momentum(  # the coordinator's shard's, at the barrier's step
            momentum, momentum_at(shard.partition_states(), step, cfg.momentum), partitions, step)
        states, asked, params, source, assembled = {}, set(), None, None, None
        while params is None and not on_arrival:  # the lowest rank not yet asked sends its copy; the others digests
            candidates = [w for w in coord.members() if w.alive and w.rank in before]
            sender = next((w for w in candidates if w.rank not in asked), None)
            if sender is None:
                break
            asked.add(sender.rank)
            asking = [w for w in candidates if w.rank not in states or w is sender]
            for w in asking:  # every order first, then the answers: the workers tear down at once
                self._order(w, step, number, w is sender)
            for w in asking:
                meta = self._answer(w, step) if w.alive else None
                if meta is None:
                    continue
                msg = meta.pop("_msg")
                if w.rank not in states:
                    kept += self._take_momentum(momentum, msg_momentum(msg, meta, partitions), partitions, step)
                states[w.rank] = meta
                if w is sender and meta.get("sha256") is not None:
                    params, source = self._params(msg, meta, w), w.rank
        if on_arrival:  # no common step: the surviving shards' partitions and the newest copies of the rest
            params, momentum, assembled, states = self._assemble(step, number, before, partitions, shard)
            kept = assembled.pop("momentum_kept") if assembled else 0
            source = "the surviving shards and the newest copies" if params is not None else None
        coord.admit_waiting()  # workers that came back join this incarnation (their welcome said: wait for ps_rehost)
        survivors = [w for w in coord.members() if w.alive]
        if params is None or not survivors:
            raise NodeFailure(f"sharded run: no surviving worker holds the parameters of step {step} after: {cause}",
                              EXIT_PEER_LOST)
        hosts = self._place(survivors, min(resolve_shards(cfg.ps_shards, cfg.num_workers + 1), len(survivors) + 1))
        k = len(hosts) + 1
        self._rehost(survivors, k, hosts, number)
        sha = sha256_of(params)
        latest = [int(m["latest_step"]) for m in states.values() if type(m.get("latest_step")) is int]  # noqa: E721
        record = {"incarnation": number, "cause": cause[:500], "lost": sorted(before - {w.rank for w in survivors}),
                  "rejoined": sorted({w.rank for w in survivors} - before),
                  "workers": [w.rank for w in survivors], "ps_shards": k, "step": step,
                  "steps_lost": self.unreported if on_arrival else max([0, *(s - step for s in latest)]),
                  "source": source if on_arrival else f"worker {source}'s copy", "params_sha256": sha,
                  "copies_equal": None if on_arrival else all(m.get("sha256") == sha for m in states.values()
                                                              if m.get("sha256")),
                  "momentum_partitions_kept": f"{kept}/{len(partitions)}" if momentum is not None else None,
                  **({"partitions": assembled} if on_arrival else {}),
                  "noticed_unix_s": round(time.time() - (time.perf_counter() - self.noticed_s), 3),
                  "state_s": round(time.perf_counter() - self.noticed_s, 4)}
        self.records.append(record)
        coord.metrics.extra.setdefault("ps", {})["recoveries"] = self.records
        coord.metrics.event("ps_recovering", **{key: record[key] for key in
                                                ("incarnation", "lost", "rejoined", "step", "ps_shards")})
        log.error("sharded: incarnation %d (lost %s, rejoined %s): %d shards over workers %s, from step %d "
                  "(worker %s's copy)", number, record["lost"], record["rejoined"], k, record["workers"], step, source)
        self.current = Incarnation(number, survivors, k, hosts, RestoredState(step, params, momentum), record,
                                   self.noticed_s, self.current.extra)
        return self.current

    def _assemble(self, step: int, number: int, before: set, partitions: Sequence[Partition], shard):
        """On-arrival pacing: ask every survivor for its newest copy and its old shard's partitions, then
        `wiiide.server.ps.paced_recovery.assemble`; returns (params or None, momentum, its record, answers)."""
        asking = [w for w in self.coord.members() if w.alive and w.rank in before]
        for w in asking:
            self._order(w, step, number, True, on_arrival=True)
        answers = {}
        for w in asking:
            meta = self._answer(w, step) if w.alive else None
            if meta is not None:
                answers[w.rank] = (meta, meta.pop("_msg"))
        try:
            params, momentum, record = assemble(partitions, self.numel, shard.partition_states(), answers,
                                                self.coord.cfg.momentum != 0)
        except ValueError as exc:
            self.coord.log.error("sharded: %s", exc)
            return None, None, None, {}
        return params, momentum, record, {rank: meta for rank, (meta, _) in answers.items()}

    def finish(self, params: torch.Tensor) -> None:
        """The run ended: evaluate the final `params` (the shards', flat float32) and send them with the
        ``stop`` to every worker of the last incarnation (a failed send drops that worker)."""
        coord, metrics = self.coord, self.coord.metrics
        if coord.evaluator is not None:  # the final point: the exact final parameters
            coord.evaluator.finish(metrics.steps, metrics.samples, params)
            record_held_out(metrics, coord.evaluator)
        stop = encode_message("stop", {"reason": "finished", "steps": metrics.steps}, [to_wire("params", params)])
        for w in self.current.workers:
            try:
                w.conn.send([stop])
            except OSError as exc:
                coord.drop(w, exc)

    def fail(self, cause: str) -> None:
        """No incarnation can go on: stop every live worker (``stop``, failed: `cause`); raises NodeFailure (exit 4)."""
        coord = self.coord
        stop = encode_message("stop", {"reason": f"failed: {cause[:300]}", "steps": coord.metrics.steps})
        for w in coord.members():
            if w.alive:
                try:
                    w.conn.send([stop])
                except OSError:
                    pass
        raise NodeFailure(f"sharded run (ps_shards={coord.cfg.ps_shards}) cannot go on: {cause}", EXIT_PEER_LOST)

    def _order(self, w, step: int, number: int, send_params: bool, on_arrival: bool = False) -> None:
        """``ps_recover`` to `w` (dropped when the send fails)."""
        try:
            w.conn.send([encode_message(PS_RECOVER, {"step": step, "incarnation": number, "send_params": send_params,
                                                     "on_arrival": on_arrival})])
        except OSError as exc:
            self.coord.drop(w, exc)

    def _answer(self, w, step: int) -> dict | None:
        """`w`'s ``ps_state`` meta (the message under "_msg"); None (and `w` dropped) when it is lost or
        answers nonsense."""
        try:
            while True:
                msg = w.conn.receive([PS_STATE, *STALE_KINDS])
                if msg.kind == PS_STATE:
                    break
            if msg.meta.get("step") != step:
                raise ProtocolError(f"{PS_STATE} for step {msg.meta.get('step')!r:.40}, asked {step}")
        except Exception as exc:  # OSError, PeerClosed, ProtocolError, socket.timeout
            self.coord.drop(w, exc)
            return None
        return {**msg.meta, "_msg": msg}

    def _params(self, msg, meta: dict, w) -> np.ndarray | None:
        names = [t.name for t in msg.tensors]
        if "params" not in names:
            return None
        params = msg.tensor("params")
        if params.shape != (self.numel,) or params.dtype != np.float32 or sha256_of(params) != meta.get("sha256"):
            self.coord.drop(w, ProtocolError(f"{PS_STATE}: params of shape {params.shape} {params.dtype} or "
                                             f"another digest than it reports"))
            return None
        return params.copy()

    @staticmethod
    def _take_momentum(momentum: np.ndarray | None, states, partitions: Sequence[Partition], step: int) -> int:
        """Copy into `momentum` each (index, step, values) of `states` at `step`; returns how many."""
        if momentum is None:
            return 0
        kept = 0
        for index, at, values in states:
            if at == step and 0 <= index < len(partitions) and values is not None \
                    and values.shape == (partitions[index].numel,):
                momentum[partitions[index].start:partitions[index].stop] = values
                kept += 1
        return kept

    def check(self, incarnation: Incarnation, shard_params: np.ndarray, partitions: Sequence[Partition],
              readies: dict[int, dict]) -> None:
        """After a recovery, before its first step: record the digests of every shard's parameters (from
        `shard_params`, the flat vector pulled from them) and of every worker's copy (its ``ps_ready``'s
        ``digests``), and whether they agree."""
        if incarnation.record is None:
            return
        shards = copy_digests(shard_params, partitions, incarnation.num_shards)
        workers = {str(rank): meta.get("digests") for rank, meta in readies.items()}
        equal = all(d == shards for d in workers.values()) and shards["sha256"] == incarnation.record["params_sha256"]
        incarnation.record["digests"] = {"shards": shards, "workers": workers, "equal": equal,
                                         "shards_digest": params_digest(shard_params)}
        incarnation.record["digests_equal"] = equal
        if not equal:
            self.coord.log.error("sharded: after recovery the digests of the shards and the workers' copies differ")

    def note_step(self, step: int) -> None:
        """The barrier passed `step`: the first step of a recovered incarnation closes its record."""
        record = self.current.record
        self.in_row = 0
        if record is None or "recovery_s" in record:
            return
        record["recovery_s"] = round(time.perf_counter() - self.current.noticed_s, 4)
        record["first_step"] = step
        self.coord.metrics.event("ps_recovered", incarnation=record["incarnation"], step=step,
                                 recovery_s=record["recovery_s"], steps_lost=record["steps_lost"],
                                 digests_equal=record.get("digests_equal"))
        self.coord.log.error("sharded: recovered in %.2f s (%d steps lost), digests %s", record["recovery_s"],
                             record["steps_lost"], "equal" if record.get("digests_equal") else "DIFFER")


def msg_momentum(msg, meta: dict, partitions: Sequence[Partition]) -> list[tuple[int, int, np.ndarray]]:
    """The (partition index, step, momentum values) a ``ps_state`` carries (its ``momentum`` meta lists
    the indices, tensors ``m<index>``); malformed entries are left out."""
    indices = meta.get("momentum")
    if not isinstance(indices, list):
        return []
    names = {t.name for t in msg.tensors}
    return [(i, meta.get("step"), msg.tensor(f"m{i}")) for i in indices
            if type(i) is int and f"m{i}" in names and 0 <= i < len(partitions)]  # noqa: E721


def momentum_at(states, step: int, factor: float) -> list[tuple[int, int, np.ndarray]]:
    """(index, `step`, momentum buffer at `step`) of the `ShardServer.partition_states` at `step`, or
    one update past it, rewound: b_t = (b_{t+1} - g_t) / factor (`wiiide.training.model.MomentumSGD`:
    b_{t+1} = factor * b_t + g_t; b_1 = g_0, so b_0 = 0). Partitions without a buffer are left out."""
    out = []
    for index, at, buffer, grad, _ in states:
        if buffer is None or factor == 0:
            continue
        if at == step:
            out.append((index, step, buffer))
        elif at == step + 1:
            out.append((index, step, np.zeros_like(buffer) if step == 0 else (buffer - grad) / np.float32(factor)))
    return out
