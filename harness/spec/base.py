"""The one way the spec stage checks its input: pydantic models, and one translation of their errors.

Every model of the stage derives from `SpecModel` (unknown keys refused, frozen unless it says
otherwise). Validators raise `ValueError` with a message that says what was wrong and what is
allowed, or `fail(message, *path)` when the problem sits below the value being checked (a key of a
mapping, an entry of a list). `spec_error` turns pydantic's `ValidationError` into one line::

    experiments/x.yaml: axes.link[2].coordinator: link profile 'inline': jitter: 9 ms; allowed: <= delay (5 ms)

that is, the file, the field path (``.key``, ``[index]``) and the message, as a `SpecError`.

Values read from YAML are validated with ``context=YAML`` (`from_yaml`): there, a bare number where a
unit is needed (a rate, a time) is refused, as `wiiide.units` does, while Python callers may pass
numbers already in the unit of the field's name (``rate_bps=100_000_000``).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Mapping, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import PydanticCustomError

from harness.errors import SpecError
from wiiide.units import UnitError

YAML: Mapping[str, Any] = {"yaml": True}  # the validation context of values read from a spec file
_MAX_SHOWN = 60  # characters of a bad value shown in a message
_FIELD = "\x00"  # the field name handed to wiiide.units, stripped from its message (the path names it)

M = TypeVar("M", bound=BaseModel)


def from_yaml(info: ValidationInfo) -> bool:
    """Whether the value being validated comes from a spec file (``context=YAML``) rather than Python."""
    return bool(info.context and info.context.get("yaml"))


def fail(message: str, *path: str | int) -> PydanticCustomError:
    """An error for a validator to raise when the bad value sits at `path` below the one being checked
    (e.g. ``fail("unknown key; allowed: ...", "switch")``); `spec_error` appends `path` to the field path."""
    return PydanticCustomError("spec", "{message}", {"message": message, "path": tuple(path)})


def unit(parse: Callable[[Any, str], Any], value: Any) -> Any:
    """Run one of `wiiide.units`' parsers (``parse_rate_bps``, ``parse_size_bytes``, ...) inside a
    validator. Returns its result (in the parser's unit). Raises ValueError with its message (which says
    what is allowed) minus the field name, which the path of the error already gives."""
    try:
        return parse(value, _FIELD)
    except UnitError as exc:
        raise ValueError(str(exc).replace(f"{_FIELD}: ", "", 1)) from None


def shown(value: Any) -> str:
    """``repr(value)``, cut to a readable length for a message."""
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN - 3] + "..."


def join_path(*parts: str | int) -> str:
    """``("axes", "link", 2, "rate")`` -> ``"axes.link[2].rate"``; empty parts are skipped."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "":
            out += f".{part}" if out else str(part)
    return out


def _message(error: Mapping[str, Any], is_key: bool) -> str:
    """One error of pydantic's `ValidationError.errors()` in the words of this project's messages."""
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    if kind in ("spec", "value_error", "assertion_error"):
        return error["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if kind == "literal_error":
        return (f"not allowed; allowed: {ctx['expected']}" if is_key
                else f"{shown(value)}; allowed: {ctx['expected']}")
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        bound = next(iter(ctx.values()))
        return f"{shown(value)}; allowed: {bounds[kind]} {bound:g}" if isinstance(bound, (int, float)) else \
            f"{shown(value)}; allowed: {bounds[kind]} {bound}"
    expected = {"int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
                "float_type": "a number", "float_parsing": "a number", "bool_type": "true or false",
                "bool_parsing": "true or false", "string_type": "a string", "dict_type": "a mapping",
                "model_type": "a mapping", "model_attributes_type": "a mapping", "list_type": "a list"}
    if kind in expected:
        return f"{shown(value)}; allowed: {expected[kind]}"
    if kind == "missing":
        return "missing: this key is required"
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "too_short":
        return f"{shown(value)}; allowed: at least {ctx.get('min_length')} item(s)"
    return f"{shown(value)}: {error['msg']}"


def spec_error(exc: ValidationError, where: str = "", path: str = "") -> SpecError:
    """Turn pydantic's `exc` into one clear `SpecError` line: ``<where>: <path><loc>: <message>``.

    `where` is what was being read (a file name, ``link profile 'wan'``), `path` the field path of
    the validated value inside it (e.g. ``axes.link[2]``). Only the first problem is spelled out (the
    count of the others follows), so a message stays one line.
    """
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = list(first["loc"])
    is_key = bool(loc) and loc[-1] == "[key]"  # a bad key of a mapping: pydantic puts it before "[key]"
    if is_key:
        loc.pop()
    loc += list((first.get("ctx") or {}).get("path", ()))
    parts = [p for p in (where, join_path(path, *loc)) if p]
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return SpecError(": ".join(parts + [_message(first, is_key)]) + more)


def validate(kind: type[M] | TypeAdapter, data: Any, where: str = "", path: str = "",
             context: Mapping[str, Any] | None = YAML) -> Any:
    """Validate `data` as `kind` (a model class or a `TypeAdapter`), by default as read from YAML.

    Returns the model (or the adapter's value). Raises `SpecError` (via `spec_error`) naming
    `where`, `path` and what is allowed.
    """
    adapter = kind if isinstance(kind, TypeAdapter) else None
    try:
        if adapter is not None:
            return adapter.validate_python(data, context=dict(context or {}))
        return kind.model_validate(data, context=dict(context or {}), by_alias=True,
                                   by_name=not (context or {}).get("yaml"))
    except ValidationError as exc:
        raise spec_error(exc, where, path) from None


class SpecModel(BaseModel):
    """Base of the spec stage's models: frozen, unknown keys refused with the keys that are allowed.

    A field's alias is its key in YAML (``rate`` for ``rate_bps``); Python callers use the field
    names. Constructing a model directly raises `SpecError` (not pydantic's `ValidationError`).
    `yaml_keys` lists the keys a spec file may give when they are not every field's alias.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True, validate_by_alias=True)
    yaml_keys: ClassVar[tuple[str, ...] | None] = None
    unknown_key: ClassVar[str] = "unknown key"  # how a key not in the model is called in messages

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise spec_error(exc, self._where(data)) from None

    # As pydantic's own RootModel does: mark this __init__ as the base one, so that `model_validate`
    # (which passes the YAML context) validates directly instead of calling __init__ without it.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @classmethod
    def _where(cls, data: Mapping[str, Any]) -> str:
        """What a `SpecError` from direct construction says it was reading (e.g. ``link profile 'wan'``)."""
        return ""

    @classmethod
    def allowed_keys(cls, yaml: bool = True) -> tuple[str, ...]:
        """The keys a spec file may give (``yaml``), or the keyword arguments Python may pass."""
        if yaml and cls.yaml_keys is not None:
            return cls.yaml_keys
        aliases = tuple(f.alias or name for name, f in cls.model_fields.items())
        return aliases if yaml else tuple(dict.fromkeys(aliases + tuple(cls.model_fields)))

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_keys(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, Mapping):
            allowed = cls.allowed_keys(from_yaml(info))
            for key in data:
                if key not in allowed:
                    raise fail(f"{cls.unknown_key}; allowed: {', '.join(allowed)}", str(key))
        return data
