"""Step time and samples/s at more workers, predicted from a measured run (``wiiide-lab predict``).

A measured sweep report gives, per engine and link, what a step costs at the worker counts it ran:
each node's CPU a step, the workers' compute, the model's bytes, the links as the harness shaped them.
`calibrate` fits the few constants the model cannot know from first principles; `predict` evaluates the
model at other worker counts (or another link); `validate` calibrates on some worker counts of a report
and sets the prediction beside the measured steps of the others, as the simulators publish it (ASTRA-sim,
Rashidi et al. 2020 / Won et al. 2023: error per system size, geomean and worst).

The model, for W workers and P = W + 1 nodes (the coordinator, or rank 0, and the workers), with every
node's egress shaped to a rate (the harness's ``tc`` shaping; R = rate x `TCP_PAYLOAD_SHARE`), one-way
delay d per link, M the model's float32 bytes and r the codec's ratio (M' = M / r)::

    step_s(W) = overhead_s + max(compute_s + links_s(W) + latency_s(W), cores_s(W))

(for ring engines ``max(a, b) + min(a, b) / B``, B the model's DDP buckets: below).

- central parameter server (``ps_shards 1``): the parameters leave the coordinator once per worker, then
  each worker's gradient crosses its own link: ``links_s = W M' / R + M' / R``, ``latency_s = 2 d``.
  With local SGD (``local_steps`` H) a step is a round of H local steps: the same bytes once a round.
- sharded servers (k shards, one on the coordinator and one on each of the first k - 1 workers; ``all``:
  k = P): a worker holding a shard sends its pushes to the other shards and serves its slice to the
  other workers, ``M' (k-1)/k + (W-1) M'/k``; the coordinator serves its slice to every worker, ``W M'/k``;
  partitions pipeline the pushes and pulls (`wiiide.server.ps.client`), so the busiest egress sets
  ``links_s = max(...) / R``, ``latency_s = 2 d``.
- ring all-reduce (DDP, and FSDP's all-gathers and reduce-scatters): each rank sends the engine's
  expected bytes per rank (`wiiide.engines.comm.estimate`, from the report's
  ``comm_expected_bytes_per_step`` at calibration, which follows the hook: fp16, PowerSGD,
  post-local-SGD's one all-reduce every H steps), scaling as (P-1)/P; ``latency_s = 2 (P-1) d`` (a
  ring all-reduce's 2 (P-1) steps; Patarasuk and Yuan 2009), over H for post-local-SGD. A bucket's
  all-reduce starts only once the backward has filled it, so of the link time and the CPU only the
  buckets before the last overlap: ``max(a, b) + min(a, b) / B`` with B = ceil(M / 25 MiB), DDP's
  default ``bucket_cap_mb`` (`ring_buckets`): a model in one bucket pays the sum. The central and the
  sharded servers keep the max: a central worker's pull waits on the coordinator, not on the CPU of the
  others, and sharded pushes leave per partition as the backward reaches them.
- ``cores_s``: where the nodes share one machine's cores (as every run of this harness on one host),
  the CPU of a step of every node over the cores the machine's other processes and the hypervisor's
  steal left them (`harness.analysis.point_model.host_cpu_shares`, as the round model reads them): ``(cpu_0(W) + W cpu_w(W)) / cores``, each role's CPU a
  step linear in W (fitted: the central server's coordinator does W decodes a step, a shard serves W - 1
  pulls); with ``machine_per_node`` each node has a machine of its own and the term is the busiest node's
  CPU a step (its work taken as serial: the nodes run one training thread, ``torch_threads``).
- ``overhead_s``: what a step costs beyond those terms (handout, barrier, the optimizer, the scheduler),
  fitted at calibration as the mean residual of the calibration points; ``compute_s`` is the workers'
  measured forward and backward (0 where the engine does not record it apart, DDP: then the overhead
  holds it, since the per-worker batch, and so the compute, does not change with W).

An unshaped link is taken at `UNSHAPED_RATE_BPS`, the Python TCP rate between two containers on this
kind of machine (``shared/ENVIRONMENT.md``: 0.8-1.0 GB/s); there the CPU term decides.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterable, Mapping, Sequence

from harness.analysis.point_model import MIN_NODE_CORE_SHARE, host_cpu_shares
from harness.analysis.round_model import TCP_PAYLOAD_SHARE
from harness.errors import HarnessError
from wiiide.codecs.policy import fixed_lossy_ratio

FLOAT32_BYTES = 4
UNSHAPED_RATE_BPS = 8e9  # Python TCP between two containers, 8 MiB buffers: about 1 GB/s (ENVIRONMENT.md)
DDP_BUCKET_CAP_BYTES = 25 * 2**20  # torch.nn.parallel.DistributedDataParallel's bucket_cap_mb default (25)


@dataclass(frozen=True)
class Measured:
    """One point of a report, reduced to what the model reads (medians over its ok repeats).

    ``step_s`` is the measured step (a round of H local steps under central local SGD),
    ``cpu_coordinator_s`` / ``cpu_worker_s`` the CPU seconds a step of the coordinator (rank 0) and of the
    median worker, ``compute_s`` the median worker's forward and backward a step (0: not recorded),
    ``ring_bytes`` the expected bytes one rank sends a step for ring engines (0 otherwise),
    ``samples_per_worker_step`` the samples one worker trains on a step.
    """

    engine: str
    family: str  # central | sharded | ring
    link: str
    workers: int
    shards: int  # sharded: k; else 1
    step_s: float
    cpu_coordinator_s: float
    cpu_worker_s: float
    compute_s: float
    model_bytes: float
    codec_ratio: float
    ring_bytes: float
    rate_bps: float | None  # None: unshaped
    delay_s: float
    samples_per_worker_step: float
    cores: float
    exchanges_per_step: float = 1.0  # ring: all-reduces a step (post-local-SGD: 1 / local_steps)
    node_cores: float | None = None  # the cores the machine's other processes and steal left the nodes


@dataclass(frozen=True)
class Calibration:
    """The fitted constants of one engine on one link: the overhead (s) and each role's CPU a step as
    ``a + b W`` (s); ``sizes`` are the worker counts it was fitted on."""

    base: Measured
    overhead_s: float
    cpu_coordinator: tuple[float, float]
    cpu_worker: tuple[float, float]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class Prediction:
    """The model at W workers: step (s), samples/s, and its terms (s); ``bound`` is ``links`` or ``cores``."""

    engine: str
    link: str
    workers: int
    step_s: float
    samples_per_s: float
    links_s: float
    latency_s: float
    cores_s: float
    bound: str
    measured_step_s: float | None = None

    @property
    def error(self) -> float | None:
        """predicted / measured - 1 (None without a measurement)."""
        return None if self.measured_step_s is None else self.step_s / self.measured_step_s - 1.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, and ``error`` where measured."""
        return {**asdict(self), "error": self.error}


def _median(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _family(config: Mapping[str, Any]) -> str:
    if config.get("engine") in ("ddp", "fsdp"):
        return "ring"
    return "central" if str(config.get("ps_shards", "1")) == "1" else "sharded"


def _shards(config: Mapping[str, Any], workers: int) -> int:
    value = str(config.get("ps_shards", "1"))
    return workers + 1 if value == "all" else min(int(value), workers + 1)


def _codec_ratio(config: Mapping[str, Any], totals: Mapping[str, Any], numel: int) -> float:
    lossy = fixed_lossy_ratio(str(config.get("compression", "none")), numel)
    if lossy is not None:
        return lossy
    measured = totals.get("compression_ratio")
    return measured if measured and measured > 1.0 else 1.0


def _link(point: Mapping[str, Any]) -> tuple[float | None, float]:
    profiles = ((point.get("cluster") or {}).get("link") or {}).get("profiles") or {}
    profile = profiles.get("all") or next(iter(profiles.values()), None) or {}
    return profile.get("rate_bps"), float(profile.get("delay_ms") or 0.0) / 1e3


def _node_step_cpu_s(node: Mapping[str, Any]) -> float | None:
    summary = node.get("step_cpu_s")
    return summary.get("median") if isinstance(summary, Mapping) else None


def measured_point(point: Mapping[str, Any], report_cores: float) -> Measured | None:
    """A report point as `Measured`; None when no repeat of it is ok or it lacks the step or the model."""
    config, params = point.get("config") or {}, point.get("params") or {}
    repeats = [r for r in point.get("repeats") or [] if r.get("status") == "ok"]
    steps = [r["totals"].get("step_time_median_s") for r in repeats]
    if not repeats or _median(steps) is None:
        return None
    workers = int(config.get("num_workers") or params.get("workers"))
    coord_cpu, worker_cpu, compute, numel, ratios, ring, samples = [], [], [], [], [], [], []
    for rep in repeats:
        nodes, totals = rep.get("nodes") or {}, rep["totals"]
        coord = nodes.get("coordinator") or {}
        ranks = [n for name, n in nodes.items() if name.startswith("worker")]
        coord_cpu.append(_node_step_cpu_s(coord))
        worker_cpu.append(_median(_node_step_cpu_s(n) for n in ranks))
        compute.append(_median((n.get("compute_time_s") or 0.0) / n["steps"] for n in ranks if n.get("steps")))
        numel.append(coord.get("num_parameters"))
        ratios.append(_codec_ratio(config, totals, int(coord.get("num_parameters") or 1)))
        ring.append((totals.get("comm_expected_bytes_per_step") or 0.0) / (workers + 1))
        if totals.get("samples_per_s") and totals.get("step_time_median_s"):
            samples.append(totals["samples_per_s"] * totals["step_time_median_s"] / workers)
    if _median(numel) is None:
        return None
    rate_bps, delay_s = _link(point)
    family = _family(config)
    host = host_cpu_shares(repeats)
    node_cores = (max(report_cores - host.other_cores - host.steal_cores, MIN_NODE_CORE_SHARE * report_cores)
                  if host is not None else None)
    return Measured(
        engine=str(params.get("engine", config.get("engine"))), family=family,
        link=str(params.get("link", "none")), workers=workers, shards=_shards(config, workers),
        step_s=_median(steps), cpu_coordinator_s=_median(coord_cpu) or 0.0, cpu_worker_s=_median(worker_cpu) or 0.0,
        compute_s=_median(compute) or 0.0, model_bytes=FLOAT32_BYTES * _median(numel), codec_ratio=_median(ratios),
        ring_bytes=_median(ring) if family == "ring" else 0.0, rate_bps=rate_bps, delay_s=delay_s,
        samples_per_worker_step=_median(samples) or float(config.get("batch_size") or 0), cores=report_cores,
        exchanges_per_step=1.0 / max(1, int(config.get("local_steps") or 1))
        if config.get("ddp_comm_hook") == "post_local_sgd" else 1.0, node_cores=node_cores)


def _links_s(m: Measured, workers: int) -> tuple[float, float]:
    """(links_s, latency_s) of `m`'s engine at `workers`, with `m`'s link and bytes (module docstring)."""
    rate = (m.rate_bps or UNSHAPED_RATE_BPS) * TCP_PAYLOAD_SHARE / 8  # bytes/s
    model = m.model_bytes / m.codec_ratio
    nodes = workers + 1
    if m.family == "central":
        return (workers + 1) * model / rate, 2 * m.delay_s
    if m.family == "sharded":
        k = nodes if m.shards >= m.workers + 1 else min(m.shards, nodes)
        worker = model * (k - 1) / k + (workers - 1) * model / k
        return max(worker, workers * model / k) / rate, 2 * m.delay_s
    per_rank = m.ring_bytes * ((nodes - 1) / nodes) / (m.workers / (m.workers + 1))  # (P-1)/P, from P0 = W0 + 1
    return per_rank / rate, 2 * (nodes - 1) * m.delay_s * m.exchanges_per_step


def _line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of the least-squares line a + b x through (x, y) points; one point: (y, 0)."""
    if len(points) == 1 or len({x for x, _ in points}) == 1:
        return statistics.mean(y for _, y in points), 0.0
    slope, intercept = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
    return intercept, slope


def _terms(m: Measured, cal_cpu: tuple[tuple[float, float], tuple[float, float]], workers: int,
           machine_per_node: bool) -> tuple[float, float, float]:
    links_s, latency_s = _links_s(m, workers)
    (a0, b0), (aw, bw) = cal_cpu
    coord, worker = max(0.0, a0 + b0 * workers), max(0.0, aw + bw * workers)
    cores = m.node_cores or m.cores or 1.0
    cores_s = max(coord, worker) if machine_per_node else (coord + workers * worker) / cores
    return links_s, latency_s, cores_s


def _combine(m: Measured, path_s: float, cores_s: float) -> float:
    """The step from its critical path and its cores term (module docstring): their max, except for ring
    engines, whose all-reduce of a gradient bucket waits for the backward that fills it, so that only
    the buckets before the last overlap the compute: ``max + min / B`` with B = `ring_buckets` (one
    bucket: the sum)."""
    if m.family != "ring":
        return max(path_s, cores_s)
    return max(path_s, cores_s) + min(path_s, cores_s) / ring_buckets(m.model_bytes)


def ring_buckets(model_bytes: float) -> int:
    """DDP's gradient buckets for a model of `model_bytes` float32 bytes at its default ``bucket_cap_mb`` of
    25 MiB (`DDP_BUCKET_CAP_BYTES`; Li et al., "PyTorch Distributed", VLDB 2020: a bucket's all-reduce
    starts once its gradients are all computed, so bucketing is what overlaps communication with the
    backward pass); at least 1."""
    return max(1, math.ceil(model_bytes / DDP_BUCKET_CAP_BYTES))


def calibrate(points: Sequence[Measured]) -> Calibration:
    """Fit one engine on one link from its points at two or more worker counts (one: CPU a step held
    constant). Raises HarnessError when `points` is empty or mixes engines or links."""
    if not points:
        raise HarnessError("predict: nothing to calibrate on (no ok point of this engine and link)")
    if len({(p.engine, p.link) for p in points}) != 1:
        raise HarnessError("predict: a calibration takes one engine on one link")
    base = max(points, key=lambda p: p.workers)
    cpu = (_line([(p.workers, p.cpu_coordinator_s) for p in points]),
           _line([(p.workers, p.cpu_worker_s) for p in points]))
    residuals = []
    for p in points:
        links_s, latency_s, cores_s = _terms(p, cpu, p.workers, False)
        residuals.append(p.step_s - _combine(p, p.compute_s + links_s + latency_s, cores_s))
    return Calibration(base, statistics.mean(residuals), cpu[0], cpu[1], tuple(sorted(p.workers for p in points)))


def predict(cal: Calibration, workers: int, *, rate_bps: float | None = None, delay_s: float | None = None,
            link: str | None = None, machine_per_node: bool = False, node_cores: float | None = None) -> Prediction:
    """The model of `cal` at `workers` (>= 1), on the calibration's link or on another one (`rate_bps`,
    `delay_s`; `link` labels it); `node_cores`: the cores the nodes have (default: what the calibration
    run's other processes left them). Raises HarnessError for workers < 1."""
    if workers < 1:
        raise HarnessError(f"predict: workers must be >= 1, got {workers}")
    m = cal.base
    if node_cores is not None:
        m = replace(m, node_cores=node_cores)
    if rate_bps is not None or delay_s is not None:
        m = replace(m, rate_bps=rate_bps, delay_s=delay_s or 0.0)
    links_s, latency_s, cores_s = _terms(m, (cal.cpu_coordinator, cal.cpu_worker), workers, machine_per_node)
    path_s = m.compute_s + links_s + latency_s
    step_s = max(1e-9, cal.overhead_s + _combine(m, path_s, cores_s))
    return Prediction(m.engine, link or m.link, workers, step_s, workers * m.samples_per_worker_step / step_s,
                      links_s, latency_s, cores_s, "links" if path_s >= cores_s else "cores")


def report_measurements(report: Mapping[str, Any]) -> list[Measured]:
    """Every ok point of a report (`harness.results.report.load_report_json`) as `Measured`."""
    cores = float((report.get("machine_info") or {}).get("cpu_count_logical") or 1)
    return [m for m in (measured_point(p, cores) for p in report.get("points") or []) if m is not None]


def _groups(measured: Sequence[Measured]) -> dict[tuple[str, str], list[Measured]]:
    groups: dict[tuple[str, str], list[Measured]] = {}
    for m in measured:
        groups.setdefault((m.engine, m.link), []).append(m)
    return groups


def validate(measured: Sequence[Measured], calibrate_on: Sequence[int]) -> list[Prediction]:
    """Calibrate every (engine, link) on its points at `calibrate_on` worker counts and predict its
    other points; each prediction carries the measured step. The cores a predicted point's nodes had
    (what the machine's other processes left them during its run) are an input of its prediction, as its
    link is. Groups without a calibration point or without another point are left out."""
    rows = []
    for (_, _), points in sorted(_groups(measured).items()):
        train = [p for p in points if p.workers in calibrate_on]
        test = [p for p in points if p.workers not in calibrate_on]
        if not train or not test:
            continue
        cal = calibrate(train)
        rows += [replace(predict(cal, p.workers, node_cores=p.node_cores), measured_step_s=p.step_s)
                 for p in sorted(test, key=lambda p: p.workers)]
    return rows


def error_summary(rows: Sequence[Prediction]) -> dict[str, float | int | None]:
    """The geometric mean and the worst of |error| over `rows` (ASTRA-sim's reading), and their count."""
    errors = [abs(r.error) for r in rows if r.error is not None]
    if not errors:
        return {"count": 0, "geomean_abs_error": None, "worst_abs_error": None}
    geomean = math.exp(statistics.mean(math.log(max(e, 1e-6)) for e in errors))
    return {"count": len(errors), "geomean_abs_error": geomean, "worst_abs_error": max(errors)}


def predict_report(measured: Sequence[Measured], workers: Sequence[int], *, rate_bps: float | None = None,
                   delay_s: float | None = None, link: str | None = None,
                   machine_per_node: bool = False) -> list[Prediction]:
    """Calibrate every (engine, link) of `measured` on all its points and predict it at `workers`."""
    rows = []
    for _, points in sorted(_groups(measured).items()):
        cal = calibrate(points)
        rows += [predict(cal, w, rate_bps=rate_bps, delay_s=delay_s, link=link, machine_per_node=machine_per_node)
                 for w in workers]
    return rows
