"""Timed collectives for the torch engines: DDP comm hooks and FSDP2 custom all-gather and
reduce-scatter that record each collective from launch to completion in an `IntervalTimer`
(`wiiide.engines.comm`), and the per-run ``comm`` record built from those intervals."""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from wiiide.engines.comm import IntervalTimer
from wiiide.metrics import summarize


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


def timed_fsdp_comms(timer: IntervalTimer) -> tuple[Any, Any]:
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


def comm_record(expected: Any, step_times_s: list[float], comm_s: list[float], warmup_steps: int, collectives: int,
                steps: int, net0: Any = None, net1: Any = None) -> dict[str, Any]:
    """A node's ``comm`` metrics record: the expected bytes, the seconds a step had a collective in flight.

    Args:
        expected: the `wiiide.engines.comm.CommEstimate` of the run.
        step_times_s, comm_s: per step, seconds of the step and of the union of its collectives' intervals.
        warmup_steps: steps left out of the figures (at most ``len(comm_s)``).
        collectives: collectives the timer recorded; steps: steps run.
        net0, net1: psutil's counters of the training interface before and after (None: not read).

    Returns:
        A JSON-ready dict: ``expected``, ``method``, ``busy_s_per_step`` (summary), ``share_of_step_time``
        (None when no step time), ``collectives``, ``train_iface_bytes_sent``/``_recv`` (None unread),
        ``train_iface_bytes_sent_per_step`` and, with timed steps, ``busy_s_median``.
    """
    warm = min(warmup_steps, len(comm_s))
    timed_comm, step_total = comm_s[warm:], sum(step_times_s[warm:])
    sent = (net1.bytes_sent - net0.bytes_sent) if net0 and net1 else None
    recv = (net1.bytes_recv - net0.bytes_recv) if net0 and net1 else None
    out: dict[str, Any] = {
        "expected": expected.to_dict(),
        "method": "union of collective launch-to-completion intervals per step (comm hooks / custom "
                  "all-gather and reduce-scatter), warm-up steps excluded",
        "busy_s_per_step": summarize(timed_comm),
        "share_of_step_time": (sum(timed_comm) / step_total) if step_total > 0 else None,
        "collectives": collectives,
        "train_iface_bytes_sent": sent,
        "train_iface_bytes_recv": recv,
        "train_iface_bytes_sent_per_step": (sent / steps) if (sent is not None and steps) else None,
    }
    if timed_comm:
        out["busy_s_median"] = statistics.median(timed_comm)
    return out
