"""PyTorch's engines on WIIIIIDE's nodes: DistributedDataParallel and FSDP2 over gloo.

``python -m wiiide coordinator|worker`` runs this module when ``engine`` is ``ddp`` or ``fsdp``: the
same image, containers and commands as the parameter server.

Rendezvous and ranks
    The coordinator is rank 0. It hosts the rendezvous, a `torch.distributed.TCPStore` on
    ``bind_host:port`` (workers connect to ``coordinator_host:port``), and touches ``ready_file`` once
    it listens (the container healthcheck). A worker does not know its index (Compose ``--scale`` does
    not tell it), so it takes the next rank from an atomic counter in the store (`claim_rank`):
    1..num_workers, in the order workers arrive. Gloo then connects every pair of ranks; in containers
    ``GLOO_SOCKET_IFNAME=eth0`` (compose.yaml) puts it on the cluster's bridge, and when the coordinator
    is a loopback address and the variable is unset, the loopback interface is chosen. When the harness
    shapes links it gates the start (``start_gate_file``): rank 0 waits for the gate before it joins
    the process group, so the other ranks wait too and no training traffic leaves unshaped.

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
import ctypes
import ipaddress
import math
import os
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

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
from wiiide.metrics import NodeMetrics, summarize
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
from wiiide.engines.progress import ProgressBeat
from wiiide.tensor_memory import ForwardScope, autocast_dtype, tensor_memory
from wiiide.wire.sockets import congestion_in_force, set_route_congestion
from wiiide.training.workload import workload_record

RANK_KEY = "wiiide/next_rank"
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
# glibc's mallopt parameters (<malloc.h>): M_TRIM_THRESHOLD and M_MMAP_THRESHOLD.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Every allocation of at least this many bytes gets its own mmap and goes back to the kernel when freed.
MMAP_THRESHOLD_BYTES = 1 << 20


def return_freed_memory(libc: Any = None) -> dict[str, int] | None:
    """Make glibc give freed tensor memory back to the kernel, so that a rank's RSS follows what it holds.

    By default glibc's mmap threshold is dynamic (mallopt(3)): once a freed mmapped chunk (a 4 MB weight,
    a gathered FSDP unit) raises the threshold to its size, later buffers of that size come from the
    heap, and a heap page freed below a live one stays resident. FSDP allocates and frees a unit's
    gathered parameters and gradients at every forward and backward, so its RSS grew towards DDP's
    though it holds a fifth of the state (docs/workloads.md, "Memory under FSDP"). Setting ``M_MMAP_THRESHOLD`` fixes the
    threshold (and turns the dynamic adjustment off): every allocation of `MMAP_THRESHOLD_BYTES` or more
    is its own mapping, unmapped when freed; ``M_TRIM_THRESHOLD`` lets free() trim the heap's top above
    the same size. Both engines (ddp, fsdp) run with it, so they are compared under one allocator policy.
    Call it before the model is built. Cost: one mmap/munmap and fresh zero pages per large buffer.

    Args:
        libc: a loaded C library (tests); default ``ctypes.CDLL("libc.so.6")``.

    Returns:
        ``{"mmap_threshold_bytes": ..., "trim_threshold_bytes": ...}`` when glibc took both settings,
        None when there is no glibc (musl, macOS) or it refused.
    """
    try:
        libc = libc or ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and ok
    except (OSError, AttributeError):
        return None
    return {"mmap_threshold_bytes": MMAP_THRESHOLD_BYTES, "trim_threshold_bytes": MMAP_THRESHOLD_BYTES} if ok else None


def trim_heap() -> None:
    """``malloc_trim(0)`` (glibc): return the free pages inside the heap to the kernel (after the full
    model's build and sharding); nothing without glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def claim_rank(store: Any, role: str, num_workers: int) -> int:
    """Rank of this node: 0 for the coordinator; a worker takes the next value of the store's counter.

    `store` needs ``add(key, amount) -> int`` (atomic, as `torch.distributed.TCPStore` provides).
    Raises NodeFailure when more workers arrive than ``num_workers``.
    """
    if role == "coordinator":
        return 0
    rank = int(store.add(RANK_KEY, 1))
    if not 1 <= rank <= num_workers:
        raise NodeFailure(f"this worker drew rank {rank} but the cluster has num_workers={num_workers}: "
                          "more workers joined than the coordinator expects", EXIT_CONNECT)
    return rank


def rank_slices(total: int, parts: int) -> list[slice]:
    """`parts` contiguous slices of ``range(total)``, sizes differing by at most one (larger first).

    Raises ValueError when a part would be empty (total < parts) or parts < 1.
    """
    if parts < 1 or total < parts:
        raise ValueError(f"cannot split {total} samples into {parts} non-empty parts")
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(slice(start, start + size))
        start += size
    return out


def loopback_interface() -> str | None:
    """Name of the interface holding 127.0.0.1 (``lo`` on Linux), None if there is none."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs):
            return name
    return None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _track(timer: IntervalTimer, start: float, work: Any) -> None:
    """Record a collective from `start` to its completion (now if it ran synchronously)."""
    if work is None:
        timer.add(start, timer.now())
        return
    work.get_future().add_done_callback(lambda _fut: timer.add(start, timer.now()))


def powersgd_bucket_cap_mb(model: nn.Module) -> int:
    """DDP's ``bucket_cap_mb`` (MiB, int) that puts every parameter of `model` in one gradient bucket:
    the parameters' bytes rounded up to whole MiB, and at least DDP's default of 25 MiB."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return max(25, math.ceil(nbytes / 2**20) + 1)


def timed_ddp_hook(inner: Callable, timer: IntervalTimer) -> Callable:
    """A DDP comm hook that runs `inner` and records each bucket from launch to its future's completion."""

    def hook(state, bucket):  # no annotations: DDP checks them against the real types  # noqa: ANN001, ANN202
        start = timer.now()
        fut = inner(state, bucket)

        def done(f: torch.futures.Future) -> Any:
            timer.add(start, timer.now())
            return f.value()

        return fut.then(done)

    return hook


def _timed_fsdp_comms(timer: IntervalTimer) -> tuple[Any, Any]:
    """(all-gather, reduce-scatter) for FSDP2's `set_custom_all_gather` / `set_custom_reduce_scatter`
    that record each collective from launch to completion in `timer`.

    They do what FSDP2's defaults do (``torch.empty`` buffers, `dist.all_gather_single`,
    `dist.reduce_scatter_single`: see ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``)
    with public APIs only: FSDP2 calls a custom comm's ``allocate(size, dtype=, device=)`` and
    ``__call__``, and does not require its private base classes.
    """

    def allocate(size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # noqa: ANN001
        return torch.empty(*size, dtype=dtype, device=device)

    class TimedAllGather:
        def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # noqa: ANN001
            return allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):  # noqa: ANN001
            start = timer.now()
            work = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
            _track(timer, start, work)
            return work

    class TimedReduceScatter:
        def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # noqa: ANN001
            return allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001
            start = timer.now()
            work = dist.reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op,
                                              async_op=async_op)
            _track(timer, start, work)
            return work

    return TimedAllGather(), TimedReduceScatter()


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
        if not os.environ.get("GLOO_SOCKET_IFNAME") and _is_loopback(cfg.coordinator_host):
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
        gather, scatter = _timed_fsdp_comms(self.timer)
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
        m, warm = self.metrics, min(self.cfg.warmup_steps, len(comm_s))
        timed_steps = m.step_times_s[warm:]
        timed_comm = comm_s[warm:]
        step_total = sum(timed_steps)
        sent = (net1.bytes_sent - net0.bytes_sent) if net0 and net1 else None
        recv = (net1.bytes_recv - net0.bytes_recv) if net0 and net1 else None
        m.extra["comm"] = {
            "expected": expected.to_dict(),
            "method": "union of collective launch-to-completion intervals per step (comm hooks / custom "
                      "all-gather and reduce-scatter), warm-up steps excluded",
            "busy_s_per_step": summarize(timed_comm),
            "share_of_step_time": (sum(timed_comm) / step_total) if step_total > 0 else None,
            "collectives": self.timer.count,
            "train_iface_bytes_sent": sent,
            "train_iface_bytes_recv": recv,
            "train_iface_bytes_sent_per_step": (sent / m.steps) if (sent is not None and m.steps) else None,
        }
        if timed_comm:
            m.extra["comm"]["busy_s_median"] = statistics.median(timed_comm)


def main(cfg: RunConfig, role: str) -> int:
    """Run a DDP or FSDP rank for `role` (``coordinator`` is rank 0); returns the exit code."""
    return TorchNode(cfg, role).run()
