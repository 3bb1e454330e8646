"""harness.present.knobs and `wiiide-lab knobs`: the knobs reference from RunConfig's field metadata."""

from __future__ import annotations

import re

import pytest

from harness.cli import main
from harness.errors import SpecError
from harness.present.knobs import KNOBS_MD, format_default, knobs, knobs_lines, knobs_markdown
from wiiide.config import CONFIG_GROUPS, RunConfig


def test_docs_knobs_md_is_fresh():
    assert KNOBS_MD.read_text() == knobs_markdown(), \
        "docs/knobs.md is stale: run `wiiide-lab knobs --markdown > docs/knobs.md`"


def test_every_field_is_one_row_under_its_group_in_the_groups_order():
    rows = knobs()
    assert sorted(k.name for k in rows) == sorted(RunConfig.field_names())
    order = list(CONFIG_GROUPS)
    assert [order.index(k.group) for k in rows] == sorted(order.index(k.group) for k in rows)
    sndbuf = next(k for k in rows if k.name == "sndbuf_bytes")
    assert (sndbuf.group, sndbuf.unit, sndbuf.default) == ("sockets", "bytes", "8388608 (8MiB)")
    assert sndbuf.allowed == "0 (kernel default) or 4096..1 GiB" and "SO_SNDBUF" in sndbuf.description


def test_defaults_print_as_a_spec_writes_them():
    assert format_default(True, "") == "true"
    assert format_default((64, 32), "") == "64,32"
    assert format_default("", "") == "''"
    assert format_default(512, "bytes") == "512"
    assert format_default(30.0, "s") == "30"


def test_markdown_tables_keep_five_cells_when_a_text_has_a_bar():
    text = knobs_markdown()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) == len(RunConfig.field_names())
    for row in rows:
        assert len(re.findall(r"(?<!\\)\|", row)) == 6, row
    assert "digits \\| synthetic" in next(r for r in rows if r.startswith("| `dataset`"))
    assert text.count("\n## ") == len(CONFIG_GROUPS)


def test_one_group_only(capsys):
    assert main(["knobs", "--group", "sockets"]) == 0
    out = capsys.readouterr().out
    names = [line.split("\t")[0] for line in out.splitlines() if not line.startswith("#")]
    assert names == [k.name for k in knobs("sockets")] and "sndbuf_bytes" in names and "port" not in names
    assert all(len(line.split("\t")) == 5 for line in out.splitlines() if not line.startswith("#"))
    assert main(["knobs", "--group", "ps", "--markdown"]) == 0
    md = capsys.readouterr().out
    assert "`ps_shards`" in md and "`sndbuf_bytes`" not in md


def test_an_unknown_group_is_refused_with_the_groups(capsys):
    assert main(["knobs", "--group", "socket"]) == 2
    err = capsys.readouterr().err
    assert "unknown knob group 'socket'" in err and all(g in err for g in CONFIG_GROUPS)
    with pytest.raises(SpecError):
        knobs_lines("socket")
