"""The sweep's progress display: plain lines (exact), the rich display rendered into a string, and
`run_sweep` driving a display through a fake backend (live updates from its coordinator log)."""

from __future__ import annotations

import io
import re
import threading
from pathlib import Path

import pytest
from rich.console import Console

import harness.present.progress as progress_mod
from harness.present.progress import (
    PlainProgress,
    RichProgress,
    RunInfo,
    SweepInfo,
    choose_progress,
    lossy_never_applied,
    result_line,
)
from harness.run.backend import RunResult
from harness.run.status import Training
from harness.spec.points import build_spec
from harness.sweep import run_sweep

INFO = SweepInfo("quick", 2, 2, "docker", 160.0, "/r/quick/report.json", "the coordinator container's log")
OK = {"status": "ok", "error": None,
      "totals": {"batches_per_s": 512.4, "goodput_bytes_per_s": 1_234_567.0, "test_accuracy": 0.9537}}
FAILED = {"status": "failed", "error": "worker 1: exit 1", "totals": {}}


class FakeClock:
    def __init__(self, t_s: float = 1000.0) -> None:
        self.t_s = t_s

    def __call__(self) -> float:
        return self.t_s


def test_plain_lines_exact():
    lines: list[str] = []
    clock = FakeClock()
    p = PlainProgress(lines.append, clock)
    p.start_sweep(INFO)
    run1 = RunInfo(1, 1, 1, {"compression": "none"}, 30.0)
    p.start_point(run1)
    p.live_update(Training(300, 512.0, 512.0, 500.0, "log"))  # no line per poll
    clock.t_s += 50.0
    p.end_point(run1, OK)
    run2 = RunInfo(2, 1, 2, {"compression": "none"}, 30.0)
    p.start_point(run2)
    clock.t_s += 70.0
    p.end_point(run2, FAILED)
    p.skip_point(2, {"compression": "zlib-1"})
    p.note("    running: 10 s of about 30 s, 3 containers up")
    p.end_sweep(True)
    assert lines == [
        "sweep quick: 2 points x 2 repeats on the docker backend, about 2.7 min; report: /r/quick/report.json",
        # before any run ended: the spec's estimate, 160 s / 4 runs x 4 runs left
        "[1/4] point 1/2 {'compression': 'none'} repeat 1/2, about 2.7 min left",
        "    ok: 512 batches/s, 1.23 MB/s goodput, held-out accuracy 95.4 %",
        # one run of 50 s done, 3 left
        "[2/4] point 1/2 {'compression': 'none'} repeat 2/2, about 2.5 min left",
        "    FAILED: worker 1: exit 1",
        "skipping point 2/2 {'compression': 'zlib-1'}: finished in the run resumed",
        "    running: 10 s of about 30 s, 3 containers up",
    ]
    assert p.clock.runs_done == 4 and p.clock.left_s() == 0.0


def test_a_sharded_run_names_the_partitions_its_link_probe_chose():
    ok = {"status": "ok", "totals": {"batches_per_s": 233, "goodput_bytes_per_s": 1.5e8, "test_accuracy": 0.922}}
    probed = {**ok, "nodes": {"coordinator": {"ps": {"partitions": 5, "ps_shards": 5,
                                                     "link_probe": {"rate_bps": 11_240e6}}}, "worker-1": {}}}
    assert result_line(probed) == ("    ok: 233 batches/s, 150.00 MB/s goodput, held-out accuracy 92.2 %; "
                                   "5 partitions over 5 shards (links probed at 11,240 Mbit/s)")
    fixed = {**ok, "nodes": {"coordinator": {"ps": {"partitions_per_shard": 8, "link_probe": None}}}}
    plain = "    ok: 233 batches/s, 150.00 MB/s goodput, held-out accuracy 92.2 %"
    assert result_line(fixed) == result_line(ok) == plain


def _lossy_run(policy, counts):
    node = {"compression_policy": {"policy": policy, "lossy_warmup_steps": 50}, "codec_counts": counts}
    return {"status": "ok", "totals": {"batches_per_s": 4, "goodput_bytes_per_s": 1e6, "validation_loss": 2.5},
            "nodes": {"coordinator": node, "worker-1": node}}


def test_a_fixed_lossy_codec_that_never_applied_is_named_in_the_result_line():
    uncompressed = _lossy_run("fixed:int8", {"none": 60})
    assert lossy_never_applied(uncompressed) == "fixed:int8"
    assert result_line(uncompressed).endswith("; WARNING: fixed:int8 never applied (no node sent a frame with it: "
                                              "the run ended within lossy_warmup_steps=50 uncompressed gradient "
                                              "messages; lower it or run longer)")
    # a block size is part of the name, not of the wire id the frames count under
    assert lossy_never_applied(_lossy_run("fixed:int8-256", {"none": 50, "int8": 10})) is None
    assert lossy_never_applied(_lossy_run("fixed:topk-0.01", {"topk": 3})) is None
    # lossless codecs and other policies have no warm-up to miss
    assert lossy_never_applied(_lossy_run("fixed:zstd-1", {"none": 60})) is None
    assert lossy_never_applied(_lossy_run("network-aware+lossy", {"none": 60})) is None
    assert "WARNING" not in result_line(_lossy_run("fixed:int4", {"none": 5, "int4": 40}))


def test_time_left_from_finished_runs_only():
    clock = FakeClock()
    p = PlainProgress(lambda line: None, clock)
    p.start_sweep(SweepInfo("s", 3, 1, "local", 30.0, "r.json"))
    p.skip_point(1, {})  # a skipped point takes no time: it does not enter the mean
    p.start_point(RunInfo(2, 2, 1, {}))
    clock.t_s += 40.0
    p.end_point(RunInfo(2, 2, 1, {}), OK)
    assert p.clock.left_s() == 40.0  # one run of 40 s left
    assert p.clock.elapsed_s() == 40.0


def render(p: RichProgress) -> str:
    console = Console(file=io.StringIO(), force_terminal=True, width=250)  # no line wrapped
    console.print(p.renderable())
    return console.file.getvalue()


def test_rich_display_rendered():
    out = io.StringIO()
    clock = FakeClock()
    p = RichProgress(Console(file=out, force_terminal=True, width=120), clock)
    p.start_sweep(INFO)
    run1 = RunInfo(1, 1, 1, {"compression": "none"}, 30.0)
    p.start_point(run1)
    clock.t_s += 12.0
    waiting = render(p)
    assert "0/4 runs" in waiting and "elapsed 0:00:12" in waiting and "left ~0:02:40" in waiting
    assert "no progress line yet in the coordinator container's log" in waiting
    p.live_update(Training(300, 512.3, 512.3, 470.0, "log"))
    p.live_update(Training())  # a failed read keeps the last figures
    shown = render(p)
    assert "running: point 1/2 {'compression': 'none'} repeat 1/2, 12 s of about 30 s" in shown
    assert "step 300, 512.3 batches/s" in shown and "\x1b[" in shown
    clock.t_s += 18.0
    p.end_point(run1, OK)
    done = render(p)
    assert "0/2 points" in done and "1/4 runs" in done and "left ~0:01:30" in done  # 30 s a run, 3 left
    assert "last: point 1/2 {'compression': 'none'} repeat 1/2: ok: 512 batches/s" in done
    assert "running:" not in done
    p.start_point(RunInfo(2, 1, 2, {"compression": "none"}, 30.0))
    clock.t_s += 20.0
    p.end_point(RunInfo(2, 1, 2, {"compression": "none"}, 30.0), FAILED)
    assert "1/2 points" in render(p) and "2/4 runs" in render(p) and "left ~0:00:50" in render(p)
    p.end_sweep(False)
    printed = out.getvalue()
    # each run's result is printed above the display and stays; the last frame stays on screen
    assert "point 1/2 {'compression': 'none'} repeat 1/2: ok: 512 batches/s, 1.23 MB/s goodput" in printed
    assert "point 1/2 {'compression': 'none'} repeat 2/2: FAILED: worker 1: exit 1" in printed
    assert "sweep incomplete" in printed and "report: /r/quick/report.json" in printed


def test_rich_display_without_live_source():
    p = RichProgress(Console(file=io.StringIO(), force_terminal=True, width=120), FakeClock())
    p.start_sweep(SweepInfo("s", 1, 1, "swarm", 20.0, "r.json", None))
    p.start_point(RunInfo(1, 1, 1, {}, 10.0))
    assert "no live figures on this backend" in render(p)
    p.end_sweep(True)


def test_choose_progress_by_stdout(monkeypatch):
    class Out(io.StringIO):
        def __init__(self, tty: bool) -> None:
            super().__init__()
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    monkeypatch.setattr(progress_mod.sys, "stdout", Out(False))
    assert isinstance(choose_progress(), PlainProgress)
    monkeypatch.setattr(progress_mod.sys, "stdout", Out(True))
    assert isinstance(choose_progress(), RichProgress)


class FakeLocalBackend:
    """A backend named ``local`` whose runs (through `fake_run_point`, patched in for
    `harness.run.loop.run_point`) write coordinator progress lines where the local backend does
    (<out>/logs/coordinator.log) and wait until the sweep's display saw them (a deadline, not a timing
    assertion)."""

    name = "local"

    def __init__(self, seen: threading.Event) -> None:
        self.seen = seen

    def describe(self) -> dict:
        return {"name": self.name}

    def check_cluster(self, cluster) -> None:
        pass

    def check_faults(self, faults) -> None:
        pass

    def teardown(self) -> None:
        pass


def fake_run_point(backend: FakeLocalBackend, cfg, out_dir: Path, timeout_s, progress, cluster=None,
                   faults=(), sched_trace=False) -> RunResult:
    logs = Path(out_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "coordinator.log").write_text(
        "2026-01-01 00:00:00,000 coordinator INFO step 100: loss 1.0, 2 workers, 40.0 batches/s\n"
        "2026-01-01 00:00:01,000 coordinator INFO step 200: loss 0.5, 2 workers, 60.0 batches/s\n")
    progress("    running: 1 s of about 1 s")
    assert backend.seen.wait(30), "the sweep never read the coordinator's progress lines"
    return RunResult("ok", None, 1.0, {}, {}, {}, str(logs))


class Recorder(PlainProgress):
    def __init__(self, seen: threading.Event) -> None:
        self.lines: list[str] = []
        self.updates: list[Training] = []
        self.ended: list[bool] = []
        self.seen = seen
        super().__init__(self.lines.append)

    def live_update(self, training: Training) -> None:
        self.updates.append(training)
        if training.step == 200:
            self.seen.set()

    def end_sweep(self, complete: bool) -> None:
        self.ended.append(complete)


def test_run_sweep_drives_the_display(tmp_path, monkeypatch):
    monkeypatch.setattr("harness.sweep.LIVE_POLL_S", 0.05)
    spec = build_spec({"name": "fake", "repeats": 1, "base": {"duration_s": 1},
                       "axes": {"compression": ["none", "zlib-1"]}}, "fake.yaml")
    seen = threading.Event()
    display = Recorder(seen)

    def run_point(backend, cfg, out_dir, timeout_s, progress, cluster=None, faults=(), sched_trace=False):
        seen.clear()
        return fake_run_point(backend, cfg, out_dir, timeout_s, progress, cluster, faults)

    backend = FakeLocalBackend(seen)
    monkeypatch.setattr("harness.sweep.run_point", run_point)
    path = run_sweep(spec, results_dir=tmp_path, progress=display, backend=backend)
    assert path.name == "report.json" and path.exists()
    assert re.match(r"sweep fake: 2 points x 1 repeats on the local backend, about [\d.]+ min; report: ", display.lines[0])
    assert display.lines[1].startswith("[1/2] point 1/2 {'compression': 'none'} repeat 1/1, about ")
    assert display.lines[2] == "    running: 1 s of about 1 s"
    assert display.lines[3] == "    ok: 0 batches/s, 0.00 MB/s goodput, held-out accuracy 0.0 %"
    assert display.lines[4].startswith("[2/2] point 2/2 {'compression': 'zlib-1'} repeat 1/1")
    live = [t for t in display.updates if t.step == 200]
    assert live and live[0].batches_per_s == pytest.approx(200.0)  # 100 steps in 1 s, 2 workers a step
    assert display.ended == [True]


def test_run_sweep_accepts_a_line_function(tmp_path, monkeypatch):
    monkeypatch.setattr("harness.sweep.run_point", fake_run_point)
    spec = build_spec({"name": "fake", "repeats": 1, "base": {"duration_s": 1},
                       "axes": {"compression": ["none"]}}, "fake.yaml")
    seen = threading.Event()
    seen.set()  # nothing to wait for
    lines: list[str] = []
    run_sweep(spec, results_dir=tmp_path, progress=lines.append, backend=FakeLocalBackend(seen))
    assert re.fullmatch(r"\[1/1\] point 1/1 \{'compression': 'none'\} repeat 1/1, about [\d.]+ min left", lines[1])
