"""`status`: reading a cluster (progress lines, Engine API samples, metrics files) and rendering it.

The Engine API samples in status_fixtures/ were recorded from a running 1 + 1 cluster
(``GET /containers/{id}/stats?stream=false``); the log lines are in `wiiide.log.TieredLog`'s format.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from harness.cli import main
from harness.errors import ClusterError
from harness.present.status import (
    network_rates,
    plain_status,
    status_view,
    watch_status,
)
from harness.run.status import (
    ClusterStatus,
    ContainerFigures,
    NodeStatus,
    Training,
    engine_time_s,
    figures_from_sample,
    live_training_source,
    log_file_training,
    parse_progress_lines,
    read_cluster_status,
)

FIXTURES = Path(__file__).parent / "status_fixtures"

COORDINATOR_LOG = """\
2026-11-23 07:58:20,101 coordinator INFO model [64]: 4810 parameters (19.2 KB of gradient); data digits: 1437 train / 360 test
2026-11-23 07:58:20,350 coordinator INFO listening on 0.0.0.0:29500 for 1 workers
2026-11-23 07:58:26,002 coordinator INFO worker 1 joined from 172.18.0.3:41234 (594aec105b7f); 1 of 1
2026-11-23 07:58:26,010 coordinator INFO training for 120 s
2026-11-23 07:58:31,676 coordinator INFO step 1500: loss 0.0146, 1 workers, 460.0 batches/s
2026-11-23 07:58:31,795 coordinator INFO step 1600: loss 0.0055, 1 workers, 473.3 batches/s
2026-11-23 07:58:33,403 coordinator INFO step 1700: loss 0.0250, 1 workers, 340.8 batches/s
2026-11-23 07:58:33,707 coordinator INFO step 1800: loss 0.0085, 1 workers, 340.1 batches/s
2026-11-23 07:58:33,831 coordinator INFO step 1900: loss 0.0184, 1 workers, 350.8 batches/s
"""

WORKER_LOG = """\
2026-11-23 07:58:30,835 worker[594aec105b7f] INFO step 1199: loss 0.0227
2026-11-23 07:58:31,052 worker[594aec105b7f] INFO step 1299: loss 0.0100
"""


def sample(name: str) -> dict:
    return json.loads((FIXTURES / f"stats_{name}.json").read_text())


# --- progress lines --------------------------------------------------------------------------------
def test_coordinator_lines_give_step_and_rates():
    t = parse_progress_lines(COORDINATOR_LOG.splitlines())
    assert t.step == 1900 and t.source == "log"
    # the last 5 progress lines: steps 1500 -> 1900 between 07:58:31.676 and 07:58:33.831 (2.155 s)
    assert t.steps_per_s == pytest.approx(400 / 2.155)
    assert t.batches_per_s == pytest.approx(400 / 2.155 * 1)  # 1 worker: one batch a step
    assert t.mean_batches_per_s == 350.8  # what the coordinator's last line says


def test_two_workers_double_the_batches_of_a_step():
    lines = ["2026-01-01 00:00:00,000 coordinator INFO step 100: loss 1.0, 2 workers, 10.0 batches/s",
             "2026-01-01 00:00:02,000 coordinator INFO step 200: loss 0.9, 2 workers, 20.0 batches/s"]
    t = parse_progress_lines(lines)
    assert (t.step, t.steps_per_s, t.batches_per_s, t.mean_batches_per_s) == (200, 50.0, 100.0, 20.0)


def test_worker_lines_rate_is_its_steps_per_s():
    t = parse_progress_lines(WORKER_LOG.splitlines())
    assert t.step == 1299
    assert t.steps_per_s == pytest.approx(100 / 0.217)
    assert t.batches_per_s == t.steps_per_s and t.mean_batches_per_s is None


def test_one_line_falls_back_to_the_logged_mean():
    t = parse_progress_lines(COORDINATOR_LOG.splitlines()[:5])
    assert (t.step, t.steps_per_s, t.batches_per_s) == (1500, None, 460.0)


def test_final_line_ends_the_run():
    lines = COORDINATOR_LOG.splitlines() + [
        "2026-11-23 08:00:26,400 coordinator INFO held-out accuracy 0.9611, loss 0.1270 after 50208 steps"]
    t = parse_progress_lines(lines)
    assert (t.step, t.steps_per_s, t.batches_per_s) == (50208, None, 350.8)


def test_silent_log_and_noise_give_nothing():
    noise = ["Traceback (most recent call last):", "  File \"x\", line 1", "step 5: loss 1",
             "2026-11-23 07:58:20,350 coordinator ERROR dropped worker 1: OSError: reset"]
    assert parse_progress_lines(noise) == Training()


def test_log_file_tail_skips_a_cut_first_line(tmp_path, monkeypatch):
    import harness.run.status as status
    path = tmp_path / "coordinator.log"
    path.write_text(COORDINATOR_LOG)
    assert log_file_training(path).step == 1900
    # a tail that starts mid-line: the cut line is not read as a (wrong) progress line
    monkeypatch.setattr(status, "LOG_TAIL_BYTES", len(COORDINATOR_LOG.splitlines()[-1]) + 30)
    t = log_file_training(path)
    assert (t.step, t.steps_per_s) == (1900, None)
    assert log_file_training(tmp_path / "missing.log") == Training()


def test_live_source_per_backend(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "coordinator.log").write_text(COORDINATOR_LOG)
    assert live_training_source("local", tmp_path)().step == 1900
    assert live_training_source("kubernetes", tmp_path) is None  # a backend without live figures
    assert callable(live_training_source("swarm", tmp_path))  # the coordinator task's log


# --- Engine API samples ----------------------------------------------------------------------------
def test_recorded_samples_with_docker_cli_formulas():
    coord = figures_from_sample(sample("coordinator"))
    # cpu: (3831198409 - 3739529372) / (1805400000000 - 1803300000000) * 2 online CPUs * 100
    assert coord.cpu_percent == pytest.approx(8.730, abs=1e-3)
    assert coord.memory_bytes == 291713024 - 8192  # usage - inactive_file
    assert (coord.net_rx_bytes, coord.net_tx_bytes) == (37212701, 53555533)
    assert coord.read_at_s == pytest.approx(engine_time_s("2026-11-23T07:58:33.877490Z"))
    worker = figures_from_sample(sample("worker"))
    assert worker.cpu_percent == pytest.approx(16.635, abs=1e-3)
    assert worker.memory_bytes == 156930048
    # the worker receives what the coordinator sends (within the second between the two reads)
    assert worker.net_rx_bytes == 45615563 and worker.net_tx_bytes == 31694166


def test_sample_of_a_stopped_container_has_no_figures():
    assert figures_from_sample({"read": "0001-01-01T00:00:00Z", "memory_stats": {}, "cpu_stats": {}}) is None


def test_engine_time():
    assert engine_time_s("1970-01-01T00:00:01.5Z") == 1.5
    assert engine_time_s("1970-01-01T01:00:00.000000001+01:00") == 0.0
    assert engine_time_s("0001-01-01T00:00:00Z") is None and engine_time_s("yesterday") is None


class FakeContainer:
    """What read_cluster_status uses of a docker SDK Container."""

    def __init__(self, name, service, number, status, log="", stats=None, exit_code=0, hostname="h",
                 results="/nowhere"):
        self.name, self.status, self._log, self._stats = name, status, log, stats
        self.labels = {"com.docker.compose.project": "wiiide-test", "com.docker.compose.service": service,
                       "com.docker.compose.container-number": str(number)}
        self.attrs = {"State": {"ExitCode": exit_code}, "Config": {"Hostname": hostname},
                      "Mounts": [{"Type": "bind", "Source": results, "Destination": "/results"}]}

    def logs(self, stdout=True, stderr=True, tail=None):
        return self._log.encode()

    def stats(self, stream=True):
        assert stream is False
        return self._stats


class FakeClient:
    def __init__(self, containers):
        self._containers = containers
        self.containers = self
        self.filters = None

    def list(self, all=False, filters=None):
        self.filters = filters
        return list(self._containers)


def test_read_cluster_status_from_fake_engine(tmp_path):
    (tmp_path / "nodes").mkdir()
    (tmp_path / "nodes" / "worker-2.json").write_text(json.dumps(
        {"role": "worker", "node_id": "w2host", "steps": 777, "batches_per_s": 55.5}))
    client = FakeClient([
        FakeContainer("p-worker-2", "worker", 2, "exited", hostname="w2host", exit_code=0, results=str(tmp_path)),
        FakeContainer("p-worker-1", "worker", 1, "running", WORKER_LOG, sample("worker"), results=str(tmp_path)),
        FakeContainer("p-coordinator-1", "coordinator", 1, "running", COORDINATOR_LOG, sample("coordinator"),
                      results=str(tmp_path)),
    ])
    status = read_cluster_status(client, "wiiide-test")
    assert client.filters == {"label": "com.docker.compose.project=wiiide-test"}
    assert [n.node for n in status.nodes] == ["coordinator", "worker-1", "worker-2"]
    coord, w1, w2 = status.nodes
    assert coord.training.step == 1900 and coord.figures.net_tx_bytes == 53555533
    assert w1.training.step == 1299 and w1.figures.memory_bytes == 156930048 and w1.exit_code is None
    # an ended node: its metrics file, no stats
    assert (w2.state, w2.exit_code, w2.figures) == ("exited", 0, None)
    assert (w2.training.step, w2.training.batches_per_s, w2.training.source) == (777, 55.5, "metrics")
    assert status.running and status.results_dir == str(tmp_path)


def test_no_container_is_an_empty_status():
    status = read_cluster_status(FakeClient([]), "wiiide-test")
    assert status.nodes == [] and not status.running


# --- rendering -------------------------------------------------------------------------------------
def snapshot(taken_at_s=100.0, coord_rx=37212701, coord_tx=53555533, read_at_s=None, state="running"):
    coord = NodeStatus("p-coordinator-1", "coordinator", "coordinator", state, None,
                       Training(1900, 185.6, 185.6, 350.8, "log"),
                       ContainerFigures(8.73, 291704832, coord_rx, coord_tx, read_at_s))
    worker = NodeStatus("p-worker-1", "worker-1", "worker", "exited", 137, Training(1299, None, None, None, "log"), None)
    return ClusterStatus("wiiide-test", taken_at_s, [coord, worker], "/r")


def test_network_rates_use_the_engine_sample_times():
    before, after = snapshot(100.0, read_at_s=50.0), snapshot(103.0, 37212701 + 4_000_000, 53555533 + 2_000_000, 52.0)
    assert network_rates(before, after) == {"p-coordinator-1": (2_000_000.0, 1_000_000.0)}
    # without engine times, the snapshots' own
    assert network_rates(snapshot(100.0), snapshot(104.0, 37212701 + 4_000_000, 53555533)) == {
        "p-coordinator-1": (1_000_000.0, 0.0)}
    # counters that went back (a restarted container): no rate
    assert network_rates(snapshot(100.0), snapshot(104.0, 1, 1)) == {}
    assert network_rates(None, snapshot()) == {}


def test_plain_status_exact_text():
    before, after = snapshot(100.0, read_at_s=50.0), snapshot(103.0, 37212701 + 4_000_000, 53555533 + 2_000_000, 52.0)
    lines = plain_status(after, before).splitlines()
    assert lines[0] == "project wiiide-test: 1 coordinator + 1 worker, 1 running; node metrics in /r/nodes"
    assert lines[1].split() == ["node", "container", "state", "step", "batches/s", "steps/s", "CPU", "%", "memory",
                                "MiB", "net", "rx", "MB", "net", "tx", "MB", "rx", "MB/s", "tx", "MB/s"]
    assert lines[2].split() == ["coordinator", "p-coordinator-1", "running", "1900", "185.6", "185.6", "8.7",
                                "278.2", "41.21", "55.56", "2.00", "1.00"]
    assert lines[3].split() == ["worker-1", "p-worker-1", "exited", "(137)", "1299", "-", "-", "-", "-", "-",
                                "-", "-", "-"]
    assert "\x1b" not in plain_status(after)


def test_terminal_view_compact_and_wide():
    for width, expect in ((80, "41.2/55.6"), (160, "p-coordinator-1")):
        console = Console(file=io.StringIO(), force_terminal=True, width=width)
        before = snapshot(100.0, read_at_s=50.0)
        console.print(status_view(snapshot(103.0, 37212701 + 4_000_000, 53555533 + 2_000_000, 52.0), before, width))
        out = console.file.getvalue()
        assert "\x1b[" in out  # colours and styles
        assert expect in out and "1900" in out and "exited" in out
    compact = Console(file=io.StringIO(), width=80, color_system=None)
    compact.print(status_view(snapshot(), None, 80))
    assert max(len(line) for line in compact.file.getvalue().splitlines()) <= 80
    assert "…" not in compact.file.getvalue()  # nothing cut at 80 columns


def test_watch_once_and_until_the_cluster_ends():
    console = Console(file=io.StringIO(), width=200)  # not a terminal: plain text
    assert watch_status(lambda: snapshot(), console, once=True) == 0
    assert console.file.getvalue().count("project wiiide-test") == 1
    reads = iter([snapshot(100.0), snapshot(102.0), snapshot(104.0, state="exited")])
    sleeps = []
    console = Console(file=io.StringIO(), width=200)
    assert watch_status(lambda: next(reads), console, interval_s=2.0, sleep=sleeps.append) == 0
    out = console.file.getvalue()
    assert out.count("project wiiide-test") == 3 and sleeps == [2.0, 2.0]
    assert "0 running" in out.split("project wiiide-test")[-1]


def test_watch_live_on_a_terminal():
    reads = iter([snapshot(100.0, read_at_s=50.0), snapshot(103.0, 37212701 + 4_000_000, 53555533, 52.0, "exited")])
    console = Console(file=io.StringIO(), force_terminal=True, width=160)
    assert watch_status(lambda: next(reads), console, interval_s=1.0, sleep=lambda s: None) == 0
    assert "2.00" in console.file.getvalue()  # the rate between the two snapshots was drawn


def test_watch_without_cluster_raises():
    with pytest.raises(ClusterError, match="no cluster of project wiiide-test is running"):
        watch_status(lambda: ClusterStatus("wiiide-test", 0.0), Console(file=io.StringIO()))


def test_cli_rejects_a_bad_interval(capsys):
    assert main(["status", "--interval-s", "0"]) == 2
    assert "--interval-s must be > 0" in capsys.readouterr().err


def test_final_line_of_a_classifier_and_of_a_language_model():
    from harness.run.status import _FINAL_LINE
    from wiiide.training.model import ClassificationEval, LanguageModelEval

    for result in (ClassificationEval(0.9611, 0.127), LanguageModelEval(2.1092, 8.242, 8192)):
        line = f"2026-11-23 08:00:26,400 coordinator INFO held-out {result.log_text()} after 50208 steps"
        assert _FINAL_LINE.search(line)["step"] == "50208"
