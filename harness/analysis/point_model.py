"""A sweep report's points set against the round model (`harness.analysis.round_model`).

`point_model` reads one point of report.json (as parsed): its measured step (the median over the
repeats of each repeat's median timed step, `_timed_step_s`), the compute, the nodes' CPU a step and the
machine's cores left to them, the run's partition layout rebuilt from its shard loads, and returns a
`ModelRow`: the model's step (the largest of its bounds) beside the measured one. `model_rows` does it
for every point of a report that the model covers (a rate-limited link).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from harness.analysis.round_model import TCP_PAYLOAD_SHARE, sharded_link_s, sharded_round_s
from harness.analysis.round_sim import STAGE_NAMES, NodeCpu, simulate_sharded_steps
from harness.links.readback import burst_in_force_bytes
from wiiide.codecs import codec_from_name
from wiiide.codecs.policy import fixed_lossy_ratio, parse_policy_name
from wiiide.server.ps.partition import (
    FLOAT32_BYTES,
    PER_SHARD_FINEST_BYTES,
    partition_by_weights,
    plan_partitions,
    shard_loads_bytes,
)

MIN_NODE_CORE_SHARE = 0.25  # the cores left to the nodes are taken as at least this share of the machine's


@dataclass(frozen=True)
class ModelRow:
    """One point: its parameters, the model's step (s), the measured step (s) and the error (model / measured - 1)."""

    params: dict[str, Any]
    model_step_s: float
    measured_step_s: float
    bytes_model_step_s: float | None = None  # sharded: compute + the busiest node's bytes (`sharded_link_s`)
    link_model_step_s: float | None = None  # compute + the links' round (the model without the cores' bound)
    cpu_step_s: float | None = None  # the cores' bound (module docstring); None: not measured or not one machine
    compute_phase_s: float | None = None  # sharded, two phases: the compute phase's bound; None: the roofline
    slowest_path_s: float | None = None  # sharded: the slowest worker's compute, then the links' round; None: not recorded
    simulated_step_s: float | None = None  # sharded: the timed stages' work scheduled on the cores and links
    # (`_simulated_step_s`); None: not recorded (older reports) or no one machine's cores
    lost_cores: float | None = None  # the cores the scheduler lost (`HostShares.lost_cores`); None: not traced
    work_conserving_step_s: float | None = None  # the model had the scheduler lost no core; None: not traced

    @property
    def error(self) -> float:
        """Relative error of the model against the measurement (negative: the model is faster)."""
        return self.model_step_s / self.measured_step_s - 1.0

    @property
    def work_conserving_error(self) -> float | None:
        """`error` of the model had the scheduler lost no core; None when the run was not traced."""
        if self.lost_cores is None or self.work_conserving_step_s is None:
            return None
        return self.work_conserving_step_s / self.measured_step_s - 1.0



def _timed_step_s(repeat: dict[str, Any]) -> float | None:
    """A repeat's measured step (s): the coordinator's median over its timed steps (its Training Summary's
    ``median_step_time_s``, warm-up steps left out, as ``step_cpu_s`` leaves them out); reports without it
    give the median over every step (``totals.step_time_median_s``). The warm-up steps of a lossy
    engine are dense (``lossy_warmup_steps``) and several times slower on a shaped link: in the median
    of all steps they raised the measured step above the compressed step the model is of (10 of 60
    steps on digits, 2 of 12 on the 26 MB model)."""
    summary = ((repeat.get("nodes") or {}).get("coordinator") or {}).get("training_summary") or {}
    timed = summary.get("median_step_time_s")
    if isinstance(timed, (int, float)) and timed > 0:
        return float(timed)
    return (repeat.get("totals") or {}).get("step_time_median_s")


def _step_cpu_s(repeats: Sequence[dict[str, Any]]) -> float | None:
    """The nodes' CPU seconds of a step: per repeat the sum over its nodes of each node's median
    ``step_cpu_s``, then the median over the repeats; None when a node of a repeat has no figure."""
    sums = []
    for rep in repeats:
        nodes = list((rep.get("nodes") or {}).values())
        medians = [((node.get("step_cpu_s") or {}).get("median")) for node in nodes]
        if nodes and all(isinstance(m, (int, float)) for m in medians):
            sums.append(float(sum(medians)))
    return _median(sums)


def _coordinator_median_s(repeats: Sequence[dict[str, Any]], field: str = "compute_max_s") -> float | None:
    """The compute of a step as the slowest worker had it (s): per repeat the coordinator's median over
    its timed steps of each step's slowest worker's forward and backward (``compute_max_s``,
    `wiiide.metrics`; with `field` ``compute_median_s``, its median worker's), then the median over the
    repeats; None when a repeat has none (older reports, and the central server)."""
    medians = [(((rep.get("nodes") or {}).get("coordinator") or {}).get(field) or {}).get("median")
               for rep in repeats]
    if not medians or any(not isinstance(m, (int, float)) for m in medians):
        return None
    return _median([float(m) for m in medians])


def _workers_compute_cpu_s(repeats: Sequence[dict[str, Any]]) -> float | None:
    """The workers' CPU seconds of a step's forward and backward: per repeat the sum over its workers of
    ``compute_cpu_s / steps`` (`wiiide.metrics`), then the median over the repeats; None when a worker of
    a repeat has no figure (older reports)."""
    sums = []
    for rep in repeats:
        workers = [n for name, n in (rep.get("nodes") or {}).items() if name.startswith("worker")]
        if not workers or any(not isinstance(n.get("compute_cpu_s"), (int, float)) or not n.get("steps")
                              for n in workers):
            return None
        sums.append(sum(n["compute_cpu_s"] / n["steps"] for n in workers))
    return _median(sums)


@dataclass(frozen=True)
class HostShares:
    """What a step needs of the machine beyond the nodes' processes (`host_cpu_shares`)."""

    kernel_step_cpu_s: float  # softirq + irq CPU seconds per timed step (the kernel's network work)
    other_cores: float  # cores taken by other processes (engine, harness, ...) over the timed steps
    steal_cores: float  # cores the hypervisor took (steal) over the timed steps
    lost_cores: float | None = None  # cores the scheduler left idle while threads waited (the repeats'
    # ``sched``, `harness.analysis.sched_trace`); None: not traced


def host_cpu_shares(repeats: Sequence[dict[str, Any]]) -> HostShares | None:
    """Per repeat, from the coordinator's ``host_cpu_s`` (the machine's CPU seconds by kind over its timed
    steps, `wiiide.metrics`) and every node's timed ``step_cpu_s`` (mean x count: its CPU over the same
    steps): the kernel's softirq + irq seconds per step, the cores the other processes took ((user + nice
    + system - the nodes' CPU) / window, at least 0), the steal's cores and, when every repeat was traced
    (``sched``, `harness.analysis.sched_trace`), the cores the scheduler left idle while threads waited; each
    the median over the repeats. None when a repeat has no window or a node no ``step_cpu_s`` (older
    reports)."""
    kernel, other, steal, lost = [], [], [], []
    for rep in repeats:
        sched = rep.get("sched") or {}
        if isinstance(sched.get("lost_cores"), (int, float)):
            lost.append(float(sched["lost_cores"]))
        nodes = rep.get("nodes") or {}
        window = (nodes.get("coordinator") or {}).get("host_cpu_s")
        if not window or not window.get("steps") or not window.get("window_s"):
            return None
        node_cpu = [((n.get("step_cpu_s") or {}).get("mean"), (n.get("step_cpu_s") or {}).get("count"))
                    for n in nodes.values()]
        if any(not isinstance(mean, (int, float)) or not count for mean, count in node_cpu):
            return None
        nodes_cpu_s = sum(mean * count for mean, count in node_cpu)
        busy_s = sum(float(window.get(kind) or 0.0) for kind in ("user", "nice", "system"))
        kernel.append((float(window.get("softirq") or 0.0) + float(window.get("irq") or 0.0)) / window["steps"])
        other.append(max(0.0, busy_s - nodes_cpu_s) / window["window_s"])
        steal.append(float(window.get("steal") or 0.0) / window["window_s"])
    if not kernel:
        return None
    return HostShares(_median(kernel), _median(other), _median(steal),
                      _median(lost) if len(lost) == len(repeats) else None)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def point_model(point: dict[str, Any], cores: int | None = None) -> ModelRow | None:
    """The model row of one point of a report (a report.json's ``points`` item), or None when it has no
    rate-limited link, no measured step or an engine the model does not cover. `cores`: the cores all
    nodes shared (one machine), for the cores' bound and the simulated schedule (`_simulated_step_s`,
    up to a second a repeat); None leaves both out."""
    profiles = ((point.get("cluster") or {}).get("link") or {}).get("profiles") or {}
    rates = [p.get("rate_bps") for p in profiles.values() if isinstance(p, dict)]
    if not rates or any(not r for r in rates):
        return None
    rate = min(rates) * TCP_PAYLOAD_SHARE
    ok = [r for r in point.get("repeats") or [] if r.get("status") == "ok" and r.get("nodes")]
    measured = _median([s for s in map(_timed_step_s, ok) if s])
    config = point.get("config") or {}
    workers = int(config.get("num_workers") or 0)
    if not measured or not ok or workers < 1:
        return None
    steps = [node["compute_time_s"] / node["steps"] for rep in ok for name, node in rep["nodes"].items()
             if name.startswith("worker") and node.get("steps") and node.get("compute_time_s")]
    compute_s = _coordinator_median_s(ok, "compute_median_s") or _median(steps) or 0.0
    first = ok[0]
    coord = first["nodes"].get("coordinator", {})
    engine = config.get("engine", "wiiide")
    nodes_cpu_s = _step_cpu_s(ok) if cores else None
    host = host_cpu_shares(ok) if nodes_cpu_s is not None else None
    node_cores = conserving_cores = cores
    lost_cores = host.lost_cores if host is not None else None
    if host is not None:  # the kernel's work on top of the nodes', on the cores the rest leaves them
        nodes_cpu_s += host.kernel_step_cpu_s
        conserving_cores = max(cores - host.other_cores - host.steal_cores, MIN_NODE_CORE_SHARE * cores)
        node_cores = max(conserving_cores - (lost_cores or 0.0), MIN_NODE_CORE_SHARE * cores)
    cpu_s = nodes_cpu_s / node_cores if nodes_cpu_s is not None else None  # the cores' bound
    params = dict(point.get("params") or {})
    if engine == "ddp":
        grad_bytes = next((n.get("gradient_bytes") for n in first["nodes"].values() if n.get("gradient_bytes")), None)
        if not grad_bytes or config.get("ddp_comm_hook", "none") != "none":
            return None
        ring_s = 2 * (workers - 1) / workers * grad_bytes * 8 / rate
        conserving_s = max(ring_s, nodes_cpu_s / conserving_cores) if lost_cores is not None else None
        return ModelRow(params, max(ring_s, cpu_s or 0.0), measured, link_model_step_s=ring_s, cpu_step_s=cpu_s,
                        lost_cores=lost_cores, work_conserving_step_s=conserving_s)
    ps = coord.get("ps") or {}
    loads = ps.get("shard_loads_bytes")
    if engine != "wiiide" or not loads or config.get("staleness_bound", 0) not in (0, "0"):
        return None
    partitions = _report_partitions(loads, workers, ps.get("partition_bytes") or config.get("partition_bytes"),
                                    ps.get("partition_balance") or "bytes", int(ps.get("partitions_per_shard") or 1),
                                    ps.get("partition_placement") or "contiguous",
                                    ps.get("partition_finest_bytes") or PER_SHARD_FINEST_BYTES)
    if partitions is None:
        return None
    lossy_ratio = _lossy_codec_ratio(config, [nbytes for _, nbytes in partitions])
    if lossy_ratio is not None:
        lossy_ratio = _measured_codec_ratio(ok, config) or lossy_ratio
        worker_ratio = coordinator_ratio = lossy_ratio
    else:
        worker_ratios = [float(n.get("compression_ratio") or 1.0) for k, n in first["nodes"].items()
                         if k.startswith("worker")]
        worker_ratio, coordinator_ratio = _median(worker_ratios) or 1.0, float(coord.get("compression_ratio") or 1.0)
    link_s = sharded_link_s(loads, workers, rate, worker_ratio, coordinator_ratio)
    burst, push_window = _link_burst_bytes(ok), _push_window_bytes(ok, config)
    round_s = sharded_round_s(partitions, workers, rate, worker_ratio, coordinator_ratio,
                              push_window, burst, min(burst, rate / 8 * compute_s))
    compute_cpu_s = _workers_compute_cpu_s(ok) if nodes_cpu_s is not None else None
    if compute_cpu_s is None:  # the roofline
        conserving_s = (max(compute_s + round_s, nodes_cpu_s / conserving_cores)
                        if lost_cores is not None and nodes_cpu_s is not None else None)
        return ModelRow(params, max(compute_s + round_s, cpu_s or 0.0), measured, compute_s + link_s,
                        compute_s + round_s, cpu_s, lost_cores=lost_cores, work_conserving_step_s=conserving_s)

    def two_phases_s(usable_cores: float) -> tuple[float, float]:
        compute_phase_s = max(compute_s, compute_cpu_s / usable_cores)
        return compute_phase_s, compute_phase_s + max(round_s, max(0.0, nodes_cpu_s - compute_cpu_s) / usable_cores)

    def schedule_s(usable_cores: float) -> float | None:
        return _simulated_step_s(ok, partitions, workers, rate, worker_ratio, coordinator_ratio, burst,
                                 push_window, usable_cores,
                                 host.kernel_step_cpu_s if host is not None else 0.0)

    compute_phase_s, phases_s = two_phases_s(node_cores)
    slowest_s = _coordinator_median_s(ok)
    slowest_path_s = slowest_s + round_s if slowest_s is not None else None
    scheduled_s = schedule_s(node_cores)
    conserving_s = None
    if lost_cores is not None:
        conserving_s = max(two_phases_s(conserving_cores)[1], slowest_path_s or 0.0,
                           (schedule_s(conserving_cores) or 0.0) if scheduled_s is not None else 0.0)
    return ModelRow(params, max(phases_s, slowest_path_s or 0.0, scheduled_s or 0.0), measured,
                    compute_s + link_s, compute_s + round_s, cpu_s, compute_phase_s, slowest_path_s, scheduled_s,
                    lost_cores, conserving_s)


def _simulated_step_s(repeats: Sequence[dict[str, Any]], partitions: Sequence[tuple[int, float]], workers: int,
                      rate_bps: float, worker_ratio: float, coordinator_ratio: float, burst_bytes: float,
                      push_window_bytes: float | None, node_cores: float, kernel_step_cpu_s: float) -> float | None:
    """The step of `harness.analysis.round_sim.simulate_sharded_steps` (s), the median over `repeats`,
    from each repeat's nodes: each stage's median CPU (``stage_cpu_s``), the forward and backward's CPU
    (``compute_cpu_s / steps``), every figure raised by the kernel's CPU per step (`kernel_step_cpu_s`)
    in proportion to the nodes' CPU (their ``step_cpu_s``); worker 1 held to
    the slowest worker's compute (``compute_max_s``), the others to the median worker's
    (``compute_median_s``). None when a node of a repeat lacks one (older reports, whose
    ``stage_cpu_s`` had four stages without the sends)."""
    steps = []
    for rep in repeats:
        nodes = rep.get("nodes") or {}
        names = ["coordinator", *(f"worker-{w}" for w in range(1, workers + 1))]
        if any(not ((nodes.get(name) or {}).get("stage_cpu_s") or {}).get("pull_send") for name in names):
            return None
        coordinator = nodes["coordinator"]
        slowest = ((coordinator.get("compute_max_s") or {}).get("median"))
        median = ((coordinator.get("compute_median_s") or {}).get("median"))
        step_cpu = [((nodes[name].get("step_cpu_s") or {}).get("median")) for name in names]
        if not isinstance(slowest, (int, float)) or not isinstance(median, (int, float)) or None in step_cpu:
            return None
        scale = (sum(step_cpu) + kernel_step_cpu_s) / sum(step_cpu) if sum(step_cpu) > 0 else 1.0
        cpus = []
        for rank, name in enumerate(names):
            node = nodes[name]
            stages = {stage: float(summary.get("median") or 0.0) for stage, summary in node["stage_cpu_s"].items()
                      if stage in STAGE_NAMES and isinstance(summary, dict)}
            if rank and (not isinstance(node.get("compute_cpu_s"), (int, float)) or not node.get("steps")):
                return None
            compute = node["compute_cpu_s"] / node["steps"] if rank else 0.0
            cpus.append(NodeCpu(compute * scale, {k: v * scale for k, v in stages.items()},
                                (slowest if rank == 1 else median) if rank else 0.0))
        steps.append(simulate_sharded_steps(partitions, workers, rate_bps, cpus, node_cores, worker_ratio,
                                            coordinator_ratio, burst_bytes, push_window_bytes))
    return _median(steps)


def _link_burst_bytes(repeats: Sequence[dict[str, Any]]) -> float:
    """The shaper's token bucket on the nodes' egress, bytes: the smallest that the harness read back from
    any node of `repeats` (``links.containers.*.applied``, `harness.links.readback.burst_in_force_bytes`);
    0 when none was read back."""
    found = [burst_in_force_bytes(entries or []) for rep in repeats
             for container in (((rep.get("links") or {}).get("containers")) or {}).values()
             for entries in ((container or {}).get("applied") or {}).values()]
    return float(min((b for b in found if b is not None), default=0))


def _push_window_bytes(repeats: Sequence[dict[str, Any]], config: dict[str, Any]) -> float | None:
    """An ordered run's push window for `sharded_round_s`: the median over the repeats' workers of the
    median congestion window their pushes started with (``ps.push_cwnd.median_bytes``, bytes); None (the
    concurrent simulation) for a concurrent run or a report without the figure (older reports)."""
    if config.get("push_schedule") != "ordered":
        return None
    windows = [float(node["ps"]["push_cwnd"]["median_bytes"]) for rep in repeats
               for name, node in rep["nodes"].items()
               if name.startswith("worker") and ((node.get("ps") or {}).get("push_cwnd") or {}).get("median_bytes")]
    return _median(windows)


def _lossy_codec_ratio(config: dict[str, Any], partition_nbytes: Sequence[float]) -> float | None:
    """raw / sent bytes of a step's pushes and pulls under a fixed lossy codec (``fixed:int8``,
    ``fixed:int4``, ``fixed:topk-...``; both directions use it after ``lossy_warmup_steps``): the codec's
    payload bytes for float32 partitions of `partition_nbytes` (bytes each), encoded here (their sizes
    depend on the element count only). None for any other policy, whose ratio is the nodes' measured
    ``compression_ratio``. A run's own ``compression_ratio`` does not serve for a lossy codec: it
    counts the dense warm-up steps and the dense traffic outside the steps (the plan's initial
    parameters, the final pull), which in a short run of a large model outweigh the steps (the 26 MB
    model's 12 steps at 4 workers with int4: 3.6 for the workers, against 7.76 per step)."""
    policy = str(config.get("compression") or "none")
    raw = sent = 0.0
    for numel, count in Counter(int(nbytes) // FLOAT32_BYTES for nbytes in partition_nbytes).items():
        ratio = fixed_lossy_ratio(policy, numel)
        if ratio is None:
            return None
        raw += count * numel * FLOAT32_BYTES
        sent += count * numel * FLOAT32_BYTES / ratio
    return raw / sent if sent else None


def _measured_codec_ratio(repeats: Sequence[dict[str, Any]], config: dict[str, Any]) -> float | None:
    """raw / payload bytes of every frame the nodes of `repeats` sent with the fixed policy's codec (their
    ``codec_bytes_sent``, `wiiide.metrics`): the ratio a data-dependent codec (int3z's entropy coder)
    reached on the run's own gradients, where `_lossy_codec_ratio` encodes Gaussian values. None when the
    policy is not a fixed codec or the nodes did not record it (older reports)."""
    try:
        mode, codec_name = parse_policy_name(str(config.get("compression") or "none"))
        name = codec_from_name(codec_name).name if mode == "fixed" else None
    except ValueError:
        return None
    raw = payload = 0
    for rep in repeats:
        for node in (rep.get("nodes") or {}).values():
            sent = (node.get("codec_bytes_sent") or {}).get(name) or {}
            raw += int(sent.get("raw_bytes") or 0)
            payload += int(sent.get("payload_bytes") or 0)
    return raw / payload if raw and payload else None


def _report_partitions(loads: Sequence[int], workers: int, partition_bytes: Any, balance: str, per_shard: int = 1,
                       placement: str = "contiguous",
                       finest_bytes: float = PER_SHARD_FINEST_BYTES) -> list[tuple[int, float]] | None:
    """(shard, bytes) of every partition of a sharded run, rebuilt as the run cut them: with ``pipeline``
    or ``egress`` shares one contiguous range per shard of exactly its reported load (the coordinator's
    at the tail or at the head), cut into partitions of at most `partition_bytes`, at least `per_shard`
    per shard while they stay `finest_bytes` or more (the run's ``ps.partition_finest_bytes``; reports
    from older reports: 64 KiB), dealt in turns with `placement` ``interleaved``
    (`wiiide.server.ps.partition.partition_by_weights`); with ``bytes``, `plan_partitions`. None when that does
    not give the loads the run reported."""
    if not isinstance(partition_bytes, int) or any(load % FLOAT32_BYTES or load <= 0 for load in loads):
        return None
    numel, k = sum(loads) // FLOAT32_BYTES, len(loads)
    try:
        if balance in ("pipeline", "egress"):
            order = [*range(1, k), 0] if balance == "pipeline" else None
            parts = partition_by_weights(numel, [load // FLOAT32_BYTES for load in loads], partition_bytes, order,
                                         per_shard, placement == "interleaved", finest_bytes)
        else:
            parts = plan_partitions(numel, k, workers, partition_bytes, balance, per_shard, placement, finest_bytes)
    except ValueError:
        return None
    if shard_loads_bytes(parts, k) != list(loads):
        return None
    return [(p.shard, float((p.stop - p.start) * FLOAT32_BYTES)) for p in parts]


def report_cores(report: dict[str, Any]) -> int | None:
    """The cores every node of a report's runs shared: the harness machine's ``cpu_count_logical`` for
    the single-host backends (docker, local), None for swarm (nodes on several machines) or when unknown."""
    if ((report.get("backend") or {}).get("name")) not in ("docker", "local"):
        return None
    cores = (report.get("machine_info") or {}).get("cpu_count_logical")
    return int(cores) if isinstance(cores, int) and cores >= 1 else None


def model_rows(report: dict[str, Any], per_repeat: bool = False,
               progress: Callable[[list[dict[str, Any]]], Iterable[dict[str, Any]]] | None = None) -> list[ModelRow]:
    """`point_model` of every point of a report (report.json as parsed) that the model covers, with the
    cores' bound where the report names one machine's cores (`report_cores`). `per_repeat`: one row per
    repeat of each point, the model and the measured step from that repeat alone (as a run of one
    repeat would have them; its params gain ``repeat``, the repeat's index). `progress`: wraps the list
    of points to model (a progress display, `rich.progress.track`)."""
    cores = report_cores(report)
    points = report.get("points") or []
    if per_repeat:
        points = [{**p, "params": {**(p.get("params") or {}), "repeat": i}, "repeats": [r]}
                  for p in points for i, r in enumerate(p.get("repeats") or [])]
    rows = (point_model(p, cores) for p in (progress(points) if progress else points))
    return [row for row in rows if row is not None]
