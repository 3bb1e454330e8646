"""The commands README.md, docs/getting-started.md, docs/cli.md and docs/results.md show, run as a user
runs them where they are cheap (``--help``, ``knobs``, ``sweep --dry-run``, one point of the quick sweep
on the local backend, its report and export): each exits as its page says and prints what it shows.

Each command is looked up in its page first, so a page that stops showing it, or shows it changed,
fails here instead of going unrun. ``wiiide-lab`` runs as ``python -m harness`` with this checkout on
PYTHONPATH (the entry point an editable install puts on the PATH may point at another checkout)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
CLI = ROOT / "docs" / "cli.md"
RESULTS = ROOT / "docs" / "results.md"
COMMAND_TIMEOUT_S = 120  # a --help or a dry run takes about a second; the one-point sweep about 20 s
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def shown(page: Path, command: str) -> str:
    """`command` as `page` shows it (it must appear there verbatim), for `run`."""
    assert command in page.read_text(encoding="utf-8"), f"{page.relative_to(ROOT)} no longer shows {command!r}"
    return command


def run(command: str, *extra: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run a shown ``wiiide-lab ...`` command (plus `extra` arguments) from `cwd`; its exit code and
    output, decoded."""
    argv = shlex.split(command)
    assert argv[0] == "wiiide-lab", command
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "harness", *argv[1:], *extra], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)


def fenced_blocks(page: Path) -> list[str]:
    """The contents of `page`'s fenced code blocks, in order."""
    return FENCE.findall(page.read_text(encoding="utf-8"))


def docs_verbs() -> list[str]:
    """The verbs docs/getting-started.md lists as ``wiiide-lab up|down|...``."""
    m = re.search(r"`wiiide-lab ((?:[a-z-]+\|)+[a-z-]+)`", GETTING_STARTED.read_text(encoding="utf-8"))
    assert m, "docs/getting-started.md lists no verbs as `wiiide-lab a|b|...`"
    return m.group(1).split("|")


def test_the_help_lists_the_verbs_the_docs_list():
    done = run("wiiide-lab --help")
    assert done.returncode == 0, done.stderr
    m = re.search(r"\{([a-z,-]+)\}", done.stdout)
    assert m, done.stdout
    assert sorted(m.group(1).split(",")) == sorted(docs_verbs())


@pytest.mark.parametrize("verb", docs_verbs())
def test_every_verb_has_its_help(verb: str):
    """`wiiide-lab VERB --help lists each verb's options` (docs/getting-started.md)."""
    shown(GETTING_STARTED, "`wiiide-lab VERB --help` lists each verb's options")
    done = run(f"wiiide-lab {verb} --help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: wiiide-lab {verb}"), done.stdout[:200]
    assert "-h, --help" in done.stdout


def knob_lines(stdout: str) -> list[list[str]]:
    """The knob lines of ``knobs`` in a pipe, each split at its tabs (group title lines left out)."""
    return [line.split("\t") for line in stdout.splitlines() if line and not line.startswith("# ")]


def test_knobs_of_one_group():
    done = run(shown(CLI, "wiiide-lab knobs --group sockets"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert re.fullmatch(r"# .+ \(sockets\)", lines[0]), lines[0]
    rows = knob_lines(done.stdout)
    # name, what it does, unit, default, allowed: as docs/cli.md says
    assert rows and all(len(row) == 5 for row in rows), rows
    assert {"sndbuf_bytes", "rcvbuf_bytes"} <= {row[0] for row in rows}
    assert [row[2] for row in rows if row[0] == "sndbuf_bytes"] == ["bytes"]


def test_knobs_in_a_pipe_through_grep():
    command = shown(CLI, "wiiide-lab knobs | grep -i timeout")
    done = run(command.split(" | ")[0])
    assert done.returncode == 0, done.stderr
    titles = re.findall(r"^# .+ \(([a-z-]+)\)$", done.stdout, re.MULTILINE)
    listed = re.search(r"The groups are\s+(.*?)\(`wiiide\.config\.CONFIG_GROUPS`\)", CLI.read_text(encoding="utf-8"),
                       re.DOTALL)
    assert listed and titles == re.findall(r"`([a-z-]+)`", listed.group(1))  # every group, in the docs' order
    grepped = [row for row in knob_lines(done.stdout) if "timeout" in "\t".join(row).lower()]
    assert "io_timeout_s" in {row[0] for row in grepped} and all(len(row) == 5 for row in grepped)


def test_an_unknown_group_is_refused_with_the_groups():
    shown(CLI, "An unknown group\nis refused (exit 2) with the list of groups.")
    done = run("wiiide-lab knobs --group no-such-group")
    assert done.returncode == 2
    assert "no-such-group" in done.stderr and "sockets" in done.stderr and "security" in done.stderr


def test_the_dry_run_prints_what_the_docs_show(tmp_path: Path):
    command = shown(CLI, "wiiide-lab sweep experiments/quick.yaml --dry-run --backend local --only link=none --repeats 3")
    blocks = fenced_blocks(CLI)
    at = next(i for i, block in enumerate(blocks) if command in block)
    done = run(command, "--results-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    # the block after the command is its output, verbatim
    assert done.stdout.rstrip("\n").splitlines() == blocks[at + 1].rstrip("\n").splitlines()
    assert not any(tmp_path.iterdir())  # "writes no file"


def test_the_dry_run_refuses_a_link_axis_on_the_local_backend():
    shown(CLI, "`--backend local` with a\n`link` axis")
    done = run("wiiide-lab sweep experiments/links.yaml --dry-run --backend local")
    assert done.returncode == 1
    assert "local backend cannot shape links" in done.stderr


def test_the_dry_run_names_the_file_and_field_of_a_bad_value(tmp_path: Path):
    shown(CLI, "`my-sweep.yaml: axes.sndbuf_bytes[1]: config field 'sndbuf_bytes': bad\nvalue 12: ...`")
    spec = tmp_path / "my-sweep.yaml"
    spec.write_text("name: my-sweep\nrepeats: 1\nbase: {dataset: digits, num_workers: 2, duration_s: 10}\n"
                    "axes:\n  sndbuf_bytes: [8MiB, 12]\n", encoding="utf-8")
    done = run("wiiide-lab sweep my-sweep.yaml --dry-run --backend local", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "my-sweep.yaml: axes.sndbuf_bytes[1]: config field 'sndbuf_bytes': bad value 12" in done.stderr


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory) -> Path:
    """The README's first sweep on the local backend, its unshaped point of the default placement (about
    25 s): its report.json."""
    results = tmp_path_factory.mktemp("results")
    done = run(shown(README, "wiiide-lab sweep experiments/quick.yaml"),
               "--backend", "local", "--only", "link=none", "--only", "engine=sharded", "--results-dir", str(results))
    assert done.returncode == 0, done.stderr[-2000:]
    # "its last line is always the report's path" (docs/getting-started.md)
    shown(GETTING_STARTED, "its last line is always the report's path")
    path = Path(done.stdout.splitlines()[-1])
    assert path.name == "report.json" and path.parent.parent == results and path.is_file()
    assert re.fullmatch(r"quick-\d{8}T\d{6}Z", path.parent.name)
    return path


def test_the_report_table_has_the_readmes_columns(quick_report: Path):
    done = run(shown(README, "wiiide-lab report"), str(quick_report))
    assert done.returncode == 0, done.stderr
    header = next(line for line in done.stdout.splitlines() if "status" in line)
    readme = README.read_text(encoding="utf-8")
    table = readme[readme.index("| column | what it means |"):].split("\n\n")[0]
    conditional = ("#", "to target s", "samples/s vs ddp")  # with a target / with a ddp point in the report
    columns = [c for c in re.findall(r"^\| `([^`]+)`", table, re.MULTILINE) if c not in conditional]
    assert columns and all(column in header for column in columns), (columns, header)
    row = next(line for line in done.stdout.splitlines() if re.match(r"^0\s", line))
    assert "none" in row and " ok " in row


def test_export_writes_the_tables_as_csv(quick_report: Path, tmp_path: Path):
    shown(RESULTS, "wiiide-lab export REPORT [--format csv|parquet] [--table T ...] [--out DIR]")
    done = run("wiiide-lab export", str(quick_report.parent), "--format", "csv", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    written = {Path(line).name for line in done.stdout.splitlines()}
    assert written == {"repeats.csv", "nodes.csv", "stats.csv", "evals.csv"}
    repeats = pd.read_csv(tmp_path / "repeats.csv")
    assert len(repeats) == 1 and repeats["engine"].tolist() == ["sharded"] and repeats["link"].tolist() == ["none"]
    assert repeats["status"].tolist() == ["ok"] and (repeats["batches_per_s"] > 0).all()
    nodes = pd.read_csv(tmp_path / "nodes.csv")
    assert sorted(nodes["node"]) == ["coordinator", "worker-1", "worker-2", "worker-3", "worker-4"]
