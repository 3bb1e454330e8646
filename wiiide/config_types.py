"""Value parsers, annotated field types and field declarations of `wiiide.config.RunConfig`.

The parsers take values as the environment and YAML give them (strings) or as Python values, and
raise ``ValueError`` with what was expected; pydantic turns that into a validation error which
`RunConfig` reports as a `ConfigError` naming the field. Booleans are ``1/0``, ``true/false``,
``yes/no`` or ``on/off``; sizes are read by `wiiide.units.parse_size_bytes` (IEC: k = 1,024); bit
rates by `wiiide.units.parse_rate_bps` (SI: k = 1,000) or as a bare number of bit/s; layer widths
as ``"64,32"``, ``"64 32"`` or a list.

Fields are declared with `_field` after a `_section` statement naming their group (a key of
`CONFIG_GROUPS`); `_add_units`, run on the finished class, gives each field without a unit the one
its name carries (``_bytes``, ``_s``, ``_bps`` ...) and ends the section.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, ValidationInfo

from wiiide.codecs.policy import check_policy_name
from wiiide.units import MIB, parse_rate_bps, parse_size_bytes

MAX_STALENESS_BOUND = 1_000_000

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


# --- parsing of values given as strings (environment, YAML) or as Python values ---------------------
def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError("expected a boolean (1/0, true/false, yes/no, on/off)")


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("expected an integer")
        return int(value)
    if isinstance(value, str):
        if not re.fullmatch(r"\s*[+-]?\d+\s*", value):
            raise ValueError("expected an integer")
        return int(value)
    if isinstance(value, int):
        return value
    raise ValueError("expected an integer")


def _to_size_bytes(value: Any, info: ValidationInfo) -> int:
    return parse_size_bytes(value, info.field_name)  # UnitError is a ValueError: becomes a ConfigError


def _to_rate_bps(value: Any, info: ValidationInfo) -> int:
    if isinstance(value, str) and re.fullmatch(r"\s*\d+\s*", value):
        return int(value)  # a bare number: bit/s, as the field's name says
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _to_int(value)
    return parse_rate_bps(value, info.field_name)


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    if not isinstance(value, (str, int, float)):
        raise ValueError("expected a number")
    return float(value)


def _to_str(value: Any) -> str:
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ValueError("expected a string")
    return str(value)


def _to_int_tuple(value: Any) -> tuple[int, ...]:
    if isinstance(value, str):
        parts = [p for p in re.split(r"[,\s]+", value.strip()) if p]
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        parts = [value]
    else:
        raise ValueError("expected a list of integers")
    return tuple(_to_int(p) for p in parts)


def _buffer_size(value: int) -> int:
    if value != 0 and not 4096 <= value <= 1024 * MIB:
        raise ValueError("out of range")
    return value


def _ps_shards(value: str) -> str:
    text = value.strip().lower()
    if text != "all" and not (text.isdigit() and 1 <= int(text) <= 257):
        raise ValueError("expected 1, all, or an integer 1..nodes (coordinator + workers)")
    return text


def _tcp_congestion(value: str) -> str:
    text = value.strip()
    if text and not (len(text) <= 15 and text.replace("_", "").isalnum() and text.isascii()):
        raise ValueError("expected '' (the system's default) or a congestion control name of at most 15 "
                         "letters, digits or '_' (net.ipv4.tcp_available_congestion_control: e.g. cubic, bbr, reno)")
    return text


def _policy_name(value: str) -> str:
    problem = check_policy_name(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def _to_staleness_bound(value: Any) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "async":
        return "async"
    bound = _to_int(value)
    if not 0 <= bound <= MAX_STALENESS_BOUND:
        raise ValueError(f"expected 0..{MAX_STALENESS_BOUND} or async")
    return bound


def _to_pieces_per_shard(value: Any) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    pieces = _to_int(value)
    if not 1 <= pieces <= 256:
        raise ValueError("expected auto or an integer 1..256")
    return pieces


Bool = Annotated[bool, BeforeValidator(_to_bool)]
StalenessBound = Annotated[int | Literal["async"], BeforeValidator(_to_staleness_bound)]
PiecesPerShard = Annotated[int | Literal["auto"], BeforeValidator(_to_pieces_per_shard)]
Int = Annotated[int, BeforeValidator(_to_int)]
SizeBytes = Annotated[int, BeforeValidator(_to_size_bytes)]
RateBps = Annotated[int, BeforeValidator(_to_rate_bps)]
Float = Annotated[float, BeforeValidator(_to_float)]
Str = Annotated[str, BeforeValidator(_to_str)]
LayerWidths = Annotated[tuple[Annotated[int, Field(ge=1, le=65536)], ...],
                        BeforeValidator(_to_int_tuple)]
BufferBytes = Annotated[SizeBytes, AfterValidator(_buffer_size)]
PolicyName = Annotated[Str, AfterValidator(_policy_name)]
PsShards = Annotated[Str, AfterValidator(_ps_shards)]
TcpCongestion = Annotated[Str, AfterValidator(_tcp_congestion)]


# --- field declarations: groups and units ----------------------------------------------------------
# The subsystems RunConfig's fields are grouped by (each field's ``group`` in the schema), in the class's
# order: group -> its title. `wiiide-lab knobs` and docs/knobs.md list the knobs under these.
CONFIG_GROUPS: dict[str, str] = {
    "topology": "Topology: who listens and connects where",
    "data-model": "Data and model",
    "run-length": "Run length",
    "evaluation": "Held-out evaluation and time to target",
    "engine": "Engine: the training system (wiiide, or torch DDP / FSDP)",
    "pace": "Workers at their own pace: staleness, local SGD, adaptive batches",
    "ps": "Sharded parameter server",
    "sockets": "Sockets and frames",
    "codecs": "Wire compression and codecs",
    "logging": "Logging and metrics",
    "timeouts": "Timeouts and liveness",
    "recovery": "Checkpoints and recovery",
    "security": "Who may connect: handshake, admission, TLS",
}

# The unit a field's name carries (conventions: ``_s``, ``_bytes``, ``_bps``), for fields that give none.
_UNIT_SUFFIXES = (("_bytes", "bytes"), ("_bps", "bit/s"), ("_ms", "ms"), ("_s", "s"), ("_steps", "steps"))

_section_group: list[str] = []  # the group `_section` set; `_field` gives it to the fields declared after


def _section(group: str) -> None:
    """Give `group` (a key of `CONFIG_GROUPS`) to the `_field`s declared after this statement in a class body.

    Raises:
        KeyError: `group` is not in `CONFIG_GROUPS`.
    """
    if group not in CONFIG_GROUPS:
        raise KeyError(f"unknown config group {group!r}; groups: {', '.join(CONFIG_GROUPS)}")
    _section_group[:] = [group]


def _field(default: Any, allowed: str, description: str, unit: str = "", **constraints: Any) -> Any:
    """A field with its default, bounds, the text `ConfigError` gives as what is allowed, the group of the
    last `_section` and its `unit` (``""``: the unit its name's suffix carries, if any; see `_add_units`)."""
    extra = {"allowed": allowed, **({"group": _section_group[0]} if _section_group else {})}
    return Field(default, description=description, json_schema_extra={**extra, **({"unit": unit} if unit else {})},
                 **constraints)


def _add_units(cls: type[BaseModel]) -> None:
    """Give every field of `cls` without a unit the one its name's suffix carries (`_UNIT_SUFFIXES`), then
    rebuild its schema; close the last `_section`, so that a field declared later gets no group by accident."""
    _section_group.clear()
    for name, info in cls.model_fields.items():
        extra = info.json_schema_extra
        if isinstance(extra, dict) and "unit" not in extra:
            unit = next((u for suffix, u in _UNIT_SUFFIXES if name.endswith(suffix)), "")
            if unit:
                extra["unit"] = unit
    cls.model_rebuild(force=True)
