"""Sharded training (``ps_shards`` > 1): the coordinator's loop and a worker's.

After the usual join (`wiiide.server.coordinator`, `wiiide.worker`, whose welcome carries ``ps_shards``):

1. each worker that hosts a shard (ranks 1..k-1; shard 0 is the coordinator's) starts listening and
   every worker sends ``ps_join`` (its shard port, the fingerprint of the data set it holds);
   under ``partitions_per_shard: auto`` the coordinator then probes its link to each worker
   (``ps_probe`` / ``ps_probe_ack``, `wiiide.server.ps.link_probe`) to choose the pieces per shard;
2. the coordinator sends ``ps_plan``: the shards' addresses (the host it saw each worker connect from,
   ``""`` for its own: the workers' ``coordinator_host``), the partitions (`wiiide.server.ps.partition`), the
   batch handout (``indices`` to workers whose data set has the coordinator's fingerprint, else
   ``samples``) and the initial parameters;
3. each worker connects to every shard (`wiiide.server.ps.client`) and sends ``ps_ready``;
4. per step the coordinator hands out the batches (``batch`` with samples, or ``batch_indices``), one
   step ahead (`HANDOUT_AHEAD`);
   each worker computes, pushes and pulls through the shards and reports ``step_done`` (its loss): the
   coordinator's step barrier. Parameters never pass through the coordinator's link during training.
   With ``local_steps`` H > 1 a step is a round of local SGD (`wiiide.server.ps.local_sgd`): H batches, then a
   model delta pushed and the shards' outer step;
5. at the end the coordinator pulls the exact parameters from the shards (for evaluation) and sends
   them with ``stop``; each worker records the max abs difference between its copy and them.

A lost worker (and the shard it hosts) does not end the run: the coordinator starts the next
incarnation over the nodes that remain, from a surviving worker's copy of the parameters
(`wiiide.server.ps.membership`); the run fails (exit 4, `wiiide.wire.node.EXIT_PEER_LOST`) only when none remain.

A lost coordinator, with checkpoints on (`wiiide.server.ps.checkpoints`), restarts the whole sharded run: each
worker sees its shards fail and its coordinator connection close, drops its shard and rejoins the
restarted coordinator (`wiiide.worker`); that one waits for every worker, restores the newest step
complete and verified on every shard and sends it with the plan (``start_step``, ``params`` and
``momentum``), and the shards and the barrier go on from that step.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import nn

from wiiide.server.checkpoint import CheckpointSchedule
from wiiide.training.data import BatchSampler, Dataset, load_dataset
from wiiide.errors import ProtocolError, WiiideError
from wiiide.training.evaluation import stop_at_target
from wiiide.training.model import FlatParams
from wiiide.training.models import check_batch, loss_mean
from wiiide.wire.node import EXIT_PEER_LOST, Connection, NodeFailure, touch
from wiiide.server.ps import link_probe
from wiiide.server.ps.checkpoints import announce_step
from wiiide.server.ps.client import ShardClient, ShardFailed
from wiiide.server.pace.feedback import policy_may_be_lossy
from wiiide.server.ps.link_probe import PieceRule
from wiiide.server.ps.local_sgd import LocalRounds, round_rows
from wiiide.server.ps.membership import PS_RECOVER, PS_REHOST, Membership, Replan, copy_digests
from wiiide.server.ps.survivor import StepSnapshots, answer_recovery, await_order
from wiiide.server.ps.paced import PacedHandout
from wiiide.server.ps.partition import Partition, plan_partitions, shard_loads_bytes
from wiiide.server.ps.plan import (  # noqa: F401 (_restore, _seconds: the tests' names too)
    _peer_host,
    _piece_rule,
    _plan_addresses,
    _plan_partitions,
    _plan_state,
    _receive,
    _restore,
    _seconds,
    batch_frame,
    data_fingerprint,
    num_shards,
    partition_finest_bytes,
    plan_record,
    read_workers,
)
from wiiide.server.ps.shard import ROLE_COORDINATOR, ROLE_WORKER, ShardServer
from wiiide.server.ps.snapshots import ShardSnapshots
from wiiide.server.ps.sparse_rows import table_shape
from wiiide.wire.tensors import from_wire, to_wire
from wiiide.wire.encode import encode_message
from wiiide.wire.messages import WireTensor

HANDOUT_AHEAD = 1  # batches handed out this many steps ahead of the barrier
LOSS_GRACE_S = 0.5  # after a failure, the coordinator waits this long to collect every lost peer


# ---------------------------------------------------------------------------------------------------
def run_coordinator(coord, data: Dataset, model: nn.Module, flat: FlatParams, training_marker: str) -> None:
    """The coordinator's side of a sharded run, from the joined workers to the stop (module docstring).

    `coord` is the `wiiide.server.coordinator.Coordinator` (its cfg, metrics, log and secret; membership through `members` and `drop`);
    `training_marker`: the file name touched in metrics_dir when the first step starts. On
    return `flat` holds the shards' final parameters. A worker or shard lost mid-run starts the next
    incarnation (`wiiide.server.ps.membership`); raises NodeFailure (exit 4) when none can go on.
    """
    cfg, metrics, log = coord.cfg, coord.metrics, coord.log
    workers = [w for w in coord.members() if w.alive]
    if len(workers) < cfg.num_workers:  # a restarted coordinator some workers did not come back to
        raise NodeFailure(f"sharded run (ps_shards={cfg.ps_shards}) needs all {cfg.num_workers} workers; "
                          f"{len(workers)} came back within rejoin_timeout_s", EXIT_PEER_LOST)
    members = Membership(coord, flat.numel, num_shards(cfg))
    while True:
        shard = ShardServer(cfg, coord.secret, metrics, log, 0)
        client, failed = None, None
        try:
            client, partitions = _incarnation(coord, data, flat, shard, members, training_marker)
            flat.load(torch.from_numpy(client.pull_final(partitions, flat.numel)))
            members.finish(flat.params)
            return
        except (WiiideError, OSError) as exc:
            # One loss cascades (the workers' shards fail too): give the shard a moment to notice every
            # peer it lost, and name them all, so the first one (the cause) is in the message.
            members.notice()
            if not isinstance(exc, Replan):
                time.sleep(LOSS_GRACE_S)
            failed = "; ".join(shard.lost) if shard.lost else f"{type(exc).__name__}: {exc}"
            log.error("sharded run (incarnation %d): %s", members.current.number, failed[:500])
        finally:
            if client is not None:
                client.close()
            shard.close()
        try:
            members.recover(failed, shard)
        except (WiiideError, OSError) as exc:
            members.fail(f"{failed}; no recovery: {exc}")


def _incarnation(coord, data: Dataset, flat: FlatParams, shard: ShardServer, members: Membership,
                 training_marker: str) -> tuple[ShardClient, list[Partition]]:
    """One incarnation (`members.current`): join, plan, ready, then the barrier until the end. Returns
    the coordinator's client and the partitions. Raises what a lost or misbehaving peer causes."""
    cfg, metrics, log = coord.cfg, coord.metrics, coord.log
    now = members.current
    k, workers = now.num_shards, now.workers
    port = shard.listen()
    fingerprint = data_fingerprint(data)
    # (host, port, TLS name): "" for the coordinator's own (the workers' coordinator_host) and, without
    # tls, for a worker's name (its certificate's first name, which its peers' TLS checks against)
    addresses: list[tuple[str, int, str]] = [("", port, "")] + [("", 0, "")] * (k - 1)
    handout: dict[int, str] = {}
    for w in workers:
        join = _receive(coord, w, "ps_join")
        if w.rank in now.hosts:
            shard_port = join.meta.get("shard_port")
            if type(shard_port) is not int or not 1 <= shard_port <= 65535:  # noqa: E721
                raise ProtocolError(f"worker {w.rank} hosts shard {now.hosts[w.rank]} but reports port {shard_port!r:.40}")
            addresses[now.hosts[w.rank]] = (_peer_host(w.conn), shard_port, w.tls_name or "")
        wanted = cfg.batch_handout
        handout[w.rank] = ("indices" if wanted == "indices" or (wanted == "auto" and join.meta.get("data") == fingerprint)
                           else "samples")
    if now.state is None:
        rule, probe = _piece_rule(coord, workers)
    else:  # a later incarnation keeps the first one's pieces
        rule, probe = now.extra["rule"], now.extra["probe"]

    def plan(rule: PieceRule) -> tuple[PieceRule, list[Partition]]:
        return rule, plan_partitions(flat.numel, k, len(workers), cfg.partition_bytes, cfg.partition_balance,
                                     rule.per_shard, cfg.partition_placement,
                                     partition_finest_bytes(cfg, rule.finest_wire_bytes), table_shape(cfg))

    if now.state is None:  # a restarted run keeps the pieces its checkpoints were cut into, whatever the probe says now
        others = [r for r in link_probe.AUTO_RULES if r != rule] if probe else []
        restored, rule, partitions = _restore(coord, [plan(rule)] + [plan(r) for r in others], k, flat)
        start_step = restored.step if restored is not None else 0
        momentum = restored.momentum if restored is not None else None
        now.extra.update(rule=rule, probe=probe)
    else:
        _, partitions = plan(rule)
        flat.load(torch.from_numpy(now.state.params.copy()))
        start_step, momentum = now.state.step, now.state.momentum
    now.partitions = partitions
    shard.expect_workers([w.rank for w in workers])
    shard.configure(partitions, flat.params.numpy(), policy_may_be_lossy(cfg), momentum, start_step)
    if shard.checkpointer is not None and shard.checkpointer.enabled:  # the report's checkpoints_written
        metrics.extra["checkpoints"] = shard.checkpointer.record
    shard.start()
    plan_meta = {"shards": [list(a) for a in addresses], "ps_shards": k, "workers": [w.rank for w in workers],
                 "partitions": [[p.start, p.stop, p.shard] for p in partitions],
                 "data": fingerprint, "start_step": start_step}
    state = [to_wire("params", flat.params)]
    if momentum is not None:  # a restored checkpoint's: the shards' optimizer state
        state.append(WireTensor("momentum", momentum))
    for w in workers:
        w.conn.send([encode_message("ps_plan", {**plan_meta, "batch_handout": handout[w.rank]}, state)])
    readies = {w.rank: _receive(coord, w, "ps_ready").meta for w in workers}
    own = [(cfg.coordinator_host if not h else h, p, name) for h, p, name in addresses]
    own[0] = ("127.0.0.1", port, cfg.coordinator_host)  # its certificate names coordinator_host
    client = ShardClient(cfg, coord.secret, metrics, log, own, ROLE_COORDINATOR, 0, coord.metrics.node_id)
    try:
        if now.record is not None:  # after a recovery: every shard's parameters against every worker's copy
            members.check(now, client.pull_final(partitions, flat.numel), partitions, readies)
        metrics.extra["ps"].update(plan_record(cfg, k, partitions, rule, probe, addresses, handout, now.number))
        log.info("sharded: %d shards, %d partitions (%s bytes per shard); batch handout %s", k, len(partitions),
                 shard_loads_bytes(partitions, k), sorted(set(handout.values())))
        _train(coord, data, workers, handout, shard, training_marker, start_step, client, partitions, members)
    except BaseException:
        client.close()
        raise
    return client, partitions


def _train(coord, data: Dataset, workers, handout: dict[int, str], shard: ShardServer, training_marker: str,
           start_step: int = 0, client: ShardClient | None = None, partitions: list[Partition] | None = None,
           members: Membership | None = None) -> None:
    """The step barrier. Batches go out `HANDOUT_AHEAD` steps ahead, so a worker whose pulls are in
    starts its next step at once, without a round trip through the coordinator; whether a step runs
    (duration_s, max_steps) is decided when its batches are sent. A restored run starts at
    `start_step` and, as the central server, draws its batches from a stream seeded with seed + start_step.

    A step the barrier passed is on disk on every shard when it is a checkpoint step: a shard sends
    a partition's pull after writing its checkpoint (`wiiide.server.ps.shard.ShardServer`). With
    checkpoint_every_s, the barrier announces a step ahead of every shard through `client`
    (`wiiide.server.ps.checkpoints.announce_step`) before it hands out the next batches.

    With eval_every_s (the coordinator's ``evaluator``), snapshots pulled from the shards through
    `client` on another thread (`wiiide.server.ps.snapshots`) are evaluated while the barrier runs, and
    stop_at_target ends the handout once the target is reached. After a recovery (`members`: a later
    incarnation) duration_s and the evaluator go on counting from the first incarnation's start."""
    cfg, metrics, log = coord.cfg, coord.metrics, coord.log
    timer = CheckpointSchedule(0, cfg.checkpoint_every_s if client is not None else 0.0, start_step)
    sampler = BatchSampler(len(data.y_train), cfg.batch_size, cfg.seed + start_step)
    first = members is None or members.train_start_s is None
    start = time.perf_counter() if first else members.train_start_s
    if members is not None:
        members.train_start_s = start
    touch(str(Path(cfg.metrics_dir) / training_marker))
    evaluator = coord.evaluator if coord.evaluator is None or not first else coord.evaluator.start(start)
    snapshots = None
    if evaluator is not None and client is not None and partitions:
        snapshots = ShardSnapshots(evaluator, client, partitions, partitions[-1].stop,
                                   lambda: (metrics.steps, metrics.samples)).start()
    try:
        if cfg.staleness_bound != 0 or cfg.adaptive_batch:  # the SSP clock's handout (wiiide.server.ps.paced)
            PacedHandout(coord, data, workers, handout, shard, sampler, start, evaluator, client, start_step,
                         members, len(partitions or ())).run()
            if members is not None:
                members.after_barrier()
        else:
            _barrier(coord, data, workers, handout, shard, timer, sampler, start, start_step, client, evaluator,
                     members)
    finally:
        if snapshots is not None:
            snapshots.stop()
            metrics.extra["ps"]["snapshots"] = {"pulls": snapshots.pulls, "error": snapshots.error}


def _barrier(coord, data: Dataset, workers, handout: dict[int, str], shard: ShardServer, timer: CheckpointSchedule,
             sampler: BatchSampler, start: float, start_step: int, client: ShardClient | None, evaluator,
             members: Membership | None = None) -> None:
    """`_train`'s loop: hand out, wait for every worker's ``step_done``, record the step."""
    cfg, metrics, log = coord.cfg, coord.metrics, coord.log

    def more(sent: int) -> bool:
        if members is not None and members.rejoin_due():  # drain, then readmit (wiiide.server.ps.membership)
            return False
        if stop_at_target(cfg, evaluator):
            return False
        return not (time.perf_counter() - start >= cfg.duration_s or (cfg.max_steps and sent >= cfg.max_steps))

    rows = round_rows(cfg, sampler.batch_size, len(data.y_train))  # local SGD: H batches a round

    def hand_out(step: int) -> None:
        for w in workers:
            frame = batch_frame(coord.policy, data, handout[w.rank], step, sampler.next_indices(rows))
            try:
                w.conn.send([frame])
            except OSError as exc:
                coord.drop(w, exc)
                raise NodeFailure(f"lost worker {w.rank}: {exc}", EXIT_PEER_LOST) from None

    sent = start_step
    while sent <= start_step + HANDOUT_AHEAD and more(sent):
        hand_out(sent)
        sent += 1
    step, t_step = start_step, time.perf_counter()
    while step < sent:
        losses, compute_s = [], []
        for w in workers:
            msg = _receive(coord, w, "step_done")
            if msg.meta.get("step") != step:
                raise ProtocolError(f"worker {w.rank}: step_done for step {msg.meta.get('step')!r:.40}, expected {step}")
            loss = msg.meta.get("loss")
            losses.append(float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else float("nan"))
            compute_s.append(_seconds(msg.meta.get("compute_s")))
            w.batches += cfg.local_steps
        if shard.failure:
            raise NodeFailure(shard.failure, EXIT_PEER_LOST)
        step += 1
        if timer.enabled and more(sent) and timer.due(step, time.monotonic()):
            client.announce_checkpoint(announce_step(sent))  # before the batches of step `sent` go out
            timer.mark(step, time.monotonic())
        if more(sent):
            hand_out(sent)
            sent += 1
        metrics.steps = step
        metrics.batches += len(workers) * cfg.local_steps
        metrics.samples += len(workers) * rows
        now = time.perf_counter()
        metrics.record_step_time(now - t_step)  # from one step's barrier to the next
        metrics.record_workers_compute(compute_s)
        t_step = now
        metrics.losses.append(sum(losses) / len(losses))
        if step % 50 == 0:
            metrics.sample_rss()
        if coord.recovery is not None:  # steps lost and recovery time at the first step after a restart
            coord.recovery.note_step(step)
        if members is not None:  # the same after a worker's loss (wiiide.server.ps.membership)
            members.note_step(step)
        log.step(step, "step %d: loss %.4f, %d workers, %.1f batches/s (sharded)", step, metrics.losses[-1],
                 len(workers), metrics.batches / (now - start))
    metrics.train_time_s = time.perf_counter() - start
    metrics.extra["epochs"] = sampler.epochs_done
    if members is not None:
        members.after_barrier()


# ---------------------------------------------------------------------------------------------------
def run_worker(worker, conn: Connection, model: nn.Module, welcome_meta: dict, secret: bytes) -> None:
    """A worker's side of a sharded run, from its welcome to the stop (module docstring), through every
    incarnation (`wiiide.server.ps.membership`: after a loss it answers ``ps_recover`` and joins the next).

    Raises:
        ProtocolError: a malformed plan, batch or pull; NodeFailure: the coordinator stopped the run.
    """
    cfg, metrics, log = worker.cfg, worker.metrics, worker.log
    rank = metrics.rank
    k = welcome_meta.get("ps_shards")
    hosted = rank if rank < k else None
    data, fingerprint = None, None
    if cfg.batch_handout != "samples":
        try:
            data = load_dataset(cfg)
            fingerprint = data_fingerprint(data)
        except (WiiideError, OSError) as exc:
            log.info("no local data set (%s): batches come as samples", exc)
    flat = FlatParams(model)
    snapshots = StepSnapshots()
    kind = str((welcome_meta.get("model") or {}).get("type"))
    if welcome_meta.get("ps_rehost") is True:  # came back mid-run: the next incarnation says what it hosts
        k, hosted = answer_recovery(conn, conn.receive([PS_RECOVER, PS_REHOST]), snapshots, None,
                                    cfg.num_workers + 1, cfg.momentum)
    while True:
        shard = ShardServer(cfg, secret, metrics, log, hosted) if hosted is not None else None
        client, order = None, None
        try:
            conn.send([encode_message("ps_join", {"shard_port": shard.listen() if shard else 0, "data": fingerprint})])
            plan = link_probe.receive_answering_probes(conn, "ps_plan")
            partitions = _plan_partitions(plan.meta, flat.numel, k)
            params = plan.tensor("params")
            if params.shape != (flat.numel,) or params.dtype != np.float32:
                raise ProtocolError(f"ps_plan: params of shape {params.shape}, expected ({flat.numel},)")
            flat.load(torch.from_numpy(params.copy()))
            start_step, momentum = _plan_state(plan, flat.numel)
            snapshots.keep(start_step, flat.params, [start_step] * len(partitions))  # every shard starts there
            handout = plan.meta.get("batch_handout")
            if handout == "indices" and plan.meta.get("data") != fingerprint:
                raise ProtocolError("ps_plan: indices handout, but this worker's data set differs from the coordinator's")
            metrics.extra.setdefault("ps", {}).update({"ps_shards": k, "partitions": len(partitions),
                                                       "batch_handout": handout})
            if shard is not None:
                shard.expect_workers(read_workers(plan.meta, cfg.num_workers))
                shard.configure(partitions, params, policy_may_be_lossy(cfg), momentum, start_step)
                shard.start()
            addresses = _plan_addresses(plan.meta, k, cfg.coordinator_host)
            client = ShardClient(cfg, secret, metrics, log, addresses, ROLE_WORKER, rank, worker.node_id)
            client.attach(model, flat, partitions, policy_may_be_lossy(cfg), hooks=cfg.local_steps == 1)
            conn.send([encode_message("ps_ready", {"digests": copy_digests(flat.params.numpy(), partitions, k)})])
            order = _worker_steps(worker, conn, model, flat, client, data, kind, snapshots)
        except ShardFailed as exc:
            order = await_order(conn, exc)
        finally:
            if client is not None:
                metrics.extra.setdefault("ps", {})["push_policy"] = client.policy_records()
                metrics.extra["ps"]["push_uplink_bps_reported"] = client.uplink_records()
                metrics.extra["ps"]["push_cwnd"] = client.push_cwnd_record()
                client.close()
            if shard is not None:
                shard.close()
        if order is None:
            return
        metrics.event("ps_recover", step=order.meta.get("step"), incarnation=order.meta.get("incarnation"))
        k, hosted = answer_recovery(conn, order, snapshots, shard, cfg.num_workers + 1, cfg.momentum)


def _worker_steps(worker, conn: Connection, model: nn.Module, flat: FlatParams, client: ShardClient,
                  data: Dataset | None, kind: str, snapshots: StepSnapshots):
    """The steps of one incarnation: None after the ``stop``, the ``ps_recover`` message after a loss."""
    cfg, metrics, log = worker.cfg, worker.metrics, worker.log
    wait_s = 0.0
    rounds = (LocalRounds(cfg, model, flat, client, kind, metrics.rank, worker.scope)
              if cfg.local_steps > 1 else None)
    while True:
        msg = conn.receive(["batch", "batch_indices", "stop", PS_RECOVER])
        if msg.kind == PS_RECOVER:
            return msg
        if msg.kind == "stop":
            reason = str(msg.meta.get("reason"))
            if msg.tensors:
                final = msg.tensor("params")
                if final.shape == (flat.numel,):
                    gap = float(np.max(np.abs(flat.params.numpy() - final)))
                    metrics.extra["ps"]["param_max_abs_diff"] = gap
            metrics.extra["ps"]["pull_wait_s"] = round(wait_s, 4)
            log.info("stop after %d steps: %s", metrics.steps, reason)
            if reason.startswith("failed"):
                raise NodeFailure(f"the coordinator stopped the sharded run: {reason[:400]}", EXIT_PEER_LOST)
            return None
        step = msg.meta.get("step")
        t0, cpu0 = time.perf_counter(), time.thread_time()
        if msg.kind == "batch_indices":
            if data is None:
                raise ProtocolError("batch_indices sent to a worker without the data set")
            idx = msg.tensor("idx")
            if idx.dtype != np.int64 or idx.ndim != 1 or idx.size == 0 or idx.min() < 0 or idx.max() >= len(data.y_train):
                raise ProtocolError("batch_indices: int64 (b,) indices into the training split expected")
            x, y = torch.from_numpy(data.x_train[idx]), torch.from_numpy(data.y_train[idx])
        else:
            if len(msg.tensors) != 2:
                raise ProtocolError(f"batch holds {len(msg.tensors)} tensors, expected x and y")
            x, y = from_wire(msg.tensors[0]), from_wire(msg.tensors[1])
        try:
            check_batch(kind, x, y)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        if rounds is not None:  # local SGD: H steps, then the model delta pushed (wiiide.server.ps.local_sgd)
            loss_value = rounds.push_round(step, x, y)
        else:
            micro_batches = min(cfg.grad_accum_steps, int(x.shape[0]))  # as `wiiide.server.pace.outer.gradient` cuts them
            if cfg.debug_step_sleep_s > 0 and cfg.debug_sleep_worker_rank in (0, metrics.rank):
                time.sleep(cfg.debug_step_sleep_s)  # a test's straggler, before its pushes
            client.begin_step(step, micro_batches, int(x.shape[0]) if cfg.adaptive_batch else None)
            try:  # the hooks push each partition once the last micro-batch's backward has reached it
                loss_value = client.gradient(model, x, y, micro_batches, partial(loss_mean, kind), worker.scope)
            except (RuntimeError, IndexError) as exc:
                raise ProtocolError(f"batch does not fit the model: {exc}") from None
        compute_s = time.perf_counter() - t0
        metrics.add_compute(step, compute_s, time.thread_time() - cpu0)
        wait_s += client.finish_step(step)
        snapshots.keep(step + 1, flat.params, client.versions)  # a live copy for a recovery (wiiide.server.ps.membership)
        worker._last_step, worker._last_params_unix_s = step, time.time()  # the hello's rejoin hint
        conn.send([encode_message("step_done", {"step": step, "loss": loss_value, "samples": int(x.shape[0]),
                                                "compute_s": compute_s, "staleness": client.staleness,
                                                "cached": client.cached})])
        metrics.record_worker_step(int(x.shape[0]), loss_value, time.perf_counter() - t0, batches=cfg.local_steps)
        log.step(metrics.steps, "step %s: loss %.4f", step, loss_value)
