"""wiiide.zygote: one forked child per run request, its exit code, log, start and exit files."""

from __future__ import annotations

import json
import os
import signal

from wiiide.zygote import (
    child_environ,
    exit_code_of,
    read_request,
    run_once,
    write_json_atomic,
)


def test_child_environ_replaces_the_containers_knobs_with_the_runs():
    base = {"PATH": "/usr/bin", "WIIIIIDE_NUM_WORKERS": "8", "WIIIIIDE_PORT": "29500", "NODE_ZYGOTE_SLOT": "worker-1"}
    env = child_environ(base, {"WIIIIIDE_NUM_WORKERS": "4", "WIIIIIDE_METRICS_DIR": "/results/r1/nodes"})
    assert env == {"PATH": "/usr/bin", "NODE_ZYGOTE_SLOT": "worker-1", "WIIIIIDE_NUM_WORKERS": "4",
                   "WIIIIIDE_METRICS_DIR": "/results/r1/nodes"}


def test_exit_code_of_signals_as_a_shell_reports_them():
    pid = os.fork()
    if pid == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert exit_code_of(status) == 137


def test_read_request_ignores_missing_and_malformed_files(tmp_path):
    assert read_request(tmp_path) is None
    (tmp_path / "request.json").write_text("{not json")
    assert read_request(tmp_path) is None
    write_json_atomic(tmp_path / "request.json", {"run_id": 3, "env": {}})
    assert read_request(tmp_path) is None
    write_json_atomic(tmp_path / "request.json", {"run_id": "r1", "env": {"WIIIIIDE_PORT": "1"}})
    assert read_request(tmp_path) == {"run_id": "r1", "env": {"WIIIIIDE_PORT": "1"}}


def test_run_once_forks_a_child_with_the_runs_config_and_records_its_end(tmp_path):
    # a knob no RunConfig has: the child's node refuses its configuration (exit 2), as a fresh process would
    request = {"run_id": "r7", "env": {"worker": {"WIIIIIDE_NO_SUCH_KNOB": "1"}, "coordinator": {}}}
    code = run_once("worker", "worker-3", request, tmp_path)
    run_dir = tmp_path / "runs" / "r7"
    assert code == 2
    end = json.loads((run_dir / "worker-3.exit.json").read_text())
    assert end["exit_code"] == 2 and end["started_at_utc"] <= end["finished_at_utc"]
    assert json.loads((run_dir / "worker-3.start.json").read_text())["started_at_utc"] == end["started_at_utc"]
    assert "no_such_knob" in (run_dir / "worker-3.log").read_text().lower()
