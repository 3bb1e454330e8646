"""The schema of a node's metrics file (`wiiide.metrics.NodeMetrics.to_dict`) as a pydantic v2 model,
`NodeMetricsFile`, so tools that read the files (the harness's report, notebooks) read typed fields.

The model describes what every node writes (the counters of `wiiide.metrics`, the Training Summary
of `wiiide.summary`) and the fields the roles add (the coordinator's held-out figures and data set,
the engines' ``engine``/``world_size``/``comm``, the parameter server's ``ps``, workers at their own
pace, checkpoints and recovery). Every field is optional and unknown keys are kept
(``extra="allow"``): a file from another engine or an older node loads unchanged. Records whose
layout belongs to one subsystem (``ps``, ``comm``, ``held_out``, ``recovery`` ...) stay objects;
their fields are documented where they are written.

Units are in the names: ``_s`` seconds, ``_bytes`` bytes, ``_bps`` bits per second; ``rank`` is the
node's rank (0: the coordinator or rank 0 of an engine). The field meanings and sources are in
`wiiide.metrics`'s module docstring. It needs pydantic (the node image has it) and `wiiide.metrics`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from wiiide.metrics import SCHEMA_VERSION


class _Record(BaseModel):
    """Base of the node metrics models: unknown keys kept, NaN and infinities written as JSON constants."""

    model_config = ConfigDict(extra="allow", ser_json_inf_nan="constants")


class ValueSummary(_Record):
    """`wiiide.metrics.summarize` of raw values: count, mean, sample stdev (0 for one value), median,
    min, max, p95 (nearest rank); None when there were no values. Units: the summarized figure's."""

    count: int = 0
    mean: float | None = None
    stdev: float | None = None
    median: float | None = None
    min: float | None = None
    max: float | None = None
    p95: float | None = None


class TrainingSummary(_Record):
    """The Training Summary of the DDP/FSDP benchmarking guide for one node (`wiiide.summary.training_summary`):
    timings over the steps after warm-up (s), throughput in samples/s (``batch x world size / mean step
    time``), losses, resident set size in bytes."""

    num_steps: int | None = None
    warmup_steps: int | None = None
    total_steps: int | None = None
    avg_step_time_s: float | None = None
    min_step_time_s: float | None = None
    max_step_time_s: float | None = None
    median_step_time_s: float | None = None
    stdev_step_time_s: float | None = None
    samples_per_step: float | None = None
    throughput_samples_per_s: float | None = None
    tokens_per_sample: int | None = None
    throughput_tokens_per_s: float | None = None
    avg_loss: float | None = None
    final_loss: float | None = None
    peak_rss_bytes: int | None = None
    avg_rss_bytes: float | None = None


class TensorMemory(_Record):
    """The bytes a node's training tensors take (`wiiide.tensor_memory.tensor_memory`): parameters (FSDP:
    this rank's shards), gradients, optimizer state (a wiiide worker: 0, the server holds it), the
    activations one forward and loss leave alive for the backward (None: not measured), their sum."""

    parameter_bytes: int | None = None
    gradient_bytes: int | None = None
    optimizer_state_bytes: int | None = None
    activation_bytes: int | None = None
    total_bytes: int | None = None
    method: str | None = None


class NodeMetricsFile(_Record):
    """One node's metrics file (``<metrics_dir>/coordinator.json``, ``worker-<rank>.json``), as the
    harness keeps it under a report's ``points[].repeats[].nodes[<name>]``.

    ``status`` is ``ok``, ``failed`` ... with ``error`` its one line; byte counters are totals over the
    run (``payload``: tensor bytes before encoding, ``encoded``: after, ``wire``: whole frames,
    ``iface``: the node's network interfaces); ``goodput_bps`` is 8 x payload bytes sent and received
    per second of ``train_time_s`` (else of ``wall_time_s``).
    """

    schema_version: int = SCHEMA_VERSION
    role: str | None = None  # coordinator | worker
    node_id: str | None = None
    rank: int | None = None
    hostname: str | None = None
    pid: int | None = None
    status: str | None = None
    error: str | None = None
    started_at_utc: str | None = None
    ended_at_utc: str | None = None
    wall_time_s: float | None = None
    steps: int | None = None
    batches: int | None = None
    samples: int | None = None
    train_time_s: float | None = None
    batches_per_s: float | None = None
    frames_sent: int | None = None
    frames_received: int | None = None
    payload_bytes_sent: int | None = None
    payload_bytes_received: int | None = None
    encoded_bytes_sent: int | None = None
    encoded_bytes_received: int | None = None
    wire_bytes_sent: int | None = None
    wire_bytes_received: int | None = None
    goodput_bps: float | None = None
    iface_bytes_sent: int | None = None
    iface_bytes_recv: int | None = None
    network_time_s: float | None = None
    send_time_s: float | None = None
    recv_time_s: float | None = None
    compute_time_s: float | None = None
    compute_cpu_s: float | None = None
    compression_time_s: float | None = None
    decompression_time_s: float | None = None
    compression_ratio: float | None = None  # payload bytes sent / encoded bytes sent
    codec_counts: dict[str, int] | None = None  # frames sent, by codec
    codec_bytes_sent: dict[str, dict[str, int]] | None = None  # codec -> raw_bytes, payload_bytes
    peak_rss_bytes: int | None = None
    socket_options: list[dict[str, Any]] | None = None  # per connection: requested and granted buffers, flags
    step_time_s: ValueSummary | None = None  # wall seconds of every step
    cpu_time_s: float | None = None  # the process's CPU seconds, all threads
    step_cpu_s: ValueSummary | None = None  # the process's CPU seconds of each timed step
    host_cpu_s: dict[str, Any] | None = None  # the machine's CPU seconds by kind over the timed steps
    run_delay_s: dict[str, Any] | None = None  # run-queue delay per step (per_step_s, steps, threads)
    compute_max_s: ValueSummary | None = None  # sharded coordinator: slowest worker's compute per step
    compute_median_s: ValueSummary | None = None  # ... and the median worker's
    stage_cpu_s: dict[str, ValueSummary] | None = None  # sharded nodes: CPU s per step in each stage
    loss_first: float | None = None  # the first step's (or update's) training loss, nats: where the run started
    loss_avg: float | None = None
    loss_final: float | None = None
    training_summary: TrainingSummary | None = None
    tensor_memory: TensorMemory | None = None  # workers and ddp/fsdp ranks: tensor bytes beside the RSS
    mixed_precision: str | None = None  # none | bf16 | fp16: CPU autocast of forward and loss
    activation_checkpointing: bool | None = None  # transformer: blocks recomputed in the backward
    events: list[dict[str, Any]] | None = None  # the first events of each kind: t_s, event, fields
    event_counts: dict[str, int] | None = None
    events_dropped: dict[str, dict[str, int]] | None = None  # kind -> reason -> events only counted
    trace: dict[str, Any] | None = None  # trace_steps > 0: the steps' spans (wiiide.trace.StepTrace.to_dict)
    # what the roles add (NodeMetrics.extra)
    engine: str | None = None  # ddp | fsdp (the engines); absent: the parameter server
    world_size: int | None = None
    num_workers: int | None = None
    dataset: str | None = None
    model: str | None = None
    task: str | None = None  # classification | language-model
    compression: str | None = None
    log_tier: str | None = None
    sparse_embedding: bool | None = None
    parameter_tensors: int | None = None  # how many tensors the gradient is made of
    params_digest: dict[str, Any] | None = None  # a digest of the final parameters (equal across replicas)
    train_samples: int | None = None
    test_samples: int | None = None
    num_parameters: int | None = None
    gradient_bytes: int | None = None  # float32 bytes of one full gradient
    tokens_per_sample: int | None = None
    epochs: float | None = None  # passes over the training set
    test_accuracy: float | None = None  # in [0, 1], the final parameters on the held-out set
    test_loss: float | None = None  # nats
    validation_loss: float | None = None  # language model: held-out next-byte cross-entropy, nats
    perplexity: float | None = None
    time_to_target_s: float | None = None  # None: the target was not reached (or not asked)
    held_out: dict[str, Any] | None = None  # wiiide.training.evaluation.BackgroundEvaluator.to_dict: the curve
    batches_per_worker: dict[str, int] | None = None  # rank -> batches
    workers_connected: int | None = None
    comm: dict[str, Any] | None = None  # engines: expected and measured communication per step
    ps: dict[str, Any] | None = None  # parameter server shards: plan, policy, per-shard stats
    pace: dict[str, Any] | None = None  # workers at their own pace: staleness bound, local steps, pulls
    checkpoints: dict[str, Any] | None = None
    recovery: dict[str, Any] | None = None
    compression_policy: dict[str, Any] | None = None
    data_info: dict[str, Any] | None = None
    staleness_histogram: dict[str, int] | None = None
    staleness_max: int | None = None
    staleness_mean: float | None = None
    clock_gap_max: int | None = None
    clock_gap_mean: float | None = None
    pushes_per_worker: dict[str, int] | None = None
    samples_per_worker: dict[str, int] | None = None
    batch_sizes_per_worker: dict[str, list[list[float]]] | None = None  # rank -> [[t_s, samples], ...]
    lr_schedule: dict[str, Any] | None = None  # wiiide.lr_schedule: kind, base_lr, warmup/decay steps, min_ratio
    lr_per_step: list[float] | None = None  # the learning rate of every step this node's optimizer took
    lr_applied_by: str | None = None  # pace server: "server", or "worker inner steps" (local SGD)


def node_metrics_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12, pydantic's, serialization mode) of `NodeMetricsFile` as a dict;
    unknown keys are allowed everywhere (``additionalProperties``), as the model keeps them."""
    return NodeMetricsFile.model_json_schema(mode="serialization")
