"""The communication profiler: the bytes an engine must move per step, and the time it spends moving them.

Expected bytes per optimizer step come from the model's parameter shapes alone (`estimate`), for:

- ``wiiide`` (the parameter server): every worker receives the parameters and sends a gradient, so
  the coordinator's link carries ``2 x workers x parameter bytes`` (half each way) and each worker's
  ``2 x parameter bytes``. The mini-batches it also ships are data, counted apart (``data_bytes``).
- ``ddp`` (ring all-reduce, gloo's default algorithm): each rank sends and receives
  ``2 (W-1)/W x parameter bytes`` (reduce-scatter then all-gather around the ring; Patarasuk and
  Yuan, "Bandwidth optimal all-reduce algorithms", 2009). The fp16 hook halves it; PowerSGD
  (Vogels et al., 2019; ``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``) all-reduces
  ``r (n + m)`` values for an n x m weight worth compressing (``n m > r (n + m) x 2``) and the rest
  uncompressed. ``post_local_sgd`` (PostLocalSGDOptimizer with PeriodicModelAverager) all-reduces the
  parameters once every ``local_steps`` steps and no gradient: the ring bytes / H per step.
- ``fsdp`` (FSDP2 ``fully_shard`` of every Linear): each all-gather and reduce-scatter moves
  ``(W-1)/W`` of the (padded) parameter bytes per rank. FULL_SHARD gathers twice per step (forward,
  and again for backward after resharding), ``reshard_after_forward=False`` once, and gradients are
  reduce-scattered once. FSDP2 shards dim 0 and pads it to a multiple of W, counted here.

`IntervalTimer` records when collectives were in flight (launch to completion, from any thread) so
a node can report the share of its step time during which communication was going on.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

FP32_BYTES = 4
# PowerSGD's default: a tensor is compressed only when that shrinks it at least this much.
POWERSGD_MIN_COMPRESSION_RATE = 2


@dataclass(frozen=True)
class CommEstimate:
    """Bytes one optimizer step must move, from the model's size alone (per direction where stated).

    ``per_rank_sent_bytes``: what one ordinary rank (a worker, for the parameter server) sends;
    ``bottleneck_bytes``: sent + received by the busiest node (the coordinator for the parameter server);
    ``total_bytes``: summed over every node's sends (each byte counted once, on the link it leaves by).
    """

    scheme: str
    world_size: int
    param_bytes: int
    per_rank_sent_bytes: float
    per_rank_received_bytes: float
    bottleneck_node: str
    bottleneck_bytes: float
    total_bytes: float
    data_bytes: float = 0.0  # mini-batches shipped over the network (parameter server only)

    def to_dict(self) -> dict[str, Any]:
        """The estimate as a JSON-ready dict (bytes as floats)."""
        return asdict(self)


def ring_factor(world_size: int) -> float:
    """2 (W-1)/W: the fraction of a buffer each rank sends (and receives) in a ring all-reduce."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    return 2.0 * (world_size - 1) / world_size


def parameter_server(param_bytes: int, num_workers: int, data_bytes_per_step: float = 0.0) -> CommEstimate:
    """The parameter server: parameters out to every worker and a gradient back from each."""
    if num_workers < 1:
        raise ValueError(f"the parameter server needs >= 1 worker, got {num_workers}")
    coord = 2.0 * num_workers * param_bytes
    return CommEstimate("parameter-server", num_workers + 1, param_bytes, float(param_bytes), float(param_bytes),
                        "coordinator", coord, coord, data_bytes_per_step)  # total: N x P out + N x P back


def _all_reduce(scheme: str, buffer_bytes: float, param_bytes: int, world_size: int) -> CommEstimate:
    per_rank = ring_factor(world_size) * buffer_bytes
    return CommEstimate(scheme, world_size, param_bytes, per_rank, per_rank, "any rank", 2 * per_rank,
                        world_size * per_rank)


def powersgd_elements(shapes: Iterable[Sequence[int]], rank: int,
                      min_compression_rate: float = POWERSGD_MIN_COMPRESSION_RATE) -> int:
    """Values PowerSGD all-reduces per step: r (n + m) for each n x m tensor worth compressing, the
    whole tensor for the others (1-D tensors always go uncompressed)."""
    total = 0
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) < 2:
            total += numel
            continue
        n, m = shape[0], numel // shape[0]
        compressed = (n + m) * rank
        total += compressed if numel > compressed * min_compression_rate else numel
    return total


def fsdp_padded_elements(shapes: Iterable[Sequence[int]], world_size: int) -> int:
    """Elements of the all-gathered parameters: dim 0 of each is padded to a multiple of W (FSDP2)."""
    total = 0
    for shape in shapes:
        rows = shape[0] if shape else 1
        per_row = math.prod(shape[1:]) if len(shape) > 1 else 1
        total += math.ceil(rows / world_size) * world_size * per_row
    return total


def estimate(engine: str, shapes: Sequence[Sequence[int]], num_workers: int, *, ddp_comm_hook: str = "none",
             powersgd_rank: int = 1, fsdp_reshard_after_forward: bool = True, param_dtype_bytes: int = FP32_BYTES,
             reduce_dtype_bytes: int = FP32_BYTES, data_bytes_per_step: float = 0.0,
             local_steps: int = 1) -> CommEstimate:
    """Expected bytes per optimizer step of `engine` for a model whose parameters have `shapes`.

    World size is ``num_workers + 1`` for every engine (the coordinator is the parameter server, or
    rank 0). ``param_dtype_bytes``/``reduce_dtype_bytes``: FSDP's all-gather and reduce-scatter element
    sizes (2 for bf16). Raises ValueError for an unknown engine or hook.
    """
    numel = sum(math.prod(s) for s in shapes)
    param_bytes = numel * FP32_BYTES
    world = num_workers + 1
    if engine == "wiiide":
        return parameter_server(param_bytes, num_workers, data_bytes_per_step)
    if engine == "ddp":
        if ddp_comm_hook == "none":
            return _all_reduce("ring-all-reduce", param_bytes, param_bytes, world)
        if ddp_comm_hook == "fp16":
            return _all_reduce("ring-all-reduce-fp16", param_bytes / 2, param_bytes, world)
        if ddp_comm_hook == "powersgd":
            return _all_reduce(f"powersgd-rank-{powersgd_rank}",
                               powersgd_elements(shapes, powersgd_rank) * FP32_BYTES, param_bytes, world)
        if ddp_comm_hook == "post_local_sgd":  # one parameter all-reduce every local_steps steps, on average
            return _all_reduce(f"post-local-sgd-{local_steps}", param_bytes / max(1, local_steps), param_bytes, world)
        raise ValueError(f"unknown ddp_comm_hook {ddp_comm_hook!r}")
    if engine == "fsdp":
        padded = fsdp_padded_elements(shapes, world)
        gathers = 2 if fsdp_reshard_after_forward else 1
        per_rank = (world - 1) / world * padded * (gathers * param_dtype_bytes + reduce_dtype_bytes)
        scheme = "fsdp-full-shard" if fsdp_reshard_after_forward else "fsdp-shard-grad-op"
        return CommEstimate(scheme, world, param_bytes, per_rank, per_rank, "any rank", 2 * per_rank, world * per_rank)
    raise ValueError(f"unknown engine {engine!r}")


def union_length_s(intervals: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the (start, end) intervals (overlaps counted once)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if end < start:
            raise ValueError(f"interval ends before it starts: ({start}, {end})")
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


class IntervalTimer:
    """Collects (launch, completion) times of collectives from any thread; one step at a time.

    `begin` opens an in-flight interval and returns its start; `end` closes it (a future's callback may
    call it from the backend's thread). `take_step` returns the seconds covered since the last call and
    clears the intervals.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []
        self.count = 0

    @staticmethod
    def now() -> float:
        """Monotonic seconds (`time.perf_counter`), the clock of `add`."""
        return time.perf_counter()

    def add(self, start: float, end: float) -> None:
        """Record one collective in flight from `start` to `end` (seconds of `now`); thread-safe."""
        with self._lock:
            self._intervals.append((start, end))
            self.count += 1

    def take_step(self) -> float:
        """Seconds during which at least one recorded collective was in flight since the last call
        (`union_length_s`), and forget those intervals.
        """
        return self.take_step_intervals()[0]

    def take_step_intervals(self) -> tuple[float, list[tuple[float, float]]]:
        """`take_step`'s seconds and the (start, end) intervals (`now` seconds) they cover."""
        with self._lock:
            intervals, self._intervals = self._intervals, []
        return union_length_s(intervals), intervals
