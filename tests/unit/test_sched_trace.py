"""The scheduler trace: the cores left idle while threads waited (`harness.analysis.sched_trace`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.analysis.sched_trace import TRACEFS, CoreLoss, SchedTrace, SchedTraceError, core_loss


def _switch(t: float, cpu: int, prev: int, state: str, nxt: int) -> str:
    prev_comm = "swapper/%d" % cpu if prev == 0 else f"t{prev}"
    next_comm = "swapper/%d" % cpu if nxt == 0 else f"t{nxt}"
    task = "<idle>-0" if prev == 0 else f"t{prev}-{prev}"
    return (f"  {task:>16} [{cpu:03d}] d..2. {t:.6f}: sched_switch: prev_comm={prev_comm} prev_pid={prev} "
            f"prev_prio=120 prev_state={state} ==> next_comm={next_comm} next_pid={nxt} next_prio=120\n")


def _wakeup(t: float, cpu: int, current: int, pid: int, target: int, new: bool = False) -> str:
    task = "<idle>-0" if current == 0 else f"t{current}-{current}"
    event = "sched_wakeup_new" if new else "sched_wakeup"
    return f"  {task:>16} [{cpu:03d}] dNh2. {t:.6f}: {event}: comm=t{pid} pid={pid} prio=120 target_cpu={target:03d}\n"


def _migrate(t: float, cpu: int, current: int, pid: int, orig: int, dest: int) -> str:
    task = "<idle>-0" if current == 0 else f"t{current}-{current}"
    return (f"  {task:>16} [{cpu:03d}] d..3. {t:.6f}: sched_migrate_task: comm=t{pid} pid={pid} prio=120 "
            f"orig_cpu={orig} dest_cpu={dest}\n")


HEADER = ["# tracer: nop\n", "#\n", "#           TASK-PID     CPU#  |||||  TIMESTAMP  FUNCTION\n"]


def test_a_cpu_idle_while_a_preempted_thread_waits_on_the_other_loses_that_time():
    """CPU 0 runs thread 10, CPU 1 goes idle at 1.0 s. At 1.2 s thread 11 preempts 10 on CPU 0, so 10
    waits there while CPU 1 idles, until a balance moves it to CPU 1 at 1.5 s; 10 sleeps at 1.8 s.
    Over [1.0, 2.0]: CPU 1 idled 0.5 + 0.2 s, 0.3 s of it lost; CPU 0 never idled."""
    lines = HEADER + [
        _switch(0.5, 0, 0, "R", 10),
        _switch(1.0, 1, 20, "S", 0),
        _wakeup(1.2, 0, 10, 11, 0),
        _switch(1.2, 0, 10, "R+", 11),
        _migrate(1.5, 1, 0, 10, 0, 1),
        _switch(1.8, 1, 10, "S", 0),
        _switch(2.5, 0, 11, "S", 0),
    ]
    loss = core_loss(lines, 1.0, 2.0, 2)
    assert loss.idle_s == pytest.approx(0.7)
    assert loss.idle_while_waiting_s == pytest.approx(0.3)
    assert loss.lost_cores == pytest.approx(0.3)
    assert (loss.wakeups, loss.migrations, loss.switches) == (1, 1, 3)
    assert loss.to_dict()["lost_cores"] == pytest.approx(0.3) and loss.to_dict()["cpus"] == 2


def test_idle_with_nothing_waiting_is_no_loss_and_the_window_cuts_the_time():
    """Both CPUs idle from 0.0 s; thread 5 is woken onto CPU 0 at 3.0 s (an idle CPU: it runs at once,
    even if the trace shows no switch into it) and sleeps at 3.5 s. Over [1.0, 4.0]: 6 s of CPU time,
    5.5 s idle, none of it while a thread waited."""
    lines = HEADER + [
        _switch(0.0, 0, 7, "S", 0),
        _switch(0.0, 1, 8, "S", 0),
        _wakeup(3.0, 0, 0, 5, 0),
        _switch(3.5, 0, 5, "S", 0),
        _switch(4.5, 1, 0, "R", 9),
    ]
    loss = core_loss(lines, 1.0, 4.0, 2)
    assert loss.window_s == 3.0 and loss.idle_s == pytest.approx(5.5) and loss.idle_while_waiting_s == 0.0
    assert loss.wakeups == 1 and loss.switches == 1  # the switches at 0.0 s and 4.5 s are outside


def test_a_thread_woken_onto_a_busy_cpu_while_the_other_idles_is_lost_time_until_it_runs():
    """Thread 3 is woken at 2.0 s onto CPU 0, which runs thread 1 until 2.4 s; CPU 1 idles all along.
    A later event of thread 2 on CPU 1 (no switch into it shown) ends CPU 1's idle at 2.6 s."""
    lines = HEADER + [
        _switch(1.0, 0, 0, "R", 1),
        _switch(1.0, 1, 6, "S", 0),
        _wakeup(2.0, 0, 1, 3, 0),
        _switch(2.4, 0, 1, "S", 3),
        _wakeup(2.6, 1, 2, 4, 0),  # CPU 1 runs thread 2 now
        _switch(3.0, 0, 3, "S", 0),
    ]
    loss = core_loss(lines, 1.5, 3.0, 2)
    assert loss.idle_while_waiting_s == pytest.approx(0.4)  # 2.0 .. 2.4 s
    assert loss.idle_s == pytest.approx(1.1)  # CPU 1 from 1.5 to 2.6 s
    assert isinstance(loss, CoreLoss)


def test_a_window_of_no_length_or_no_cpu_is_refused():
    with pytest.raises(ValueError):
        core_loss(HEADER, 2.0, 2.0, 2)
    with pytest.raises(ValueError):
        core_loss(HEADER, 1.0, 2.0, 0)


def test_not_root_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SchedTraceError, match="needs root"):
        SchedTrace(Path("/nonexistent")).start()


@pytest.mark.skipif(os.geteuid() != 0 or not TRACEFS.exists(), reason="needs root and a kernel with tracefs")
def test_the_trace_of_this_machine_sees_two_busy_processes_and_leaves_nothing_behind():
    """Three processes that each burn 0.4 s of CPU on this machine's CPUs: the trace of its own instance
    holds their switches; closing removes the instance, and a tracefs the trace mounted is unmounted."""
    mounted_before = (TRACEFS / "instances").is_dir()
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
    with SchedTrace(buffer_kb_per_cpu=4096) as trace:
        assert trace.instance.is_dir()
        start = time.monotonic()
        procs = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(3)]
        pids = {p.pid for p in procs}
        for p in procs:
            p.wait()
        end = time.monotonic()
        trace.stop()
        lines = list(trace.lines())
        loss = core_loss(lines, start, end, os.cpu_count() or 1)
    assert not trace.instance.exists()
    assert (TRACEFS / "instances").is_dir() == mounted_before
    seen = {int(part.split("=")[1]) for line in lines for part in line.split() if part.startswith("next_pid=")}
    assert pids & seen  # the burners were switched in
    assert loss.switches > 0 and loss.window_s == pytest.approx(end - start)
    assert 0.0 <= loss.idle_while_waiting_s <= loss.idle_s <= loss.window_s * loss.cpus


def test_a_run_is_measured_over_its_coordinators_timed_window_or_says_why_not():
    """`timed_core_loss` cuts the trace to the coordinator's ``host_cpu_s`` bounds on CLOCK_MONOTONIC; a
    run without them (failed, or nodes from before 2026-11-28) or an unreadable trace gets an error."""
    from harness.run.loop import timed_core_loss

    class Trace:
        def __init__(self, lines):
            self._lines = lines

        def lines(self):
            return iter(self._lines)

    lines = HEADER + [_switch(0.5, 0, 0, "R", 10), _switch(1.0, 1, 20, "S", 0), _wakeup(1.2, 0, 10, 11, 0),
                      _switch(1.2, 0, 10, "R+", 11), _migrate(1.5, 1, 0, 10, 0, 1), _switch(2.5, 0, 11, "S", 0)]
    window = {"start_monotonic_s": 1.0, "end_monotonic_s": 2.0}
    sched = timed_core_loss(Trace(lines), {"coordinator": {"host_cpu_s": window}})
    assert sched["window_s"] == 1.0 and sched["idle_while_waiting_s"] == pytest.approx(0.3)
    assert "error" in timed_core_loss(Trace(lines), {"coordinator": {"host_cpu_s": None}})
    assert "error" in timed_core_loss(Trace(lines), {})
    broken = HEADER + ["  t1-1 [000] d..2. 1.100000: sched_switch: prev_comm=t1 prev_pid=1 ==> next_pid=2\n"]
    assert "KeyError" in timed_core_loss(Trace(broken), {"coordinator": {"host_cpu_s": window}})["error"]
