"""The machine's scheduler over a run's timed steps, from the kernel's sched tracepoints (tracefs).

A work-conserving scheduler never leaves a CPU idle while a thread waits to run. Linux's is not one
(Lozi et al., "The Linux Scheduler: a Decade of Wasted Cores", EuroSys 2016): a thread woken onto a busy
CPU's run queue may wait there while another CPU idles, until a load balance moves it. On these
2-vCPU machines, with a cgroup per container, 27-44 threads per node and about 10,000 wake-ups a
second, the round model's cores-bound points were 10-13 % slower than the cores allow
(studies/round-model/NOTE.md). `core_loss` measures that loss: the CPU time idle while a thread waited on another CPU's run queue, the
``lost_cores`` (core-seconds per second) that `harness.analysis.point_model` takes off the cores.

`SchedTrace` records ``sched_switch``, ``sched_wakeup``, ``sched_wakeup_new`` and
``sched_migrate_task`` in a tracefs instance of its own (``instances/wiiide-lab-<pid>``: the global
buffer and anyone else's tracing are untouched) on CLOCK_MONOTONIC (``trace_clock`` ``mono``), the
clock of the coordinator's timed window (``host_cpu_s``' ``start_monotonic_s``, `wiiide.metrics`).
It mounts tracefs when it is not, and unmounts what it mounted. It needs root. The kernel's own
documentation: Documentation/trace/ftrace.rst (instances, trace_clock, buffer_size_kb) and
Documentation/trace/events.rst.

Reading the trace: a ``sched_switch`` into a task from an idle CPU is not always in the trace (seen on
this machine's 6.18 kernel after a wake-up by IPI of an idle CPU: a later event shows the task on that
CPU with no switch into it). So a wake-up or a migration onto an idle CPU counts as that CPU running
the task from then on, and any event whose current task (its ``TASK-PID``) is not the one the CPU was
thought to run corrects it. The cost: a wake-up's latency on an idle CPU (microseconds) counts as busy.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from harness.errors import HarnessError

TRACEFS = Path("/sys/kernel/tracing")
EVENTS = ("sched_switch", "sched_wakeup", "sched_wakeup_new", "sched_migrate_task")
# Per CPU. A digits run on 2 CPUs writes about 1 MB a second of events; the ring keeps the newest, so the
# timed steps, at the end of a run, stay in it even when a long start-up overran it.
BUFFER_KB_PER_CPU = 65536

# "  <comm>-<pid> [<cpu>] <flags> <seconds>: <event>: <fields>", the trace file's default format
_LINE = re.compile(r"^\s*(?P<comm>.*?)-(?P<pid>\d+)\s+\[(?P<cpu>\d+)\]\s+\S+\s+"
                   r"(?P<ts>\d+\.\d+): (?P<event>\w+): (?P<rest>.*)$")
_FIELD = re.compile(r"(\w+)=(\S*)")


class SchedTraceError(HarnessError):
    """The scheduler trace cannot be had here (not root, no tracefs, a kernel without the events)."""


@dataclass(frozen=True)
class CoreLoss:
    """What the machine's CPUs did over one window (`core_loss`). Seconds are CPU-seconds, summed over
    the CPUs; ``lost_cores`` = ``idle_while_waiting_s / window_s``: the cores, of ``cpus``, the
    scheduler left idle while a thread waited for one."""

    window_s: float
    cpus: int
    idle_s: float  # a CPU ran its idle task
    idle_while_waiting_s: float  # ... while a thread waited on another CPU's run queue
    wakeups: int
    migrations: int
    switches: int

    @property
    def lost_cores(self) -> float:
        return self.idle_while_waiting_s / self.window_s if self.window_s > 0 else 0.0

    def to_dict(self) -> dict:
        """The report's ``sched`` of a repeat (JSON-ready)."""
        return {**asdict(self), "lost_cores": self.lost_cores}


def core_loss(lines: Iterable[str], start_s: float, end_s: float, cpus: int) -> CoreLoss:
    """The CPUs' idle time, and the part of it while a thread waited on another CPU's run queue, over
    [`start_s`, `end_s`] (the trace's clock, seconds) of the text of a tracefs ``trace`` file holding
    `EVENTS` (see the module docstring for the missing switches). Events before `start_s` set up the
    state; reading stops past `end_s`. A thread waits from its wake-up (onto a CPU running another
    task), or from being preempted (``sched_switch`` with ``prev_state`` R), until it runs; a migration
    moves its wait to the destination CPU.

    Raises:
        ValueError: `end_s` <= `start_s` or `cpus` < 1.
    """
    if end_s <= start_s or cpus < 1:
        raise ValueError(f"a window [{start_s}, {end_s}] on {cpus} CPUs")
    running = [0] * cpus  # pid on each CPU, 0: idle
    waiting: dict[int, int] = {}  # pid -> the CPU whose run queue it waits on
    idle_s = lost_s = 0.0
    wakeups = migrations = switches = 0
    t_prev: float | None = None

    def place(pid: int, target: int) -> None:  # a runnable thread onto `target`: an idle CPU runs it next
        if running[target] == 0:
            running[target] = pid
            waiting.pop(pid, None)
        else:
            waiting[pid] = target

    for line in lines:
        m = _LINE.match(line)
        if m is None:
            continue
        t, cpu = float(m["ts"]), int(m["cpu"])
        if cpu >= cpus:
            continue
        if t_prev is not None:
            a, b = max(t_prev, start_s), min(t, end_s)
            if b > a:
                queued = set(waiting.values())
                for c in range(cpus):
                    if running[c] == 0:
                        idle_s += b - a
                        if any(q != c for q in queued):
                            lost_s += b - a
        if t > end_s:
            break
        t_prev = t
        inside = t >= start_s
        current = int(m["pid"])
        if current and running[cpu] != current:  # a switch into it the trace did not show
            running[cpu] = current
            waiting.pop(current, None)
        fields = dict(_FIELD.findall(m["rest"].replace(" ==> ", " ")))
        event = m["event"]
        if event == "sched_switch":
            switches += inside
            prev, nxt = int(fields["prev_pid"]), int(fields["next_pid"])
            if prev and fields["prev_state"].startswith("R"):
                waiting[prev] = cpu
            waiting.pop(nxt, None)
            running[cpu] = nxt
        elif event in ("sched_wakeup", "sched_wakeup_new"):
            wakeups += inside
            pid, target = int(fields["pid"]), int(fields["target_cpu"])
            if pid not in running and target < cpus:
                place(pid, target)
        elif event == "sched_migrate_task":
            migrations += inside
            pid, dest = int(fields["pid"]), int(fields["dest_cpu"])
            if pid in waiting and dest < cpus:
                place(pid, dest)
    return CoreLoss(end_s - start_s, cpus, idle_s, lost_s, wakeups, migrations, switches)


class SchedTrace:
    """The sched events of the whole machine into a tracefs instance of this process, from `start` to
    `stop`; `lines` reads them; `close` removes the instance (and unmounts tracefs if it mounted it).
    A context manager: ``with SchedTrace() as trace: ...``.

    Raises (`start`):
        SchedTraceError: not root, tracefs cannot be mounted, or the kernel lacks an event.
    """

    def __init__(self, root: Path = TRACEFS, buffer_kb_per_cpu: int = BUFFER_KB_PER_CPU) -> None:
        self.root = Path(root)
        self.buffer_kb_per_cpu = buffer_kb_per_cpu
        self.instance = self.root / "instances" / f"wiiide-lab-{os.getpid()}"
        self._mounted = False
        self._made = False

    def __enter__(self) -> "SchedTrace":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        if os.geteuid() != 0:
            raise SchedTraceError("the scheduler trace needs root (tracefs); run as root or leave --sched-trace out")
        if not (self.root / "instances").is_dir():
            done = subprocess.run(["mount", "-t", "tracefs", "nodev", str(self.root)], capture_output=True, text=True)
            if done.returncode != 0 or not (self.root / "instances").is_dir():
                raise SchedTraceError(f"tracefs is not mounted at {self.root} and mounting it failed: "
                                      f"{(done.stderr or done.stdout).strip() or 'no instances/ after the mount'}")
            self._mounted = True
        missing = [e for e in EVENTS if not (self.root / "events" / "sched" / e).is_dir()]
        if missing:
            self.close()
            raise SchedTraceError(f"this kernel's tracefs has no sched events {missing}")
        try:
            self.instance.mkdir()
            self._made = True
            self._write("trace_clock", "mono")
            self._write("buffer_size_kb", str(self.buffer_kb_per_cpu))
            for event in EVENTS:
                self._write(f"events/sched/{event}/enable", "1")
            self._write("tracing_on", "1")
        except OSError as exc:
            self.close()
            raise SchedTraceError(f"setting up the trace instance {self.instance}: {exc}") from None

    def stop(self) -> None:
        """Stop recording (the events stay in the buffer for `lines`)."""
        if self._made:
            self._write("tracing_on", "0")

    def lines(self) -> Iterable[str]:
        """The recorded events as the ``trace`` file's text lines (header lines start with ``#``)."""
        with open(self.instance / "trace", encoding="utf-8", errors="replace") as fh:
            yield from fh

    def close(self) -> None:
        """Remove the instance (its buffer with it) and unmount tracefs if `start` mounted it; idempotent."""
        if self._made:
            try:
                self._write("tracing_on", "0")
            except OSError:
                pass
            try:
                self.instance.rmdir()
            except OSError:
                pass
            self._made = False
        if self._mounted:
            subprocess.run(["umount", str(self.root)], capture_output=True)
            self._mounted = False

    def _write(self, name: str, value: str) -> None:
        (self.instance / name).write_text(value + "\n")
