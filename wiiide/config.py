"""Run configuration of a WIIIIIDE node (coordinator or worker).

One flat, immutable pydantic-settings model, `RunConfig`, holds every knob of the seeds' studies
(socket buffer sizes and options, compression, logging tier) and of the run (model, data, duration).
It is built from keyword arguments, from a dict (`RunConfig.from_dict`, used by the harness with sweep
points) or from ``WIIIIIDE_<FIELD>`` environment variables (`RunConfig.from_env`, used inside
containers), and validated when built: a bad value raises `ConfigError` naming the field, the value
and what is allowed, before any socket is opened.

Values may be strings (as the environment and YAML give them): booleans are ``1/0``, ``true/false``,
``yes/no`` or ``on/off``; ``*_bytes`` fields are sizes read by `wiiide.units.parse_size_bytes`
(``"256k"`` = 262,144, ``"8MiB"``; IEC: k = 1,024); ``link_bandwidth_bps`` takes a bare number of
bit/s or a rate read by `wiiide.units.parse_rate_bps` (``"100mbit"``; SI: k = 1,000);
``hidden_sizes`` takes ``"64,32"``, ``"64 32"`` or a list (parsers and types: `wiiide.config_types`).
`RunConfig.json_schema` gives the JSON Schema of the fields, their defaults, bounds, (under ``allowed``)
what each accepts, (under ``group``) the subsystem of `CONFIG_GROUPS` it belongs to and (under ``unit``)
its unit where it has one. A field is declared with `_field` after the `_section` of its group (`wiiide.config_types`).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import model_validator
from pydantic_settings import SettingsConfigDict

from wiiide.config_base import FrozenSettings

from wiiide.config_rules import _check, _validate_engine, _validate_lr_schedule
from wiiide.config_types import (
    CONFIG_GROUPS,
    MAX_STALENESS_BOUND,
    Bool,
    BufferBytes,
    Float,
    Int,
    LayerWidths,
    PiecesPerShard,
    PolicyName,
    PsShards,
    RateBps,
    SizeBytes,
    StalenessBound,
    Str,
    TcpCongestion,
    _add_units,
    _field,
    _section,
)
from wiiide.errors import ConfigError
from wiiide.lr_schedule import LR_SCHEDULES
from wiiide.units import MIB as _MIB

ENV_PREFIX = "WIIIIIDE_"
MIB = 1024 * 1024
MAX_TIMEOUT_S = 86400.0

DATASETS = ("digits", "synthetic")
LOG_TIERS = ("verbose", "normal", "silent")
ENGINES = ("wiiide", "ddp", "fsdp")
MODELS = ("mlp", "cnn", "transformer", "embedding")
DDP_COMM_HOOKS = ("none", "fp16", "powersgd", "post_local_sgd")
STALENESS_SCALINGS = ("none", "inverse")
OUTER_OPTIMIZERS = ("avg", "nesterov")
MIXED_PRECISIONS = ("none", "bf16", "fp16")
ZLIB_LEVELS = tuple(range(1, 10))
COMPRESSION_CHOICES = ("none", "adaptive") + tuple(f"zlib-{level}" for level in ZLIB_LEVELS)


_TIMEOUT = f"0 < x <= {MAX_TIMEOUT_S:g} seconds"  # finite and at most a day: socket.settimeout overflows on inf


class RunConfig(FrozenSettings):
    """Every knob of one WIIIIIDE run. Units are in the field names; immutable once built.

    Defaults follow the seeds' "current implementation": 8 MiB socket buffers, TCP_NODELAY and
    TCP_QUICKACK on, receive calls of up to 64 MiB, 30 s runs, `normal` logging.

    ``RunConfig(**fields)`` takes only its arguments (the environment is read by `from_env` alone, so
    the harness never builds a node's config from its own ``WIIIIIDE_*`` shell variables).

    Raises:
        ConfigError: an unknown field, a value of the wrong type or out of range, or an option the
            chosen engine cannot apply; the message names the field, the value and what is allowed.
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, case_sensitive=False, extra="forbid", frozen=True,
                                      validate_default=True)
    # Variables with the prefix that are not fields but are used by the project's shell.
    env_ignored: ClassVar[frozenset[str]] = frozenset({"require_docker", "secret", "secret_file", "image", "results_dir",
                                                       "workers", "project"})

    # --- topology -------------------------------------------------------------------------------
    _section("topology")
    coordinator_host: Str = _field("127.0.0.1", "a host name or address", "where workers connect")
    bind_host: Str = _field("127.0.0.1", "a host name or address",
                            "where the coordinator listens (0.0.0.0 in containers)")
    port: Int = _field(29500, "1..65535", "TCP port of the coordinator", ge=1, le=65535)
    num_workers: Int = _field(2, "1..256", "workers in the run", ge=1, le=256)
    node_id: Str = _field("", "any string", "empty: the hostname (workers get their rank from the coordinator)")

    # --- data and model -------------------------------------------------------------------------
    _section("data-model")
    dataset: Literal["digits", "synthetic"] = _field("digits", " | ".join(DATASETS), "training data")
    synthetic_samples: Int = _field(4096, ">= 20", "synthetic dataset: samples", unit="samples", ge=20)
    synthetic_features: Int = _field(256, "1..1000000", "synthetic dataset: features per sample",
                                     ge=1, le=1_000_000)
    synthetic_classes: Int = _field(10, "2..100000", "synthetic dataset: classes", ge=2, le=100_000)
    test_fraction: Float = _field(0.2, "0 < x < 1", "share of samples held out for evaluation", gt=0.0, lt=1.0)
    hidden_sizes: LayerWidths = _field((64,), "1..16 layer widths, each 1..65536", "MLP hidden layer widths",
                                       min_length=1, max_length=16)
    model: Literal["mlp", "cnn", "transformer", "embedding"] = _field(
        "mlp", " | ".join(MODELS), "mlp | cnn (digits as 1x8x8) | transformer (byte LM on the Python standard "
        "library's source; ignores dataset) | embedding (Zipf ids into a big table; ignores dataset)")
    cnn_channels: Int = _field(16, "1..512", "cnn: channels of the first convolutions (the last has twice)",
                               ge=1, le=512)
    transformer_layers: Int = _field(2, "1..48", "transformer: blocks", ge=1, le=48)
    transformer_width: Int = _field(128, "8..4096, a multiple of transformer_heads", "transformer: model width",
                                    ge=8, le=4096)
    transformer_heads: Int = _field(4, "1..64", "transformer: attention heads", ge=1, le=64)
    transformer_context: Int = _field(128, "8..8192", "transformer: bytes per sequence (window)", unit="bytes",
                                      ge=8, le=8192)
    activation_checkpointing: Bool = _field(False, "a boolean (true needs model transformer)",
                                            "transformer, every engine: recompute each block in the backward "
                                            "(torch.utils.checkpoint, non-reentrant) instead of keeping its insides")
    embedding_rows: Int = _field(100_000, "2..100000000", "embedding: rows of the table", ge=2, le=100_000_000)
    embedding_dim: Int = _field(16, "1..1024", "embedding: floats per row", ge=1, le=1024)
    embedding_fields: Int = _field(8, "1..256", "embedding: ids (lookups) per sample", ge=1, le=256)
    embedding_zipf_exponent: Float = _field(1.1, "0 <= x <= 5", "embedding: ids drawn with P(k) ~ 1/(k+1)^x",
                                            ge=0.0, le=5.0)
    embedding_samples: Int = _field(65536, ">= 20", "embedding: synthetic samples (train + test)", unit="samples", ge=20,
                                    le=100_000_000)
    sparse_embedding: Bool = _field(False, "a boolean",
                                    "embedding: wiiide sends only touched rows (codec rows) and pulls only "
                                    "changed rows; ddp uses nn.Embedding(sparse=True); fsdp cannot")
    batch_size: Int = _field(32, "1..65536", "samples per worker per step", unit="samples", ge=1, le=65536)
    learning_rate: Float = _field(0.1, "0 < x <= 100", "SGD learning rate", gt=0.0, le=100.0)
    lr_schedule: Literal["constant", "linear", "cosine"] = _field(
        "constant", " | ".join(LR_SCHEDULES), "learning rate per optimizer step, applied where the optimizer lives "
        "(the central server, every shard, the pace server, every ddp/fsdp rank): constant | linear | cosine decay "
        "after lr_warmup_steps (wiiide.lr_schedule)")
    lr_warmup_steps: Int = _field(0, "0..10000000", "linear warm-up of the learning rate from 0 over this many "
                                  "optimizer steps (not warmup_steps, the timings' warm-up)", ge=0, le=10_000_000)
    lr_decay_steps: Int = _field(0, "0..100000000 (0: max_steps - lr_warmup_steps)",
                                 "lr_schedule linear/cosine: steps of decay after the warm-up; then the rate stays "
                                 "at lr_min_ratio x learning_rate", ge=0, le=100_000_000)
    lr_min_ratio: Float = _field(0.0, "0 <= x <= 1", "lr_schedule linear/cosine: the rate at the end of the decay, "
                                 "as a fraction of learning_rate", ge=0.0, le=1.0)
    momentum: Float = _field(0.0, "0 <= x < 1", "SGD momentum", ge=0.0, lt=1.0)
    seed: Int = _field(0, "any integer", "seed of the model's initial weights and of the data")
    torch_threads: Int = _field(1, "0 (torch default) .. 256",
                                "intra-op threads per node (0: torch's default, one per core)", ge=0, le=256)

    # --- run length -----------------------------------------------------------------------------
    _section("run-length")
    duration_s: Float = _field(30.0, _TIMEOUT, "training time, seconds", gt=0.0, le=MAX_TIMEOUT_S)
    max_steps: Int = _field(0, ">= 0 (0: no limit)", "0: no step limit, stop on duration_s only", ge=0)
    warmup_steps: Int = _field(10, "0..100000", "first steps left out of the Training Summary's step timings",
                               ge=0, le=100_000)

    # --- held-out evaluation during training: time to target (wiiide.training.evaluation) ---------------
    _section("evaluation")
    eval_every_s: Float = _field(0.0, f"0 (off) or 0 < x <= {MAX_TIMEOUT_S:g} seconds",
                                 "evaluate a snapshot of the parameters on the held-out split this often, on a "
                                 "background thread of the coordinator (rank 0), without pausing training",
                                 ge=0.0, le=MAX_TIMEOUT_S)
    target_accuracy: Float = _field(0.0, "0 (no target) or 0 < x <= 1",
                                    "classification: time to target is the wall time until held-out accuracy "
                                    "first reaches this (needs eval_every_s)", ge=0.0, le=1.0)
    target_loss: Float = _field(0.0, "0 (no target) or > 0 nats",
                                "language model: time to target is the wall time until the validation loss "
                                "first falls to this (needs eval_every_s)", unit="nats", ge=0.0)
    stop_at_target: Bool = _field(False, "true | false (true needs target_accuracy or target_loss)",
                                  "end training at the first held-out evaluation that reaches the target "
                                  "(time-to-target runs then need not run out duration_s)")

    # --- engine: which training system runs on the same containers (wiiide/engines/) ----------
    _section("engine")
    engine: Literal["wiiide", "ddp", "fsdp"] = _field(
        "wiiide", " | ".join(ENGINES), "wiiide (the parameter server) | ddp | fsdp (PyTorch over gloo)")
    ddp_comm_hook: Literal["none", "fp16", "powersgd", "post_local_sgd"] = _field(
        "none", " | ".join(DDP_COMM_HOOKS), "ddp: none | fp16 | powersgd | post_local_sgd (local SGD, parameters "
        "averaged every local_steps steps: PostLocalSGDOptimizer)")
    ddp_find_unused_parameters: Bool = _field(
        False, "a boolean", "ddp: find_unused_parameters (DDP walks the autograd graph after every forward to mark "
        "parameters without a gradient; the guide's tip: off unless the model leaves some unused)")
    powersgd_rank: Int = _field(1, "1..64", "ddp with powersgd: matrix approximation rank", ge=1, le=64)
    fsdp_reshard_after_forward: Bool = _field(True, "a boolean",
                                              "fsdp: True is FULL_SHARD, False SHARD_GRAD_OP-like")
    grad_accum_steps: Int = _field(1, "1..64", "micro-batches per optimizer step (ddp/fsdp: one gradient sync "
                                   "per step; wiiide: per push)", ge=1, le=64)
    mixed_precision: Literal["none", "bf16", "fp16"] = _field(
        "none", " | ".join(MIXED_PRECISIONS), "every engine: CPU autocast of forward and loss (wiiide: on the "
        "workers; parameters, gradients and the wire stay float32; fsdp: half-precision parameters instead)")
    profile: Bool = _field(False, "a boolean",
                           "ddp/fsdp: torch.profiler traces into the run's folder (metrics_dir's parent)")

    # --- workers at their own pace (wiiide.server.pace) ------------------------------------------------
    _section("pace")
    staleness_bound: StalenessBound = _field(
        0, "0 (synchronous rounds) | an integer s in 1..1000000 (stale synchronous parallel) | async (no bound)",
        "wiiide: a worker may run at most this many pushes ahead of the slowest live worker (Ho et al. 2013)")
    staleness_scaling: Literal["none", "inverse"] = _field(
        "none", " | ".join(STALENESS_SCALINGS),
        "wiiide, staleness_bound != 0: none (stale updates as they are, as SSP) | inverse (x 1/(k+1) for an "
        "update k versions old, Zhang et al. 2016)")
    ssp_cache: Bool = _field(False, "a boolean", "wiiide, staleness_bound s >= 1, local_steps 1: send a worker the "
                             "parameters only when its copy lacks pushes the bound requires it to see (Ho et al. "
                             "2013's SSP cache); off: fresh parameters with every task")
    local_steps: Int = _field(1, "1..1024", "wiiide: local SGD steps per push (H > 1: workers push model deltas); "
                              "ddp with ddp_comm_hook post_local_sgd: the averaging period", ge=1, le=1024)
    outer_optimizer: Literal["avg", "nesterov"] = _field(
        "avg", " | ".join(OUTER_OPTIMIZERS), "wiiide, local_steps > 1: the server's step over the deltas: avg "
        "(model averaging) | nesterov (DiLoCo's outer Nesterov momentum)")
    outer_learning_rate: Float = _field(0.7, "0 < x <= 10", "outer_optimizer nesterov: learning rate (DiLoCo: 0.7)",
                                        gt=0.0, le=10.0)
    outer_momentum: Float = _field(0.9, "0 <= x < 1", "outer_optimizer nesterov: momentum (DiLoCo: 0.9)",
                                   ge=0.0, lt=1.0)
    adaptive_batch: Bool = _field(False, "a boolean", "wiiide: per-worker batch sizes follow measured samples/s, "
                                  "the global batch (num_workers x batch_size) constant")
    adaptive_smoothing: Float = _field(0.1, "0 < x <= 1", "adaptive_batch: weight of a new task in the moving "
                                       "averages of samples and seconds (rate: their ratio)", gt=0.0, le=1.0)
    adaptive_clock_gain: Float = _field(0.5, "0..4", "adaptive_batch under a staleness bound: fraction of a "
                                        "batch a worker gains per clock ahead of the mean (loses per clock "
                                        "behind); 0: rates only", ge=0.0, le=4.0)
    debug_step_sleep_s: Float = _field(0.0, "0..60 seconds", "wiiide worker: sleep this long after every local "
                                       "step (tests' straggler)", ge=0.0, le=60.0)
    debug_sleep_worker_rank: Int = _field(0, "0 (every worker) or a worker rank 1..256",
                                          "debug_step_sleep_s applies to this worker rank only", ge=0, le=256)
    # --- sharded parameter server (wiiide/server/ps/) -------------------------------------------------
    _section("ps")
    # all, not seed 001's central server: the faster placement on every shaped link measured (CHANGELOG.md)
    ps_shards: PsShards = _field("all", "1 | all | an integer 1..nodes (coordinator + workers)",
                                 "wiiide: server shards; all: one on every node (coordinator and each worker "
                                 "with at least half the most CPU); 1: the central server on the coordinator; k: "
                                 "the coordinator and the k-1 workers with the most CPU (wiiide.server.ps.placement)")
    partition_bytes: SizeBytes = _field(4 * _MIB, "4 bytes..1 GiB",
                                        "ps_shards > 1: largest parameter partition (BytePS's default 4 MiB); "
                                        "at least partitions_per_shard per shard", ge=4, le=1024 * _MIB)
    partitions_per_shard: PiecesPerShard = _field(
        "auto", "auto | an integer 1..256",
        "ps_shards > 1: the fewest partitions per shard while they stay about 64 KiB or more on the wire (64 KiB x "
        "the codec's ratio under a fixed lossy codec), each still at most partition_bytes: a small model in pieces "
        "a shard answers one after the other; auto: up to 8 of about piece_link_s on the probed link or more "
        "(wiiide.server.ps.link_probe)")
    piece_link_s: Float = _field(0.004, "0..1 seconds",
                                 "partitions_per_shard auto: a piece's time on the link the coordinator's probe "
                                 "measures, rate / 8 x this in bytes on the wire rounded down to a power of two, "
                                 "64 KiB..16 MiB (4 ms: 64 KiB at 100 and 200 Mbit/s, 256 KiB at 1 Gbit/s; "
                                 "wiiide.server.ps.link_probe)", ge=0.0, le=1.0)
    partition_balance: Literal["pipeline", "egress", "bytes"] = _field(
        "pipeline", "pipeline | egress | bytes",
        "ps_shards > 1: pipeline: the coordinator's range at the tail of the vector, pushed first, with shares "
        "that level every node's finish time (wiiide.server.ps.partition.pipeline_shard_weights); egress: shares that "
        "level every node's bytes sent per step, the coordinator's range first (egress_shard_weights); bytes: "
        "equal bytes per shard")
    partition_placement: Literal["contiguous", "interleaved"] = _field(
        "interleaved", "contiguous | interleaved",
        "ps_shards > 1: contiguous: one range of the vector per shard (ps-lite's key ranges); interleaved: the same "
        "pieces dealt to the shards in turns (BytePS's placement), so that pieces backward makes one after the other "
        "go to different shards (wiiide.server.ps.partition.partition_by_weights)")
    shard_port: Int = _field(0, "0 (a free port, reported at join) or 1..65535",
                             "ps_shards > 1: TCP port a node's shard listens on", ge=0, le=65535)
    push_schedule: Literal["concurrent", "ordered"] = _field(
        "ordered", "concurrent | ordered",
        "ps_shards > 1: concurrent: a sender thread per shard, every push offered to the kernel at once; ordered: "
        "one thread sends the pushes in backward's order, each once the one before has left the socket "
        "(TCP_NOTSENT_LOWAT), so every worker sends a partition at the same time (wiiide.server.ps.client)")
    batch_handout: Literal["auto", "indices", "samples"] = _field(
        "auto", "auto | indices | samples",
        "ps_shards > 1: send a worker the batch's indices (it holds the data set) or its samples; auto: "
        "indices when the worker's data set has the coordinator's fingerprint")

    # --- sockets --------------------------------------------------------------------------------
    _section("sockets")
    sndbuf_bytes: BufferBytes = _field(8 * MIB, "0 (kernel default) or 4096..1 GiB",
                                       "SO_SNDBUF requested (0: leave the kernel default)")
    rcvbuf_bytes: BufferBytes = _field(8 * MIB, "0 (kernel default) or 4096..1 GiB",
                                       "SO_RCVBUF requested (0: leave the kernel default)")
    tcp_nodelay: Bool = _field(True, "a boolean", "TCP_NODELAY on every connection")
    tcp_quickack: Bool = _field(True, "a boolean", "TCP_QUICKACK re-armed after every received frame")
    keepalive: Bool = _field(True, "a boolean", "SO_KEEPALIVE on every connection")
    tcp_congestion: TcpCongestion = _field(
        "", "'' (the system's default) or an available congestion control (cubic, bbr, reno, ...)",
        "TCP_CONGESTION on every connection (tcp(7)); '': leave net.ipv4.tcp_congestion_control's choice")
    shard_tcp_congestion: TcpCongestion = _field(
        "auto", "auto | '' (as tcp_congestion) | an available congestion control (reno, cubic, bbr, ...)",
        "ps_shards > 1: TCP_CONGESTION on the sharded servers' connections (pushes and pulls); auto: "
        "tcp_congestion if set, else reno where this process may set it (net.ipv4.tcp_allowed_congestion_control), "
        "else the system's; '': as tcp_congestion (wiiide.wire.sockets.shard_congestion)")
    # 64 MiB (wiiide.wire.format.DEFAULT_RECV_CHUNK_BYTES), not seed 001's 256 KiB: see bench-wire in docs/wire.md
    recv_chunk_bytes: SizeBytes = _field(64 * MIB, "1 KiB..256 MiB", "the most one recv_into asks for",
                                         ge=1024, le=256 * MIB)
    max_frame_bytes: SizeBytes = _field(1024 * MIB, "64 KiB..8 GiB",
                                        "largest frame (and decoded tensor bytes) accepted",
                                        ge=64 * 1024, le=8 * 1024 * MIB)

    # --- compression ----------------------------------------------------------------------------
    _section("codecs")
    compression: PolicyName = _field(
        "none", "a compression policy (see wiiide.codecs.policy.POLICY_NAME_FORMS)",
        "fixed:<codec> | none | zlib-1..9 | seed (= adaptive) | network-aware | network-aware+lossy")
    adaptive_threshold_bytes: SizeBytes = _field(1 * MIB, ">= 0",
                                                 "seed policy: gradient messages above this go at zlib-1", ge=0)
    codec_threads: Int = _field(1, "0 (the cores, at most 4) .. 64",
                                "parallel chunked compression threads (0: the cores, at most 4)", ge=0, le=64)
    codec_chunk_bytes: SizeBytes = _field(1 * MIB, "64 KiB..256 MiB", "raw bytes per parallel chunk",
                                          ge=64 * 1024, le=256 * MIB)
    link_bandwidth_bps: RateBps = _field(0, ">= 0 (0: measured online)",
                                         "network-aware: the link's rate in bit/s; 0: measured online from "
                                         "received frames", ge=0)
    allow_lossy: Bool = _field(False, "a boolean",
                               "network-aware may pick lossy codecs (fp16, bf16, int8, topk) for gradients")
    lossy_warmup_steps: Int = _field(50, ">= 0", "gradient messages sent uncompressed before any lossy codec",
                                     unit="messages", ge=0)
    topk_fraction: Float = _field(0.01, "0 < x <= 1",
                                  "network-aware's top-k candidate keeps this fraction per tensor", gt=0.0, le=1.0)
    codec_probe_every: Int = _field(20, ">= 2",
                                    "network-aware tries another codec every this many messages of a kind",
                                    unit="messages", ge=2)

    # --- logging and metrics --------------------------------------------------------------------
    _section("logging")
    log_tier: Literal["verbose", "normal", "silent"] = _field("normal", " | ".join(LOG_TIERS), "logging tier")
    log_every_steps: Int = _field(100, ">= 1", "normal tier: a progress line every this many steps", ge=1)
    metrics_dir: Str = _field("results/nodes", "a directory path", "where the node writes its metrics JSON")
    trace_steps: Int = _field(0, "0..1000", "steps after the warm-up whose sends, receives, compute and updates "
                              "each node keeps as spans for the timeline (wiiide-lab timeline; 0: none)",
                              ge=0, le=1000)
    ready_file: Str = _field("", "a file path or empty",
                             "coordinator: touched once it listens (the container healthcheck reads it)")
    start_gate_file: Str = _field("", "a file path or empty",
                                  "coordinator: once every worker joined, wait (up to connect_timeout_s) for "
                                  "this file before the first step; the harness creates it once links are "
                                  "shaped ('': start at once)")

    # --- timeouts -------------------------------------------------------------------------------
    _section("timeouts")
    connect_timeout_s: Float = _field(60.0, _TIMEOUT,
                                      "worker: retry connecting; coordinator: wait for all workers",
                                      gt=0.0, le=MAX_TIMEOUT_S)
    io_timeout_s: Float = _field(10.0, _TIMEOUT,
                                 "longest silence from a peer (no byte, no heartbeat) before it counts as lost: "
                                 "the time to detect a killed worker or coordinator, or a cut link",
                                 gt=0.0, le=MAX_TIMEOUT_S)
    heartbeat_interval_s: Float = _field(1.0, "> 0 and below io_timeout_s",
                                         "a connection idle this long gets a heartbeat frame", gt=0.0)
    stall_timeout_s: Float = _field(60.0, f"0 (off) or 0 < x <= {MAX_TIMEOUT_S:g} seconds",
                                    "harness, ddp/fsdp: the run fails when no rank wrote progress for this long "
                                    "(a stalled collective) instead of waiting out its timeout; 0: off",
                                    ge=0.0, le=MAX_TIMEOUT_S)

    # --- checkpoints and recovery (wiiide.server.checkpoint; off while both intervals are 0) ------------
    _section("recovery")
    checkpoint_every_steps: Int = _field(0, ">= 0 (0: not by steps)",
                                         "coordinator: write a checkpoint every this many steps", ge=0)
    checkpoint_every_s: Float = _field(0.0, f"0..{MAX_TIMEOUT_S:g} seconds (0: not by time)",
                                       "coordinator: write a checkpoint when this many seconds passed since the last",
                                       ge=0.0, le=MAX_TIMEOUT_S)
    checkpoint_dir: Str = _field("", "a directory path or empty",
                                 "where checkpoints go and are restored from ('': metrics_dir's parent/checkpoints)")
    checkpoint_keep: Int = _field(3, "2..100", "newest checkpoint files kept (older ones are deleted)", ge=2, le=100)
    rejoin_timeout_s: Float = _field(0.0, f"0..{MAX_TIMEOUT_S:g} seconds (0: io_timeout_s)",
                                     "worker: after losing the coordinator, retry connecting this long (a restarted "
                                     "coordinator needs its start-up time); restarted coordinator: wait this long for "
                                     "the workers to come back", ge=0.0, le=MAX_TIMEOUT_S)

    # --- who may connect (the secret itself is never a config field: see wiiide.wire.auth) ---------
    _section("security")
    handshake_timeout_s: Float = _field(5.0, "0 < x <= 300 seconds",
                                        "a peer must complete the authenticated handshake within this",
                                        gt=0.0, le=300.0)
    max_handshakes: Int = _field(8, "1..1024", "connections handshaking at once, at most half from one address; "
                                 "more wait for a slot until their deadline (wiiide.wire.admission)",
                                 ge=1, le=1024)
    # TLS 1.3 on every connection (wiiide.wire.tls): mutual authentication against a per-cluster CA, the HMAC
    # handshake inside it. The harness writes the files per cluster and sets the three paths.
    tls: Bool = _field(False, "a boolean", "TLS 1.3 with mutual certificate authentication on every connection "
                       "(engine wiiide; needs tls_ca_file, tls_cert_file, tls_key_file)")
    tls_ca_file: Str = _field("", "a PEM file path or empty", "tls: the cluster's CA certificate (PEM)")
    tls_cert_file: Str = _field("", "a PEM file path or empty",
                                "tls: this node's certificate (PEM), signed by the cluster's CA")
    tls_key_file: Str = _field("", "a PEM file path or empty", "tls: this node's private key (PEM, unencrypted)")

    @model_validator(mode="after")
    def _check_together(self) -> "RunConfig":
        """Rules between fields; raises ConfigError naming the field (pydantic passes it through)."""
        _check(self.heartbeat_interval_s < self.io_timeout_s, "heartbeat_interval_s", self.heartbeat_interval_s,
               f"> 0 and below io_timeout_s={self.io_timeout_s:g}")
        for name in ("target_accuracy", "target_loss"):
            _check(getattr(self, name) == 0 or self.eval_every_s > 0, name, getattr(self, name),
                   "0 unless eval_every_s > 0 (a target needs evaluations during training)")
        _check(not self.stop_at_target or self.target_accuracy > 0 or self.target_loss > 0, "stop_at_target",
               self.stop_at_target, "false unless target_accuracy or target_loss is set (there is no target to stop at)")
        _validate_engine(self)
        _validate_lr_schedule(self)
        nodes = self.num_workers + 1
        _check(self.ps_shards == "all" or int(self.ps_shards) <= nodes, "ps_shards", self.ps_shards,
               f"1, all, or an integer 1..{nodes} (coordinator + {self.num_workers} workers)")
        return self


_add_units(RunConfig)


def default_config() -> RunConfig:
    """`RunConfig()`: every field at its default."""
    return RunConfig()


__all__ = ["RunConfig", "ConfigError", "CONFIG_GROUPS", "COMPRESSION_CHOICES", "LOG_TIERS", "DATASETS", "ENGINES", "MODELS", "ENV_PREFIX",
           "default_config"]
