"""PyTorch's engines on WIIIIIDE's nodes: DistributedDataParallel and FSDP2 over gloo.

``python -m wiiide coordinator|worker`` runs this module when ``engine`` is ``ddp`` or ``fsdp``: the
same image, containers and commands as the parameter server.

Rendezvous and ranks
    The coordinator is rank 0 and hosts the rendezvous; workers take ranks in arrival order
    (`wiiide.engines.rendezvous`); a gate holds rank 0 until the harness has shaped the links.

Fairness with the parameter server
    World size is num_workers + 1 and every rank trains: DDP and FSDP have no parameter server, and
    the coordinator's container would otherwise idle. WIIIIIDE's step trains on num_workers x
    batch_size samples (a batch per worker, drawn in turn from one seeded sampler). Here every rank
    builds the same sampler, draws the same num_workers batches per step, concatenates them into the
    same global batch and takes its own contiguous slice (`rank_slices`: sizes differ by at most one).
    Each rank's loss is a *sum* over its samples scaled by W / global batch, so after the engine's
    average over W ranks the gradient is exactly the mean over the global batch, as WIIIIIDE's average
    of per-worker means is. Same initial weights (`build_mlp` with the seed), same SGD: the engines
    follow the same trajectory up to floating-point rounding (checked by the integration test).

Stopping
    ``max_steps`` is known to every rank. The duration is judged by rank 0 alone and broadcast every
    `STOP_CHECK_EVERY_STEPS` steps, outside the timed steps, so that every rank stops at the same step.

Communication time
    DDP: the comm hook (allreduce, fp16 or PowerSGD) is wrapped to record each bucket's launch and the
    completion of its future. FSDP: custom all-gather and reduce-scatter (`set_custom_all_gather`,
    `set_custom_reduce_scatter`) wrap the default ones the same way. Per step, the node records the
    seconds during which at least one collective was in flight (`comm.union_length_s`); gloo runs them
    on its own threads, so part of that time overlaps the backward pass.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
import torch.distributed as dist
from torch import nn

from wiiide.config import RunConfig
from wiiide.training.data import BatchSampler, load_dataset
from wiiide.engines.comm import IntervalTimer, estimate
from wiiide.errors import ConfigError
from wiiide.training.evaluation import evaluator_for, record_held_out, stop_at_target
from wiiide.log import TieredLog
from wiiide.lr_schedule import LrRecord, LrSchedule
from wiiide.metrics import NodeMetrics
from wiiide.training.model import evaluate
from wiiide.training.models import build_model, shard_units
from wiiide.training.models import loss_sum as summed_loss
from wiiide.wire.node import (
    EXIT_CONNECT,
    EXIT_ERROR,
    EXIT_PEER_LOST,
    NodeFailure,
    run_node,
    touch,
    wait_for_start_gate,
)
from wiiide.engines.allocator import return_freed_memory, trim_heap
from wiiide.engines.hooks import comm_record, powersgd_bucket_cap_mb, timed_ddp_hook, timed_fsdp_comms
from wiiide.engines.progress import ProgressBeat
from wiiide.engines.rendezvous import claim_rank, is_loopback_host, loopback_interface, rank_slices
from wiiide.tensor_memory import ForwardScope, autocast_dtype, tensor_memory
from wiiide.wire.sockets import congestion_in_force, set_route_congestion
from wiiide.training.workload import workload_record

STOP_CHECK_EVERY_STEPS = 10
RSS_SAMPLE_EVERY_STEPS = 10
TRAINING_MARKER = "coordinator.training"  # wiiide.server.coordinator's: written by rank 0 when the first step starts
PROFILE_ACTIVE_STEPS = 5
# ddp post_local_sgd: gradients are all-reduced at step 0 only (the models start equal anyway); local SGD and
# the periodic parameter averaging start at step 1.
POST_LOCAL_SGD_START_STEP = 1
# WIIIIIDE's own socket knobs, which gloo's sockets do not take: recorded as not applied (tcp_congestion
# when it is '': when set, it goes on the routes, `wiiide.wire.sockets.set_route_congestion`).
NOT_APPLIED = ("sndbuf_bytes", "rcvbuf_bytes", "tcp_nodelay", "tcp_quickack", "keepalive", "tcp_congestion",
               "recv_chunk_bytes",
               "max_frame_bytes", "compression")




def _failure(exc: BaseException, doing: str) -> NodeFailure:
    text = str(exc).strip()
    first = text.splitlines()[0][:300] if text else type(exc).__name__
    lost = isinstance(exc, dist.DistError) or any(w in text.lower() for w in ("gloo", "connection", "timed out", "peer"))
    return NodeFailure(f"{doing}: {type(exc).__name__}: {first}", EXIT_PEER_LOST if lost else EXIT_ERROR)


class TorchNode:
    """One rank of a DDP or FSDP run, writing the same metrics file as a WIIIIIDE node."""

    def __init__(self, cfg: RunConfig, role: str) -> None:
        if role not in ("coordinator", "worker"):
            raise ValueError(f"role must be coordinator or worker, got {role!r}")
        self.cfg = cfg
        self.role = role
        self.world_size = cfg.num_workers + 1
        self.log = TieredLog(cfg, f"{cfg.engine}-{role}")
        self.metrics = NodeMetrics(role, cfg.node_id or socket.gethostname())
        self.metrics.rank = 0 if role == "coordinator" else None
        if role == "coordinator":
            self.metrics.track_host_cpu()  # the machine's CPU over the timed steps, as a WIIIIIDE coordinator's
        self.timer = IntervalTimer()
        self.beat = ProgressBeat(cfg.metrics_dir, self.metrics.node_id, role)

    def run(self) -> int:
        """Run this rank to the end and write its metrics file; returns the exit code (`wiiide.wire.node` EXIT_*)."""
        return run_node(self.cfg, self.metrics, self.log, self._main)

    # ------------------------------------------------------------------------------------------
    def _main(self) -> None:
        cfg, m = self.cfg, self.metrics
        if not os.environ.get("GLOO_SOCKET_IFNAME") and is_loopback_host(cfg.coordinator_host):
            name = loopback_interface()
            if name:
                os.environ["GLOO_SOCKET_IFNAME"] = name
        m.extra["malloc"] = return_freed_memory()  # before any tensor: freed buffers go back to the kernel
        not_applied = {k: "gloo's own sockets" for k in NOT_APPLIED}
        if cfg.tcp_congestion:  # gloo's sockets take no option, but they follow their routes' congctl
            try:
                routes = set_route_congestion(cfg.tcp_congestion)
            except OSError as exc:
                raise ConfigError(f"{exc} (the ddp and fsdp engines set tcp_congestion on the routes, which "
                                  "needs CAP_NET_ADMIN: the docker backend's containers have it)") from None
            del not_applied["tcp_congestion"]
            m.extra["tcp_congestion_routes"] = {"congestion": cfg.tcp_congestion, "routes": routes}
        m.extra.update({"engine": cfg.engine, "world_size": self.world_size, "num_workers": cfg.num_workers,
                        "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "not_applied": not_applied})
        store = self._rendezvous()
        rank = claim_rank(store, self.role, cfg.num_workers)
        m.rank = self.beat.rank = rank
        if rank == 0:  # the other ranks wait for rank 0 in init_process_group
            wait_for_start_gate(cfg, m, self.log)  # links shaped before any training traffic
        timeout = timedelta(seconds=max(cfg.connect_timeout_s, cfg.io_timeout_s))
        try:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=self.world_size, timeout=timeout)
        except (RuntimeError, ValueError) as exc:
            raise _failure(exc, f"rank {rank}: gloo process group of {self.world_size} did not form") from None
        m.event("joined", rank=rank, world_size=self.world_size)
        if cfg.tcp_congestion:  # gloo's connections are up: what they run (ss)
            m.extra["tcp_congestion_routes"]["connections"] = congestion_in_force()
        self.beat.beat(0, "setup")  # from here on, the harness's watchdog expects progress
        self.log.info("rank %d of %d (%s)", rank, self.world_size, cfg.engine)
        try:
            self._train(rank)
        except RuntimeError as exc:
            raise _failure(exc, f"rank {rank}: {cfg.engine} training") from None
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    def _rendezvous(self) -> Any:
        cfg = self.cfg
        timeout = timedelta(seconds=cfg.connect_timeout_s)
        try:
            if self.role == "coordinator":
                store = dist.TCPStore(cfg.bind_host, cfg.port, is_master=True, timeout=timeout,
                                      wait_for_workers=False)
                touch(cfg.ready_file)
                self.log.info("rendezvous on %s:%d for %d workers", cfg.bind_host, cfg.port, cfg.num_workers)
            else:
                store = dist.TCPStore(cfg.coordinator_host, cfg.port, is_master=False, timeout=timeout)
        except (RuntimeError, ValueError) as exc:
            where = f"{cfg.bind_host}:{cfg.port}" if self.role == "coordinator" else f"{cfg.coordinator_host}:{cfg.port}"
            raise NodeFailure(f"rendezvous at {where} failed within connect_timeout_s={cfg.connect_timeout_s:g} s: "
                              f"{str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__}",
                              EXIT_CONNECT) from None
        return store

    # ------------------------------------------------------------------------------------------
    def _wrap(self, model: nn.Module) -> nn.Module:
        """The engine's wrapper around `model` (DDP) or `model` sharded in place (FSDP2)."""
        cfg = self.cfg
        if cfg.engine == "ddp":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            from torch.nn.parallel import DistributedDataParallel

            if cfg.ddp_comm_hook == "powersgd":
                # One bucket. PowerSGD's hook chains two all-reduces per bucket through futures; with
                # gloo the chains of two buckets reach the wire in different orders on different ranks
                # (gloo: "Received data size doesn't match expected size ... collective mismatch", or
                # every rank waiting forever). DDP's default caps give a 1 MiB first bucket, so the
                # the 1.2 MB digits MLP had two. An explicit cap also sets the first bucket's.
                ddp = DistributedDataParallel(model, bucket_cap_mb=powersgd_bucket_cap_mb(model),
                                              find_unused_parameters=cfg.ddp_find_unused_parameters)
            else:
                ddp = DistributedDataParallel(model, find_unused_parameters=cfg.ddp_find_unused_parameters)
            if cfg.ddp_comm_hook == "powersgd":
                from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

                # Vanilla all-reduce for the warm-up steps, then PowerSGD (start must be >= 2).
                state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=cfg.powersgd_rank,
                                                    start_powerSGD_iter=max(2, cfg.warmup_steps))
                ddp.register_comm_hook(state, timed_ddp_hook(powerSGD_hook.powerSGD_hook, self.timer))
            elif cfg.ddp_comm_hook == "post_local_sgd":
                from torch.distributed.algorithms.ddp_comm_hooks import (
                    post_localSGD_hook,
                )

                # Gradients all-reduced at the first step only, then none: the models drift for
                # local_steps steps and PeriodicModelAverager (`_optimizer`) averages them.
                state = post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=None,
                                                             start_localSGD_iter=POST_LOCAL_SGD_START_STEP,
                                                             post_local_gradient_allreduce=False)
                ddp.register_comm_hook(state, timed_ddp_hook(post_localSGD_hook.post_localSGD_hook, self.timer))
            else:
                inner = default_hooks.fp16_compress_hook if cfg.ddp_comm_hook == "fp16" else default_hooks.allreduce_hook
                ddp.register_comm_hook(None, timed_ddp_hook(inner, self.timer))
            return ddp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (self.world_size,))
        half = autocast_dtype(cfg.mixed_precision)
        policy = (MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
                  if half is not None else MixedPrecisionPolicy())
        gather, scatter = timed_fsdp_comms(self.timer)
        # One FSDP unit per Linear, so FULL_SHARD reshards between forward and backward (FSDP2 never
        # reshards the root after forward); the root then holds no parameters of its own.
        for layer in shard_units(model):
            fully_shard(layer, mesh=mesh, reshard_after_forward=cfg.fsdp_reshard_after_forward, mp_policy=policy)
            layer.set_custom_all_gather(gather)
            layer.set_custom_reduce_scatter(scatter)
        fully_shard(model, mesh=mesh, reshard_after_forward=cfg.fsdp_reshard_after_forward, mp_policy=policy)
        return model

    def _optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """SGD; with ddp_comm_hook post_local_sgd wrapped in PyTorch's PostLocalSGDOptimizer, whose
        PeriodicModelAverager all-reduces (averages) the parameters every local_steps steps (Lin et al.,
        "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020): the baseline of wiiide's local_steps."""
        cfg = self.cfg
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.learning_rate, momentum=cfg.momentum)
        if cfg.engine != "ddp" or cfg.ddp_comm_hook != "post_local_sgd":
            return optimizer
        from torch.distributed.algorithms.model_averaging.averagers import (
            PeriodicModelAverager,
        )
        from torch.distributed.optim import PostLocalSGDOptimizer

        averager = PeriodicModelAverager(period=cfg.local_steps, warmup_steps=POST_LOCAL_SGD_START_STEP)
        return PostLocalSGDOptimizer(optim=optimizer, averager=averager)

    def _sync(self, wrapped: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """Gradient synchronisation on (last micro-batch) or off (the others), as each engine does it."""
        if self.cfg.engine == "ddp":
            return contextlib.nullcontext() if sync else wrapped.no_sync()
        wrapped.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def _stop_requested(self, rank: int, start: float, snapshot_due: bool = False,
                        target_reached: bool = False) -> tuple[bool, bool]:
        """(stop, take a held-out snapshot), as rank 0 decides them, on every rank (one broadcast). Rank 0
        stops at duration_s, or when `target_reached` (its evaluator's, under stop_at_target)."""
        stop = time.perf_counter() - start >= self.cfg.duration_s or target_reached
        flags = torch.tensor([1 if rank == 0 and stop else 0, 1 if rank == 0 and snapshot_due else 0])
        dist.broadcast(flags, src=0)
        return bool(flags[0].item()), bool(flags[1].item())

    def _profiler(self, rank: int) -> Any:
        cfg = self.cfg
        if not cfg.profile:
            return None
        from torch.profiler import (
            ProfilerActivity,
            profile,
            schedule,
            tensorboard_trace_handler,
        )

        out = Path(cfg.metrics_dir).resolve().parent / "profile"
        out.mkdir(parents=True, exist_ok=True)
        prof = profile(activities=[ProfilerActivity.CPU],
                       schedule=schedule(wait=max(0, cfg.warmup_steps - 1), warmup=1, active=PROFILE_ACTIVE_STEPS,
                                         repeat=1),
                       on_trace_ready=tensorboard_trace_handler(str(out), worker_name=f"rank{rank}"))
        prof.start()
        self.metrics.extra["profile_dir"] = str(out)
        self.metrics.extra["profile_steps"] = [cfg.warmup_steps, cfg.warmup_steps + PROFILE_ACTIVE_STEPS]
        return prof

    def _train(self, rank: int) -> None:
        cfg, m = self.cfg, self.metrics
        data = load_dataset(cfg)
        model = build_model(cfg, data.num_features, data.num_classes, sparse=cfg.sparse_embedding)
        shapes = [tuple(p.shape) for p in model.parameters()]
        numel = sum(p.numel() for p in model.parameters())
        sampler = BatchSampler(len(data.y_train), cfg.batch_size, cfg.seed)
        global_batch = cfg.num_workers * sampler.batch_size
        mine = rank_slices(global_batch, self.world_size)[rank]
        micro = rank_slices(mine.stop - mine.start, cfg.grad_accum_steps)
        self.beat.beat(0, "setup")  # after the data set: the wrapper's collectives come next
        wrapped = self._wrap(model)
        trim_heap()  # FSDP: the full-size parameters the shards were cut from are free now
        optimizer = self._optimizer(model)
        # the schedule (wiiide.lr_schedule) as torch's LambdaLR on the SGD itself (PostLocalSGDOptimizer wraps it)
        sgd = getattr(optimizer, "optim", optimizer)
        lrs = LrRecord(LrSchedule.from_config(cfg))
        scheduler = torch.optim.lr_scheduler.LambdaLR(sgd, lrs.schedule.factor)
        # ddp: CPU autocast at mixed_precision; fsdp: its MixedPrecisionPolicy casts the parameters instead
        scope = ForwardScope(cfg.mixed_precision if cfg.engine == "ddp" else "none")
        half_bytes = 2 if cfg.mixed_precision != "none" else 4
        expected = estimate(cfg.engine, shapes, cfg.num_workers, ddp_comm_hook=cfg.ddp_comm_hook,
                            powersgd_rank=cfg.powersgd_rank, fsdp_reshard_after_forward=cfg.fsdp_reshard_after_forward,
                            param_dtype_bytes=half_bytes if cfg.engine == "fsdp" else 4, local_steps=cfg.local_steps)
        m.samples_per_step = global_batch  # the guide's batch_size x world_size
        m.extra.update({
            "dataset": data.name, "train_samples": len(data.y_train), "test_samples": len(data.y_test),
            "num_parameters": numel, "gradient_bytes": numel * 4, "global_batch": global_batch,
            "rank_batch": mine.stop - mine.start, "micro_batches": [s.stop - s.start for s in micro],
            "grad_accum_steps": cfg.grad_accum_steps, "mixed_precision": cfg.mixed_precision,
            "activation_checkpointing": cfg.activation_checkpointing,
            "ddp_comm_hook": cfg.ddp_comm_hook if cfg.engine == "ddp" else None,
            "ddp_find_unused_parameters": cfg.ddp_find_unused_parameters if cfg.engine == "ddp" else None,
            "fsdp_reshard_after_forward": cfg.fsdp_reshard_after_forward if cfg.engine == "fsdp" else None,
            **workload_record(cfg, data, model),
        })
        self.log.info("model %s: %d parameters (%.1f MB); global batch %d, this rank %d in %d micro-batch(es)",
                      cfg.model, numel, numel * 4 / 1e6, global_batch, mine.stop - mine.start, len(micro))
        scale = self.world_size / global_batch
        loss_sums: list[float] = []
        comm_s: list[float] = []
        prof = self._profiler(rank)
        # rank 0 evaluates snapshots on a thread (wiiide.training.evaluation); FSDP's snapshot is an all-gather
        # on every rank, so rank 0's decision travels with the stop flag
        evaluator = evaluator_for(cfg, lambda: build_model(cfg, data.num_features, data.num_classes),
                                  data) if rank == 0 else None
        fsdp_snapshots = cfg.engine == "fsdp" and cfg.eval_every_s > 0
        net0 = psutil.net_io_counters()
        if rank == 0 and cfg.metrics_dir:  # as the WIIIIIDE coordinator: faults are timed from the first step
            touch(str(Path(cfg.metrics_dir) / TRAINING_MARKER))
        start = time.perf_counter()
        if evaluator:
            evaluator.start(start)
        step = 0
        while True:
            if cfg.max_steps and step >= cfg.max_steps:
                break
            if step % STOP_CHECK_EVERY_STEPS == 0:
                at_target = stop_at_target(cfg, evaluator)
                stop, snapshot = self._stop_requested(rank, start, fsdp_snapshots and evaluator is not None
                                                      and evaluator.due(), at_target)
                if stop:
                    break
                if snapshot:
                    full = []  # a collective on every rank; only rank 0 (the evaluator's) keeps the tensors
                    for p in model.parameters():
                        gathered = p.full_tensor()
                        if evaluator:
                            full.append(gathered)
                        del gathered
                    if evaluator:
                        evaluator.submit(step, step * global_batch, full)
            if evaluator and not fsdp_snapshots:  # ddp: rank 0 holds every parameter
                evaluator.offer(step, step * global_batch, model.parameters)
            self.timer.take_step()  # drop the stop broadcast's and any stray interval
            t0 = time.perf_counter()
            idx = np.concatenate([sampler.next_indices() for _ in range(cfg.num_workers)])[mine]
            x, y = torch.from_numpy(data.x_train[idx]), torch.from_numpy(data.y_train[idx])
            optimizer.zero_grad()
            loss_sum = 0.0
            for j, part in enumerate(micro):
                with self._sync(wrapped, j == len(micro) - 1):
                    with scope(model):
                        loss = summed_loss(cfg.model, wrapped(x[part]), y[part])
                    (loss * scale).backward()
                loss_sum += loss.item()
            lrs.applied(step, sgd.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
            m.record_step_time(time.perf_counter() - t0)
            in_flight_s, intervals = self.timer.take_step_intervals()
            comm_s.append(in_flight_s)
            if m.trace is not None:  # the collectives in flight, on the trace's wall clock
                unix_minus_perf_s = time.time() - time.perf_counter()
                for start, end in intervals:
                    m.trace.add("collective", "comm", step, end - start, end_unix_s=end + unix_minus_perf_s)
            loss_sums.append(loss_sum)
            step += 1
            m.steps = step
            self.beat.beat(step)
            if prof is not None:
                prof.step()
            if step % RSS_SAMPLE_EVERY_STEPS == 0:
                m.sample_rss()
            self.log.step(step, "step %d: local loss %.4f, %.1f ms", step, loss_sum / (mine.stop - mine.start),
                          1000 * m.step_times_s[-1])
        m.train_time_s = time.perf_counter() - start
        self.beat.beat(step, "finish")
        net1 = psutil.net_io_counters()
        if prof is not None:
            prof.stop()
        m.batches = step * cfg.num_workers if rank == 0 else step  # rank 0: in WIIIIIDE's unit, batch_size samples
        m.samples = step * global_batch if rank == 0 else step * (mine.stop - mine.start)
        m.losses = self._global_losses(loss_sums, global_batch)
        m.extra.update(lrs.to_dict())
        m.extra["tensor_memory"] = tensor_memory(model, optimizer, scope.activation_bytes)
        self._record_comm(expected, comm_s, net0, net1)
        eval_model = self._full_model(model, data, rank) if cfg.engine == "fsdp" else model
        if evaluator:
            evaluator.finish(step, m.samples, eval_model.parameters())
            record_held_out(m, evaluator)
        if rank == 0:
            result = evaluate(eval_model, data.x_test, data.y_test, data.task)
            m.extra.update(result.to_metrics())
            self.log.info("held-out %s after %d steps", result.log_text(), step)

    def _global_losses(self, loss_sums: list[float], global_batch: int) -> list[float]:
        """Mean loss over the global batch of every step (all ranks' sums added); checks the step counts agree."""
        buf = torch.tensor(loss_sums + [float(len(loss_sums))], dtype=torch.float64)
        dist.all_reduce(buf)
        if buf[-1].item() != self.world_size * len(loss_sums):
            raise NodeFailure(f"ranks ran different numbers of steps (this rank {len(loss_sums)}, "
                              f"mean {buf[-1].item() / self.world_size:g})")
        return (buf[:-1] / global_batch).tolist()

    def _full_model(self, model: nn.Module, data: Any, rank: int) -> nn.Module | None:
        """Rank 0: a plain copy of the FSDP model, its parameters all-gathered one at a time (a collective
        on every rank); the other ranks take part in each gather and drop the result at once, so no rank
        but 0 ever holds the whole model, and rank 0 holds it once (not twice). None on ranks > 0."""
        plain = build_model(self.cfg, data.num_features, data.num_classes) if rank == 0 else None
        own = dict(plain.named_parameters()) if plain is not None else {}
        for name, p in model.named_parameters():
            full = p.full_tensor()
            if plain is not None:
                with torch.no_grad():
                    own[name].copy_(full)
            del full
        return plain

    def _record_comm(self, expected: Any, comm_s: list[float], net0: Any, net1: Any) -> None:
        m = self.metrics
        m.extra["comm"] = comm_record(expected, m.step_times_s, comm_s, self.cfg.warmup_steps, self.timer.count,
                                      m.steps, net0, net1)


def main(cfg: RunConfig, role: str) -> int:
    """Run a DDP or FSDP rank for `role` (``coordinator`` is rank 0); returns the exit code."""
    return TorchNode(cfg, role).run()
