"""`wiiide-lab sweep SPEC --dry-run` (harness.sweep.dry_run): the sweep's checks and a listing, nothing started."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from harness import REPO_ROOT
from harness.cli import main
from harness.errors import ClusterError
from harness.run.local import LocalBackend
from harness.spec.points import load_spec
from harness.sweep import run_sweep

EXPERIMENTS = REPO_ROOT / "experiments"


@pytest.fixture(autouse=True)
def no_process(monkeypatch):
    """A dry run starts no process: any Popen fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a dry run started a process: {args}")
    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.fixture
def engine_answers(monkeypatch):
    """As if a Docker engine answered, without asking one (the checks must not need it)."""
    import harness.run.docker_client as docker_client
    monkeypatch.setattr(docker_client, "engine_problem", lambda *a, **k: None)


def _dry_run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["sweep", *argv, "--dry-run"])
    out, err = capsys.readouterr()
    return code, out, err


def _point_rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if re.match(r"^\s*\d+\s{2,}", line)]


def _total_min(out: str) -> float:
    return float(re.search(r"runs, about ([\d.]+) min", out).group(1))


@pytest.mark.parametrize("name", ["quick", "seed-buffers", "recovery", "tls"])
def test_lists_every_point_of_a_valid_spec(capsys, name):
    path = EXPERIMENTS / f"{name}.yaml"
    backend = "docker" if name in ("seed-buffers", "quick") else "local"  # their links need a backend that shapes them
    code, out, _ = _dry_run(capsys, str(path), "--backend", backend)
    assert code == 0
    rows = _point_rows(out)
    assert [int(r.split()[0]) for r in rows] == [p.index for p in load_spec(path).points]
    assert "valid" in out.splitlines()[0] and f"{len(rows)} points" in out.splitlines()[0]


def test_more_repeats_estimate_more_time(capsys):
    spec, unshaped = str(EXPERIMENTS / "quick.yaml"), ("--only", "link=none")  # the local backend shapes no link
    _, one, _ = _dry_run(capsys, spec, "--backend", "local", *unshaped, "--repeats", "1")
    _, five, _ = _dry_run(capsys, spec, "--backend", "local", *unshaped, "--repeats", "5")
    assert _total_min(five) > _total_min(one) > 0
    assert re.search(r"^15 runs", five, re.M) and re.search(r"^3 runs", one, re.M)


def test_only_lists_the_selected_points(capsys):
    code, out, _ = _dry_run(capsys, str(EXPERIMENTS / "quick.yaml"), "--backend", "local", "--only",
                            "link=none", "--only", "engine=sharded")
    assert code == 0 and [" ".join(r.split()[1:3]) for r in _point_rows(out)] == ["link=none, engine=sharded"]


def test_a_bad_spec_exits_2_naming_the_file_and_the_field(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nbase: {num_workers: 2}\naxes:\n  sndbuf_bytes: [1MiB, 12]\n")
    code, out, err = _dry_run(capsys, str(bad), "--backend", "local")
    assert code == 2 and out == ""
    assert str(bad) in err and "sndbuf_bytes" in err


def test_what_the_backend_cannot_apply_fails_as_the_sweep_fails(capsys, tmp_path):
    path = EXPERIMENTS / "links.yaml"
    with pytest.raises(ClusterError) as sweep_error:
        run_sweep(load_spec(path), backend=LocalBackend(), results_dir=tmp_path, progress=lambda line: None)
    code, out, err = _dry_run(capsys, str(path), "--backend", "local")
    assert code == 1 and out == ""
    assert err.strip() == f"error: {sweep_error.value}"
    assert list(tmp_path.iterdir()) == []  # the sweep itself wrote nothing before refusing either


def test_the_docker_backends_checks_need_no_engine(capsys, engine_answers):
    code, out, _ = _dry_run(capsys, str(EXPERIMENTS / "links.yaml"), "--backend", "docker")
    assert code == 0 and "docker backend" in out.splitlines()[0]
    code, _, err = _dry_run(capsys, str(EXPERIMENTS / "overlay-encrypted.yaml"), "--backend", "docker")
    assert code == 1 and "overlay_encrypted" in err


def test_a_resume_folder_of_another_sweep_is_refused(capsys, tmp_path):
    code, _, err = _dry_run(capsys, str(EXPERIMENTS / "quick.yaml"), "--backend", "local", "--only", "link=none",
                            "--resume", str(tmp_path))
    assert code == 1 and str(tmp_path) in err
