"""The knobs reference: every `wiiide.config.RunConfig` field, by subsystem, from the fields' metadata.

Each knob is one row: its name, what it does (the field's ``description``), its unit (``unit``),
its default and what it accepts (``allowed``, the text a `ConfigError` gives), under its group
(``group``, a key of `wiiide.config.CONFIG_GROUPS`, in that order). Three forms of the same rows:
`knobs_rich` (a rich table per group, for a terminal), `knobs_lines` (one tab-separated line per knob,
for a pipe) and `knobs_markdown` (docs/knobs.md, which `wiiide-lab knobs --markdown` writes and
tests/unit/test_knobs.py checks fresh).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rich.table import Table
from rich.text import Text

from harness import REPO_ROOT
from harness.errors import SpecError
from wiiide.config import CONFIG_GROUPS, RunConfig
from wiiide.units import format_size

KNOBS_MD = REPO_ROOT / "docs" / "knobs.md"
COLUMNS = ("knob", "what it does", "unit", "default", "allowed")


@dataclasses.dataclass(frozen=True)
class Knob:
    """One RunConfig field as the reference prints it; every attribute is text (``""``: none)."""

    name: str
    group: str
    description: str
    unit: str
    default: str
    allowed: str

    def cells(self) -> tuple[str, str, str, str, str]:
        """The row in `COLUMNS` order."""
        return (self.name, self.description, self.unit, self.default, self.allowed)


def format_default(value: Any, unit: str) -> str:
    """A default as a spec would write it: booleans ``true``/``false``, lists ``64,32``, ``''`` for an
    empty string, sizes of a KiB or more also in IEC (``8388608 (8MiB)``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if value == "":
        return "''"
    if unit == "bytes" and isinstance(value, int) and value >= 1024:
        return f"{value} ({format_size(value)})"
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_group(group: str | None) -> None:
    """Raises SpecError when `group` is given and is not a key of `CONFIG_GROUPS` (the message lists them)."""
    if group is not None and group not in CONFIG_GROUPS:
        raise SpecError(f"unknown knob group {group!r}; groups: {', '.join(CONFIG_GROUPS)}")


def knobs(group: str | None = None) -> list[Knob]:
    """Every RunConfig field as a `Knob`, in `CONFIG_GROUPS` order, then declaration order; `group`: its only.

    Raises:
        SpecError: `group` is not a key of `CONFIG_GROUPS`.
    """
    check_group(group)
    props = RunConfig.json_schema()["properties"]
    rows = []
    for name in RunConfig.field_names():
        prop = props[name]
        unit = prop.get("unit", "")
        rows.append(Knob(name, prop.get("group", ""), prop.get("description", ""), unit,
                         format_default(prop.get("default"), unit), prop.get("allowed", "")))
    order = {g: i for i, g in enumerate(CONFIG_GROUPS)}
    rows.sort(key=lambda k: order.get(k.group, len(order)))  # stable: declaration order within a group
    return [k for k in rows if group is None or k.group == group]


def _by_group(group: str | None) -> list[tuple[str, list[Knob]]]:
    rows = knobs(group)
    return [(g, [k for k in rows if k.group == g]) for g in CONFIG_GROUPS if any(k.group == g for k in rows)]


def knobs_lines(group: str | None = None) -> str:
    """The reference as plain text: per group a ``# <title> (<group>)`` line, then one line per knob, its
    `COLUMNS` separated by tabs (``-`` for no unit). Raises SpecError for an unknown `group`."""
    out = []
    for g, rows in _by_group(group):
        out.append(f"# {CONFIG_GROUPS[g]} ({g})")
        out.extend("\t".join(cell or "-" for cell in k.cells()) for k in rows)
    return "\n".join(out)


def knobs_rich(group: str | None = None) -> list[Table]:
    """The reference as one rich `Table` per group (titled ``<title> (--group <group>)``), for a terminal.
    Raises SpecError for an unknown `group`."""
    tables = []
    for g, rows in _by_group(group):
        table = Table(title=f"{CONFIG_GROUPS[g]} (--group {g})", title_justify="left", show_lines=False)
        for column in COLUMNS:
            table.add_column(column, no_wrap=column in ("knob", "unit"), overflow="fold",
                             ratio={"what it does": 5, "allowed": 3, "default": 1}.get(column))
        for k in rows:
            table.add_row(*(Text(cell) for cell in k.cells()))  # Text: a '[' in a description is no markup
        tables.append(table)
    return tables


def _md_cell(text: str, code: bool = False) -> str:
    text = text.replace("|", "\\|")
    return f"`{text}`" if code and text else text


def knobs_markdown(group: str | None = None) -> str:
    """The reference as Markdown (docs/knobs.md with no `group`): a heading, how knobs are set, then per
    group a ``##`` heading and a table of `COLUMNS`. Ends with a newline. Raises SpecError for an unknown
    `group`."""
    out = ["# Knobs", "",
           "Every field of `wiiide.config.RunConfig` is a knob. A sweep spec sets it under `base:` or `axes:`, "
           "`wiiide-lab up --set KEY=VALUE` sets it for a long-running cluster, and inside a container it is the "
           "variable `WIIIIIDE_<FIELD>`. A value may be written as a string: booleans `1/0`, `true/false`, "
           "`yes/no`, `on/off`; sizes (`*_bytes`) with IEC suffixes (`256k` = 262,144, `8MiB`); bit rates "
           "with SI ones (`100mbit`). A bad value stops the run before anything starts, with the field, the "
           "value and what is allowed.", "",
           "This page is generated from the fields' metadata (description, group, unit, default, allowed) by "
           "`wiiide-lab knobs --markdown > docs/knobs.md`; a test fails when it is stale. "
           "`wiiide-lab knobs --group GROUP` prints one group on a terminal.", "",
           "Groups: " + ", ".join(f"`{g}`" for g in CONFIG_GROUPS) + "."]
    for g, rows in _by_group(group):
        out += ["", f"## {CONFIG_GROUPS[g]}", "", f"`--group {g}`", "",
                "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        for k in rows:
            out.append("| " + " | ".join((_md_cell(k.name, True), _md_cell(k.description), _md_cell(k.unit),
                                          _md_cell(k.default, True), _md_cell(k.allowed))) + " |")
    return "\n".join(out) + "\n"
