"""Run configuration of a WIIIIIDE node (coordinator or worker).

One flat dataclass, `RunConfig`, holds every knob of the seeds' studies (socket buffer sizes and
options, compression, logging tier) and of the run (model, data, duration). It is built from a dict
(`RunConfig.from_dict`, used by the harness with sweep points) or from ``WIIIIIDE_<FIELD>`` environment
variables (`RunConfig.from_env`, used inside containers), and validated when built: a bad value raises
`ConfigError` naming the field and what is allowed, before any socket is opened.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from wiiide.errors import ConfigError

ENV_PREFIX = "WIIIIIDE_"
MIB = 1024 * 1024
MAX_TIMEOUT_S = 86400.0

DATASETS = ("digits", "synthetic")
LOG_TIERS = ("verbose", "normal", "silent")
ENGINES = ("wiiide", "ddp", "fsdp")
DDP_COMM_HOOKS = ("none", "fp16", "powersgd")
MIXED_PRECISIONS = ("none", "bf16")
ZLIB_LEVELS = tuple(range(1, 10))
COMPRESSION_CHOICES = ("none", "adaptive") + tuple(f"zlib-{level}" for level in ZLIB_LEVELS)


@dataclass(frozen=True)
class RunConfig:
    """Every knob of one WIIIIIDE run. Units are in the field names.

    Defaults follow the seeds' "current implementation": 8 MiB socket buffers, TCP_NODELAY and
    TCP_QUICKACK on, 256 KiB receive chunks, 30 s runs, `normal` logging.
    """

    # --- topology -------------------------------------------------------------------------------
    coordinator_host: str = "127.0.0.1"  # where workers connect
    bind_host: str = "127.0.0.1"  # where the coordinator listens (0.0.0.0 in containers)
    port: int = 29500
    num_workers: int = 2
    node_id: str = ""  # empty: the hostname (workers get their rank from the coordinator)

    # --- data and model -------------------------------------------------------------------------
    dataset: str = "digits"
    synthetic_samples: int = 4096
    synthetic_features: int = 256
    synthetic_classes: int = 10
    test_fraction: float = 0.2
    hidden_sizes: tuple[int, ...] = (64,)
    batch_size: int = 32  # samples per worker per step
    learning_rate: float = 0.1
    momentum: float = 0.0
    seed: int = 0
    torch_threads: int = 1  # intra-op threads per node (0: torch's default, one per core)

    # --- run length -----------------------------------------------------------------------------
    duration_s: float = 30.0
    max_steps: int = 0  # 0: no step limit, stop on duration_s only
    warmup_steps: int = 10  # first steps left out of the Training Summary's step timings

    # --- engine: which training system runs on the same containers (wiiide/engines/) ----------
    engine: str = "wiiide"  # wiiide (the parameter server) | ddp | fsdp (PyTorch over gloo)
    ddp_comm_hook: str = "none"  # ddp: none | fp16 | powersgd
    powersgd_rank: int = 1  # ddp with powersgd: matrix approximation rank
    fsdp_reshard_after_forward: bool = True  # fsdp: True is FULL_SHARD, False SHARD_GRAD_OP-like
    grad_accum_steps: int = 1  # ddp/fsdp: micro-batches per optimizer step (one gradient sync per step)
    mixed_precision: str = "none"  # ddp/fsdp: none | bf16 (CPU autocast; fsdp: bf16 parameters)
    profile: bool = False  # ddp/fsdp: torch.profiler traces into the run's folder (metrics_dir's parent)

    # --- sockets --------------------------------------------------------------------------------
    sndbuf_bytes: int = 8 * MIB  # 0: leave the kernel default
    rcvbuf_bytes: int = 8 * MIB
    tcp_nodelay: bool = True
    tcp_quickack: bool = True
    keepalive: bool = True
    recv_chunk_bytes: int = 256 * 1024
    max_frame_bytes: int = 1024 * MIB

    # --- compression ----------------------------------------------------------------------------
    compression: str = "none"  # policy: fixed:<codec> | none | zlib-N | seed (= adaptive) | network-aware
    adaptive_threshold_bytes: int = 1 * MIB
    codec_threads: int = 1  # parallel chunked compression threads (0: the cores, at most 4)
    codec_chunk_bytes: int = 1 * MIB  # raw bytes per parallel chunk
    link_bandwidth_bps: int = 0  # network-aware: the link's rate; 0: measured online from received frames
    allow_lossy: bool = False  # network-aware may pick lossy codecs (fp16, bf16, int8, topk) for gradients
    lossy_warmup_steps: int = 50  # gradient messages sent uncompressed before any lossy codec
    topk_fraction: float = 0.01  # network-aware's top-k candidate keeps this fraction per tensor
    codec_probe_every: int = 20  # network-aware tries another codec every this many messages of a kind

    # --- logging and metrics --------------------------------------------------------------------
    log_tier: str = "normal"
    log_every_steps: int = 100
    metrics_dir: str = "results/nodes"
    ready_file: str = ""  # coordinator: touched once it listens (the container healthcheck reads it)
    # coordinator: once every worker joined, wait (up to connect_timeout_s) for this file before the
    # first step; the harness creates it once links are shaped ("": start at once)
    start_gate_file: str = ""

    # --- timeouts -------------------------------------------------------------------------------
    connect_timeout_s: float = 60.0  # worker: retry connecting; coordinator: wait for all workers
    # longest silence from a peer (no byte, no heartbeat) before it counts as lost: the time to detect
    # a killed worker or coordinator, or a cut link
    io_timeout_s: float = 10.0
    heartbeat_interval_s: float = 1.0  # a connection idle this long gets a heartbeat frame

    # --- who may connect (the secret itself is never a config field: see wiiide.auth) ---------
    handshake_timeout_s: float = 5.0  # a peer must complete the authenticated handshake within this
    max_handshakes: int = 8  # connections handshaking at once; more are refused at once

    def __post_init__(self) -> None:
        _validate(self)

    # ------------------------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "RunConfig":
        """Build from a mapping of field name to value; strings are parsed as from the environment.

        Raises:
            ConfigError: an unknown key (with the known ones listed), or a bad value.
        """
        known = set(cls.field_names())
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"unknown config key(s) {unknown}; known keys: {', '.join(sorted(known))}"
            )
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        kwargs = {name: _coerce(name, types[name], value) for name, value in values.items()}
        return cls(**kwargs)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "RunConfig":
        """Build from ``WIIIIIDE_<FIELD>`` variables (e.g. ``WIIIIIDE_SNDBUF_BYTES=8388608``).

        Variables with the prefix that name no field raise `ConfigError`, so a typo is not ignored.
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for key, value in environ.items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = key[len(ENV_PREFIX):].lower()
            if name in _ENV_IGNORED:
                continue
            values[name] = value
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists)."""
        out = dataclasses.asdict(self)
        out["hidden_sizes"] = list(self.hidden_sizes)
        return out

    def to_env(self) -> dict[str, str]:
        """``WIIIIIDE_<FIELD>`` variables that `from_env` turns back into this config."""
        env = {}
        for name, value in self.to_dict().items():
            if isinstance(value, bool):
                text = "1" if value else "0"
            elif isinstance(value, list):
                text = ",".join(str(v) for v in value)
            else:
                text = str(value)
            env[ENV_PREFIX + name.upper()] = text
        return env

    def replace(self, **changes: Any) -> "RunConfig":
        return RunConfig.from_dict({**self.to_dict(), **changes})


# Variables with the prefix that are not RunConfig fields but are used by the project's shell.
_ENV_IGNORED = {"require_docker", "secret", "secret_file", "image", "results_dir", "workers", "project"}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _coerce(name: str, type_name: Any, value: Any) -> Any:
    """Turn an env string or YAML value into the field's type; raise ConfigError naming the field."""
    type_name = str(type_name)
    try:
        if type_name == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ValueError("expected a boolean (1/0, true/false, yes/no, on/off)")
        if type_name == "int":
            if isinstance(value, bool):
                raise ValueError("expected an integer, got a boolean")
            if isinstance(value, float):
                if not value.is_integer():
                    raise ValueError("expected an integer")
                return int(value)
            return int(_parse_size(value)) if isinstance(value, str) else int(value)
        if type_name == "float":
            if isinstance(value, bool):
                raise ValueError("expected a number, got a boolean")
            return float(value)
        if type_name == "str":
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError("expected a string")
            return str(value)
        if type_name.startswith("tuple"):
            if isinstance(value, str):
                parts = [p for p in re.split(r"[,\s]+", value.strip()) if p]
            elif isinstance(value, (list, tuple)):
                parts = list(value)
            elif isinstance(value, int) and not isinstance(value, bool):
                parts = [value]
            else:
                raise ValueError("expected a list of integers")
            return tuple(int(p) for p in parts)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config field '{name}': bad value {value!r}: {exc}") from None
    raise ConfigError(f"config field '{name}': unsupported type {type_name}")  # pragma: no cover


_SIZE_RE = re.compile(r"^\s*(\d+)\s*(kib|mib|gib|k|m|g)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {None: 1, "k": 1024, "kib": 1024, "m": MIB, "mib": MIB, "g": 1024 * MIB, "gib": 1024 * MIB}


def _parse_size(text: str) -> int:
    """'8388608', '8MiB', '256k' -> bytes (binary units)."""
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError("expected an integer, optionally with a KiB/MiB/GiB suffix")
    number, unit = match.groups()
    return int(number) * _SIZE_UNITS[unit.lower() if unit else None]


def _check(cond: bool, name: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"config field '{name}': bad value {value!r}; allowed: {allowed}")


def _validate(c: RunConfig) -> None:
    _check(1 <= c.port <= 65535, "port", c.port, "1..65535")
    _check(1 <= c.num_workers <= 256, "num_workers", c.num_workers, "1..256")
    _check(c.dataset in DATASETS, "dataset", c.dataset, " | ".join(DATASETS))
    _check(c.synthetic_samples >= 20, "synthetic_samples", c.synthetic_samples, ">= 20")
    _check(1 <= c.synthetic_features <= 1_000_000, "synthetic_features", c.synthetic_features, "1..1000000")
    _check(2 <= c.synthetic_classes <= 100_000, "synthetic_classes", c.synthetic_classes, "2..100000")
    _check(0.0 < c.test_fraction < 1.0, "test_fraction", c.test_fraction, "0 < x < 1")
    _check(
        0 < len(c.hidden_sizes) <= 16 and all(1 <= h <= 65536 for h in c.hidden_sizes),
        "hidden_sizes", c.hidden_sizes, "1..16 layer widths, each 1..65536",
    )
    _check(1 <= c.batch_size <= 65536, "batch_size", c.batch_size, "1..65536")
    _check(0.0 < c.learning_rate <= 100.0, "learning_rate", c.learning_rate, "0 < x <= 100")
    _check(0.0 <= c.momentum < 1.0, "momentum", c.momentum, "0 <= x < 1")
    _check(0 <= c.torch_threads <= 256, "torch_threads", c.torch_threads, "0 (torch default) .. 256")
    _check(c.max_steps >= 0, "max_steps", c.max_steps, ">= 0 (0: no limit)")
    for name in ("sndbuf_bytes", "rcvbuf_bytes"):
        value = getattr(c, name)
        _check(value == 0 or 4096 <= value <= 1024 * MIB, name, value, "0 (kernel default) or 4096..1 GiB")
    _check(1024 <= c.recv_chunk_bytes <= 256 * MIB, "recv_chunk_bytes", c.recv_chunk_bytes, "1 KiB..256 MiB")
    _check(64 * 1024 <= c.max_frame_bytes <= 8 * 1024 * MIB, "max_frame_bytes", c.max_frame_bytes, "64 KiB..8 GiB")
    from wiiide.codecs.policy import check_policy_name

    problem = check_policy_name(c.compression)
    _check(problem is None, "compression", c.compression, f"a compression policy ({problem})")
    _check(0 <= c.codec_threads <= 64, "codec_threads", c.codec_threads, "0 (the cores, at most 4) .. 64")
    _check(64 * 1024 <= c.codec_chunk_bytes <= 256 * MIB, "codec_chunk_bytes", c.codec_chunk_bytes, "64 KiB..256 MiB")
    _check(c.link_bandwidth_bps >= 0, "link_bandwidth_bps", c.link_bandwidth_bps, ">= 0 (0: measured online)")
    _check(c.lossy_warmup_steps >= 0, "lossy_warmup_steps", c.lossy_warmup_steps, ">= 0")
    _check(0.0 < c.topk_fraction <= 1.0, "topk_fraction", c.topk_fraction, "0 < x <= 1")
    _check(c.codec_probe_every >= 2, "codec_probe_every", c.codec_probe_every, ">= 2")
    _check(c.adaptive_threshold_bytes >= 0, "adaptive_threshold_bytes", c.adaptive_threshold_bytes, ">= 0")
    _check(c.log_tier in LOG_TIERS, "log_tier", c.log_tier, " | ".join(LOG_TIERS))
    _check(c.log_every_steps >= 1, "log_every_steps", c.log_every_steps, ">= 1")
    # finite and at most a day: socket.settimeout overflows on inf or 1e300
    for name in ("connect_timeout_s", "io_timeout_s", "duration_s"):
        value = getattr(c, name)
        _check(0 < value <= MAX_TIMEOUT_S, name, value, f"0 < x <= {MAX_TIMEOUT_S:g} seconds")
    _check(0 < c.heartbeat_interval_s < c.io_timeout_s, "heartbeat_interval_s", c.heartbeat_interval_s,
           f"> 0 and below io_timeout_s={c.io_timeout_s:g}")
    _check(0 < c.handshake_timeout_s <= 300, "handshake_timeout_s", c.handshake_timeout_s, "0 < x <= 300 seconds")
    _check(1 <= c.max_handshakes <= 1024, "max_handshakes", c.max_handshakes, "1..1024")
    _validate_engine(c)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunConfig)}


def _validate_engine(c: RunConfig) -> None:
    """The engine and its options; an option the chosen engine cannot apply is an error, not ignored."""
    _check(c.engine in ENGINES, "engine", c.engine, " | ".join(ENGINES))
    _check(c.ddp_comm_hook in DDP_COMM_HOOKS, "ddp_comm_hook", c.ddp_comm_hook, " | ".join(DDP_COMM_HOOKS))
    _check(1 <= c.powersgd_rank <= 64, "powersgd_rank", c.powersgd_rank, "1..64")
    _check(1 <= c.grad_accum_steps <= 64, "grad_accum_steps", c.grad_accum_steps, "1..64")
    _check(c.mixed_precision in MIXED_PRECISIONS, "mixed_precision", c.mixed_precision, " | ".join(MIXED_PRECISIONS))
    _check(0 <= c.warmup_steps <= 100_000, "warmup_steps", c.warmup_steps, "0..100000")
    torch_engine = c.engine in ("ddp", "fsdp")
    only = [("ddp_comm_hook", c.ddp_comm_hook != "none", c.engine == "ddp", "engine ddp"),
            ("powersgd_rank", c.powersgd_rank != 1, c.ddp_comm_hook == "powersgd", "ddp_comm_hook powersgd"),
            ("fsdp_reshard_after_forward", not c.fsdp_reshard_after_forward, c.engine == "fsdp", "engine fsdp"),
            ("grad_accum_steps", c.grad_accum_steps != 1, torch_engine, "engine ddp or fsdp"),
            ("mixed_precision", c.mixed_precision != "none", torch_engine, "engine ddp or fsdp"),
            ("profile", c.profile, torch_engine, "engine ddp or fsdp"),
            ("compression", c.compression != _DEFAULTS["compression"], c.engine == "wiiide", "engine wiiide")]
    for name, is_set, applies, needs in only:
        if is_set and not applies:
            raise ConfigError(f"config field '{name}': {getattr(c, name)!r} needs {needs} "
                              f"(engine is {c.engine!r}, ddp_comm_hook {c.ddp_comm_hook!r})")
    if torch_engine:
        global_batch = c.num_workers * c.batch_size
        _check(global_batch >= (c.num_workers + 1) * c.grad_accum_steps, "grad_accum_steps", c.grad_accum_steps,
               f"at most num_workers x batch_size / world size = {global_batch // (c.num_workers + 1)} "
               "(every rank needs a sample per micro-batch)")


def default_config() -> RunConfig:
    return RunConfig()


__all__ = ["RunConfig", "ConfigError", "COMPRESSION_CHOICES", "LOG_TIERS", "DATASETS", "default_config"]
