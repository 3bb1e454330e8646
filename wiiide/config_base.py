"""`FrozenSettings`: the machinery under `wiiide.config.RunConfig`, apart from its fields.

An immutable pydantic-settings model built only from its keyword arguments (`from_dict`), or from
``<PREFIX><FIELD>`` environment variables read explicitly (`from_env`), written back as a dict or as
variables (`to_dict`, `to_env`), whose pydantic errors become one `ConfigError` line naming the field,
the value and what the field allows (its ``allowed`` text, given by `wiiide.config_types._field`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar, Mapping

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from wiiide.errors import ConfigError


class FrozenSettings(BaseSettings):
    """Base of an immutable settings model: subclasses declare ``model_config`` (with ``env_prefix``) and
    their fields; ``env_ignored`` names variables with the prefix that are not fields (lower case)."""

    env_ignored: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise _config_error(type(self), exc, values) from None

    def __setattr__(self, name: str, value: Any) -> None:
        """Refuse: a config is immutable (as the frozen dataclass it was). Use `replace`.

        Raises:
            dataclasses.FrozenInstanceError: always (an AttributeError).
        """
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}: the config is immutable; "
                                              "use replace()")

    def __delattr__(self, name: str) -> None:
        """Refuse, as `__setattr__` does. Raises dataclasses.FrozenInstanceError."""
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}: the config is immutable")

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):  # noqa: ANN001, ANN206
        """Only the keyword arguments: the environment is read by `from_env`, explicitly."""
        return (init_settings,)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Every field's name, in declaration order."""
        return tuple(cls.model_fields)

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """The JSON Schema (draft 2020-12, pydantic's) of the fields as `from_dict` accepts them.

        Each property has its type, default, bounds (``minimum``/``maximum`` ...), ``description``,
        ``allowed`` (the text a `ConfigError` gives), ``group`` (a key of `CONFIG_GROUPS`) and, where the
        value has one, ``unit`` (``"bytes"``, ``"s"``, ``"bit/s"``, ``"samples"`` ...). A field that also takes a string (numbers, sizes
        such as ``"256k"``, booleans such as ``"on"``, ``"64,32"``) has ``anyOf: [<typed>, {"type": "string"}]``.
        """
        schema = cls.model_json_schema(mode="validation")
        for prop in schema["properties"].values():
            if prop.get("type") in ("integer", "number", "boolean", "array"):
                typed = {key: prop.pop(key) for key in list(prop) if key in _TYPED_KEYS}
                prop["anyOf"] = [typed, {"type": "string"}]
        return schema

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Any:
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
        return cls(**dict(values))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Any:
        """Build from ``WIIIIIDE_<FIELD>`` variables (e.g. ``WIIIIIDE_SNDBUF_BYTES=8MiB``); default `os.environ`.

        Names are case-insensitive after the prefix. Variables with the prefix that name no field raise
        `ConfigError`, so a typo is not ignored; the shell's own (``WIIIIIDE_IMAGE``, ``_SECRET``,
        ``_SECRET_FILE``, ``_PROJECT``, ``_RESULTS_DIR``, ``_WORKERS``, ``_REQUIRE_DOCKER``) are skipped.
        """
        environ = os.environ if environ is None else environ
        prefix = cls.model_config["env_prefix"]
        values: dict[str, Any] = {}
        for key, value in environ.items():
            if not key.upper().startswith(prefix):
                continue
            name = key[len(prefix):].lower()
            if name in cls.env_ignored:
                continue
            values[name] = value
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (tuples become lists)."""
        return self.model_dump(mode="json")

    def to_env(self) -> dict[str, str]:
        """``WIIIIIDE_<FIELD>`` variables that `from_env` turns back into this config (bools as 1/0, lists
        comma-separated)."""
        env = {}
        for name, value in self.to_dict().items():
            if isinstance(value, bool):
                text = "1" if value else "0"
            elif isinstance(value, list):
                text = ",".join(str(v) for v in value)
            else:
                text = str(value)
            env[self.model_config["env_prefix"] + name.upper()] = text
        return env

    def replace(self, **changes: Any) -> Any:
        """A new config with `changes` (parsed as `from_dict` parses). Raises `ConfigError` as it does."""
        return type(self).from_dict({**self.to_dict(), **changes})



# JSON Schema keywords of a property's own type, moved under anyOf's first branch by RunConfig.json_schema.
_TYPED_KEYS = {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "items", "minItems", "maxItems"}


def _allowed(cls: type[FrozenSettings], name: str) -> str:
    field = cls.model_fields.get(name)
    extra = field.json_schema_extra if field is not None else None
    return extra.get("allowed", "?") if isinstance(extra, dict) else "?"


def _config_error(cls: type[FrozenSettings], exc: ValidationError, given: Mapping[str, Any]) -> ConfigError:
    """The first problem of a pydantic ValidationError as one ConfigError line naming the field, the value as
    `given` and what is allowed (an item of a list is named by its index)."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    name = str(first["loc"][0]) if first["loc"] else "?"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    if first["type"] == "extra_forbidden":
        unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
        return ConfigError(f"unknown config key(s) {unknown}; known keys: {', '.join(sorted(cls.model_fields))}")
    value = given.get(name, first.get("input"))
    reason = ""
    if len(first["loc"]) > 1:
        reason = f": item {first['loc'][1]} is {first.get('input')!r}"
    elif first["type"] == "value_error":  # from our own parsers: their words say what was wrong
        reason = ": " + str(first.get("ctx", {}).get("error", first["msg"])).removeprefix(f"{name}: ")
    return ConfigError(f"config field '{name}': bad value {value!r}{reason}; allowed: {_allowed(cls, name)}{more}")
