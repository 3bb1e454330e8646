"""The sweep report as typed models (pydantic v2): `Report` > `Point` > `Repeat` > `Totals`, and the
point's `Stats` per figure. `harness/results/report.schema.json` is generated from them
(`python -m harness.results.schema`).

Layout (after pyperf / pytest-benchmark: metadata first, raw values kept, statistics computed from
them; docs/reports.md)::

    Report: schema_version, name, created_at_utc, updated_at_utc, complete, note, resumed_at_utc,
            resumed_commit_info, machine_info, commit_info, backend, spec, param_names, host_sysctls,
            points: [Point: index, params, config, cluster, status, error,
                     repeats: [Repeat: repeat, status, error, started_at_utc, elapsed_s,
                               totals: Totals, nodes, containers, links, limits, faults, exit_codes,
                               logs_dir, held_out: HeldOut (curve: [HeldOutPoint])],
                     summary: {<Totals field>: Stats}, unstable: [<Totals field>...]]

Every model keeps keys it does not know (``extra="allow"``): a report written by a newer harness, or
a node's own metrics (whose schema is wiiide's, `wiiide.metrics_model.NodeMetricsFile`), load and save
unchanged. What is not a harness figure stays a plain ``dict[str, Any]``: a node's metrics (kept as the
node wrote them; the report's JSON Schema refers to the node's for them), the links stage's records
(`harness.run.shaping`), CPU/memory limits, faults, the point's config.

Units are in the names: ``_s`` seconds, ``_bytes`` bytes, ``_bytes_per_s`` bytes per second,
``_bps`` bits per second; fractions (``test_accuracy``, ``comm_share``, ...) are in [0, 1].
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from wiiide.metrics_model import ValueSummary

# The tables of `harness.results.frames.to_dataframe`: one row per repeat, node of a repeat,
# stats sample of a container, held-out evaluation
TableName = Literal["repeats", "nodes", "stats", "evals"]
TABLES: tuple[TableName, ...] = ("repeats", "nodes", "stats", "evals")

# The published schema of a node's metrics file (`wiiide.metrics_model.NodeMetricsFile`, shipped as
# harness/results/node_metrics.schema.json); the report's schema refers to it for ``nodes``
NODE_METRICS_SCHEMA_ID = "https://wiiide.invalid/schemas/node_metrics.schema.json"  # a name: nothing is fetched

# A figure whose stdev is above this fraction of its mean over a point's repeats is "unstable" (pyperf's rule).
UNSTABLE_CV = 0.10


class _Model(BaseModel):
    """Base of the report's models: unknown keys are kept (and written back), fields assignable."""

    model_config = ConfigDict(extra="allow", validate_assignment=False, ser_json_inf_nan="constants")


class MachineInfo(_Model):
    """The host the sweep ran on (`harness.run.machine.machine_info`)."""

    hostname: str | None = None
    system: str | None = None
    kernel: str | None = None
    machine: str | None = None
    cpu_model: str | None = None
    cpu_signature: str | None = None        # "<vendor_id> family F model M stepping S" (/proc/cpuinfo)
    cpu_vector_flags: list[str] | None = None   # SSE4/AVX/AVX-512/FMA/F16C/AMX flags, sorted
    cpu_count_logical: int | None = None
    cpu_count_physical: int | None = None
    cpu_freq_mhz: float | None = None
    memory_total_bytes: int | None = None
    load_average: list[float] | None = None
    python_version: str | None = None
    python_implementation: str | None = None
    torch_version: str | None = None
    numpy_version: str | None = None
    rmem_max_bytes: int | None = None
    wmem_max_bytes: int | None = None


class CommitInfo(_Model):
    """The git commit the harness ran from (`harness.run.machine.commit_info`); ``dirty``: uncommitted changes."""

    id: str | None = None
    branch: str | None = None
    time: str | None = None
    dirty: bool | None = None


class BackendInfo(_Model):
    """What the backend said about itself (``Backend.describe()``): docker (engine and Compose versions,
    image) or local (python, host)."""

    name: str = "?"
    engine_version: str | None = None
    api_version: str | None = None
    compose: str | None = None
    compose_version: str | None = None
    image: str | None = None


class Reference(_Model):
    """A spec's ``reference:`` block: figures from elsewhere (the seeds' studies) to set next to ours.
    ``values``: {point value: figure, or {field: figure}}; its units are the spec's, named in `metric`."""

    source: str | None = None
    metric: str | None = None
    values: Any = None


class SpecInfo(_Model):
    """The sweep spec as run (`harness.spec.points.SweepSpec.to_dict`); the parts the report reads."""

    name: str | None = None
    description: str = ""
    repeats: int | None = None
    base: dict[str, Any] = Field(default_factory=dict)
    axes: dict[str, list[Any]] = Field(default_factory=dict)
    reference: Reference = Field(default_factory=Reference)
    timeout_s: float | None = None
    source: str | None = None


class Stats(ValueSummary):
    """Statistics of one figure over a point's ok repeats, from the raw values (`wiiide.metrics.summarize`):
    count, mean, sample stdev (0 for one value), median, min, max, p95 (nearest rank); units: the figure's.
    The fields are the node's own summaries' (`wiiide.metrics_model.ValueSummary`)."""

    @property
    def unstable(self) -> bool:
        """More than one value and a coefficient of variation (stdev / |mean|) above `UNSTABLE_CV`."""
        return bool(self.count > 1 and self.mean and (self.stdev or 0.0) / abs(self.mean) > UNSTABLE_CV)


class Totals(_Model):
    """The figures of one repeat that people compare (built by `harness.results.totals.repeat_totals`).

    None: not measured in this run (a failed repeat, the local backend's container counters, an
    unshaped link...). The parameter server's figures are the coordinator's (tensor bytes through it,
    both directions); the Training Summary and communication figures are the engines' common ground
    (docs/engines.md, "DDP and FSDP").
    """

    steps: int | None = None
    batches: int | None = None
    train_time_s: float | None = None
    batches_per_s: float | None = None
    samples_per_s: float | None = None
    goodput_bytes_per_s: float | None = None
    wire_bytes_per_s: float | None = None
    test_accuracy: float | None = None
    loss_final: float | None = None
    loss_avg: float | None = None
    step_time_median_s: float | None = None
    worker_network_time_s: float | None = None
    compression_ratio: float | None = None
    compression_time_s: float | None = None
    peak_rss_bytes: int | None = None
    batches_per_worker: dict[str, int] | None = None
    worker_batches_sum: int | None = None
    # workers at their own pace (wiiide.server.pace.record): per-worker samples, the staleness k (server versions
    # between read and apply) of every applied update, the clock gap fastest - slowest (pushes), and
    # every worker's batch size over time as change points [[t_s, samples], ...]
    samples_per_worker: dict[str, int] | None = None
    pushes_per_worker: dict[str, int] | None = None
    staleness_histogram: dict[str, int] | None = None
    staleness_max: int | None = None
    staleness_mean: float | None = None
    clock_gap_max: int | None = None
    clock_gap_mean: float | None = None
    batch_sizes_per_worker: dict[str, list[list[float]]] | None = None
    container_net_rx_bytes: int | None = None
    container_net_tx_bytes: int | None = None
    container_net_bytes: int | None = None
    # the guide's Training Summary and the communication profile, for every engine
    engine: str | None = None
    world_size: int | None = None
    timed_steps: int | None = None
    throughput_samples_per_s: float | None = None
    throughput_tokens_per_s: float | None = None  # language model: samples/s x context bytes
    validation_loss: float | None = None  # language model: held-out next-byte cross-entropy, nats
    perplexity: float | None = None  # language model: exp(validation_loss)
    rss_peak_max_bytes: int | None = None  # the largest peak RSS of one node (per rank: FSDP vs DDP)
    tensor_bytes_max: int | None = None  # the largest node's tensor memory (wiiide.tensor_memory), bytes
    activation_bytes_max: int | None = None  # ... and the largest node's activations of one forward
    step_time_avg_s: float | None = None
    step_time_min_s: float | None = None
    step_time_max_s: float | None = None
    rss_avg_bytes: float | None = None
    rss_peak_sum_bytes: int | None = None
    comm_expected_bytes_per_step: float | None = None
    comm_bottleneck_expected_bytes_per_step: float | None = None
    comm_measured_bytes_per_step: float | None = None
    comm_bottleneck_measured_bytes_per_step: float | None = None
    comm_measured_over_expected: float | None = None
    comm_share: float | None = None
    # the links stage: the rate in force on the coordinator's egress, and the share of it used
    link_rate_bps: float | None = None
    coordinator_egress_utilisation: float | None = None
    # held-out evaluation during training (wiiide.training.evaluation): the wall time from the start of training
    # to the first evaluation that reached the target; None when not reached (target_reached False)
    # or not asked (target_reached None)
    time_to_target_s: float | None = None
    target_reached: bool | None = None
    held_out_metric: str | None = None
    held_out_target: float | None = None
    # checkpoints and recovery (wiiide.server.recovery): set when the coordinator was restarted from a checkpoint;
    # steps_lost = steps the killed coordinator had reached - restored_step; recovery_s: its last step to
    # the first step after the restart (wall clock)
    restored_step: int | None = None
    steps_lost: int | None = None
    recovery_s: float | None = None
    checkpoints_written: int | None = None

    def figure(self, key: str) -> Any:
        """The figure named `key` (a field or an unknown key kept from the file), None when absent."""
        return getattr(self, key, None) if key in type(self).model_fields else (self.model_extra or {}).get(key)


class Sample(_Model):
    """One stats sample of a container (or process): seconds since the run started, CPU % of one core,
    memory without page cache, and the network and block I/O counters since it started
    (`harness.run.stats`; None where the backend cannot measure it)."""

    t_s: float | None = None
    cpu_percent: float | None = None
    memory_bytes: int | None = None
    net_rx_bytes: int | None = None
    net_tx_bytes: int | None = None
    blk_read_bytes: int | None = None
    blk_write_bytes: int | None = None


class Container(_Model):
    """A container (docker backend) or process (local backend) of a run: its role, exit code, the
    samples taken during the run and their summary (``net_rx_bytes``, ``net_tx_bytes``, ...)."""

    role: str | None = None
    kind: str | None = None  # "container" | "process"
    exit_code: int | None = None
    samples: list[Sample] = Field(default_factory=list)
    summary: dict[str, Any] = Field(default_factory=dict)
    started_at_utc: str | None = None  # the engine's StartedAt / FinishedAt (docker backend)
    finished_at_utc: str | None = None


class HeldOutPoint(_Model):
    """One held-out evaluation during training (`wiiide.training.evaluation.Evaluation`): ``t_s`` seconds since
    training started when the parameters were copied, the step and training samples then, the metric's
    ``value`` (its unit: the metric's), ``eval_s`` seconds the evaluation took, ``final``: the
    evaluation of the final parameters."""

    t_s: float
    step: int
    samples: int
    value: float
    eval_s: float = 0.0
    final: bool = False


class HeldOut(_Model):
    """The held-out metric over one repeat, from the coordinator's (rank 0's) ``held_out`` record:
    the metric (``accuracy``: higher is better; a loss: lower is), the target and whether and when it
    was first reached (``time_to_target_s``: None = not reached), and the curve in time order."""

    metric: str | None = None
    higher_is_better: bool | None = None
    target: float | None = None
    target_reached: bool | None = None
    time_to_target_s: float | None = None
    step_at_target: int | None = None
    samples_at_target: int | None = None
    eval_every_s: float | None = None
    evaluations: int = 0
    skipped_busy: int = 0
    error: str | None = None
    stopped_at_target: bool = False  # training ended at the target (stop_at_target), not at duration_s
    curve: list[HeldOutPoint] = Field(default_factory=list)


class Repeat(_Model):
    """One run of a point. ``status``: ``ok`` or ``failed`` (then ``error`` says why)."""

    repeat: int
    status: str
    error: str | None = None
    started_at_utc: str | None = None
    elapsed_s: float | None = None
    # the harness's phases of the run, seconds (harness.run.loop: clean, plan, create, shape, gate, run,
    # stop, collect, teardown); empty in reports written before they were recorded
    phases_s: dict[str, float] = Field(default_factory=dict)
    totals: Totals = Field(default_factory=Totals)
    # each node's own metrics file by node name, kept as written (its schema: wiiide.metrics_model.NodeMetricsFile)
    nodes: Annotated[dict[str, dict[str, Any]], WithJsonSchema(
        {"type": "object", "additionalProperties": {"$ref": NODE_METRICS_SCHEMA_ID}})] = Field(default_factory=dict)
    containers: dict[str, Container] = Field(default_factory=dict)
    links: dict[str, Any] = Field(default_factory=dict)  # capabilities, per container: requested, applied...
    limits: dict[str, Any] = Field(default_factory=dict)  # per container: cpus, mem_limit_bytes
    faults: list[dict[str, Any]] = Field(default_factory=list)
    exit_codes: dict[str, int | None] = Field(default_factory=dict)
    logs_dir: str | None = None  # relative to the report's folder
    held_out: HeldOut | None = None  # None: no evaluation during training (eval_every_s 0, or older reports)
    # the cores the machine's scheduler left idle while threads waited, over the coordinator's timed steps
    # (harness.analysis.sched_trace: window_s, cpus, idle_s, idle_while_waiting_s, lost_cores ...; or an
    # ``error``); None: not traced (``sweep --sched-trace``)
    sched: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        """The run finished and its figures count."""
        return self.status == "ok"


class Point(_Model):
    """One point of the grid: its swept ``params``, the full run ``config``, the ``cluster`` settings
    asked (links, cpus, mem_limit; None when none), its repeats and their statistics.
    ``status``: ``running``, ``ok`` (every repeat ok), ``partial`` (some) or ``failed`` (none)."""

    index: int
    params: dict[str, Any] = Field(default_factory=dict)
    config: dict[str, Any] = Field(default_factory=dict)
    cluster: dict[str, Any] | None = None
    status: str
    error: str | None = None
    repeats: list[Repeat] = Field(default_factory=list)
    summary: dict[str, Stats] = Field(default_factory=dict)
    unstable: list[str] = Field(default_factory=list)

    @property
    def ok_repeats(self) -> list[Repeat]:
        """The repeats whose figures count."""
        return [r for r in self.repeats if r.ok]

    def values(self, key: str) -> list[float]:
        """The raw values of a `Totals` figure over the ok repeats (those that carry it), in repeat order."""
        return [v for v in (r.totals.figure(key) for r in self.ok_repeats) if v is not None]


class Report(_Model):
    """A sweep's report: metadata first, then every point with its raw repeats and their statistics.
    ``complete``: the sweep finished (False while running or after an interruption, with ``note``)."""

    schema_version: int
    name: str
    created_at_utc: str | None = None
    updated_at_utc: str | None = None
    complete: bool = False
    note: str | None = None
    resumed_at_utc: list[str] = Field(default_factory=list)
    # the commit each resume ran (one per resumed_at_utc entry; reports from before 2026-11-24, commit b2afacf, have none)
    resumed_commit_info: list[CommitInfo] = Field(default_factory=list)
    machine_info: MachineInfo = Field(default_factory=MachineInfo)
    commit_info: CommitInfo = Field(default_factory=CommitInfo)
    backend: BackendInfo = Field(default_factory=BackendInfo)
    spec: SpecInfo = Field(default_factory=SpecInfo)
    param_names: list[str] = Field(default_factory=list)
    host_sysctls: dict[str, Any] | None = None
    points: list[Point] = Field(default_factory=list)

    @property
    def axes(self) -> list[str]:
        """The swept parameters' names: ``param_names``, else every key of the points' params, sorted."""
        return list(self.param_names or sorted({k for p in self.points for k in p.params}))

    def to_json_dict(self) -> dict[str, Any]:
        """The report as the JSON object written to report.json (every field, unknown keys kept)."""
        return self.model_dump(mode="json")
