"""How a sweep shows its progress: plain lines (CI, pipes) or a live `rich` display (a terminal).

`harness.sweep.run_sweep` calls one `SweepProgress` in this order::

    start_sweep(info)
    for every run (a repeat of a point):  start_point(run)  live_update(training)*  end_point(run, record)
    (skip_point(...) for a point a resumed run had finished; note(line) for any other message)
    end_sweep(complete)

`PlainProgress` writes the lines the sweep has always written (one function call per line);
`RichProgress` draws points done/total, repeats, elapsed, time left and the running point's live
batches/s with `rich.live.Live`, and prints each run's result above it. `choose_progress` picks
one by `sys.stdout.isatty()`.

Time left is estimated from the runs finished in this sweep (their mean wall time times the runs
left); before the first one ends, from the spec's own estimate (each point's duration + 10 s).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Protocol

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from harness.run.status import Training
from wiiide.codecs.registry import codec_from_name

Emit = Callable[[str], None]


@dataclass(frozen=True)
class SweepInfo:
    """What a sweep is about to run.

    Attributes:
        name: the spec's name.
        points: number of points; repeats: runs per point; runs_total = points * repeats.
        backend: the backend's name (``docker``, ``local``).
        estimate_s: the spec's estimate of the whole sweep, seconds (sum of durations + 10 s a run).
        report_path: where the report is written (str).
        live_source: what the running point's live figures are read from (None: the backend has none).
    """

    name: str
    points: int
    repeats: int
    backend: str
    estimate_s: float
    report_path: str
    live_source: str | None = None

    @property
    def runs_total(self) -> int:
        """points * repeats."""
        return self.points * self.repeats


@dataclass(frozen=True)
class RunInfo:
    """One run: repeat `repeat` (1-based) of point `point` (1-based), the `run`-th of the sweep (1-based).

    Attributes:
        params: the point's parameters (axis name -> value), as the report records them.
        duration_s: the point's training duration, seconds (for "s of about ... s").
    """

    run: int
    point: int
    repeat: int
    params: dict[str, Any]
    duration_s: float = 0.0


class SweepProgress(Protocol):
    """What `run_sweep` tells its display. Implementations never raise from these calls."""

    def start_sweep(self, info: SweepInfo) -> None:
        """The sweep starts: `info` says how many points and repeats, on what backend."""

    def note(self, line: str) -> None:
        """Any other message (backend selection, image build, a run's ``running: ...`` line)."""

    def skip_point(self, point: int, params: dict[str, Any]) -> None:
        """Point `point` (1-based) was finished in the run resumed: its repeats count as done."""

    def start_point(self, run: RunInfo) -> None:
        """A run starts."""

    def live_update(self, training: Training) -> None:
        """The running point's coordinator reported progress (step, batches/s)."""

    def end_point(self, run: RunInfo, record: dict[str, Any]) -> None:
        """A run ended; `record` is the repeat as the report stores it (``status``, ``error``, ``totals``)."""

    def end_sweep(self, complete: bool) -> None:
        """The sweep ended (complete, or interrupted / failed when False); the display is closed."""


class RunClock:
    """Elapsed time and time left of a sweep, from the runs that finished.

    Args:
        clock: a monotonic clock in seconds (default `time.monotonic`; tests pass a fake).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.t0_s = clock()
        self.info: SweepInfo | None = None
        self.runs_done = 0  # finished here or in the run resumed
        self.run_times_s: list[float] = []  # wall time of each run finished in this sweep
        self.run_started_s: float | None = None

    def start(self, info: SweepInfo) -> None:
        """Start timing the sweep `info`."""
        self.info, self.t0_s = info, self._clock()

    def elapsed_s(self) -> float:
        """Seconds since `start`."""
        return self._clock() - self.t0_s

    def run_elapsed_s(self) -> float:
        """Seconds since the running run started (0 when none runs)."""
        return 0.0 if self.run_started_s is None else self._clock() - self.run_started_s

    def left_s(self) -> float:
        """Seconds left: the mean wall time of the runs finished in this sweep times the runs left, or,
        before any finished, the spec's estimate per run (``estimate_s / runs_total``) times the runs left."""
        if self.info is None:
            return 0.0
        runs_left = max(0, self.info.runs_total - self.runs_done)
        if self.run_times_s:
            per_run_s = sum(self.run_times_s) / len(self.run_times_s)
        else:
            per_run_s = self.info.estimate_s / max(1, self.info.runs_total)
        return per_run_s * runs_left

    def begin_run(self) -> None:
        """A run starts now."""
        self.run_started_s = self._clock()

    def end_run(self) -> None:
        """The running run ended: it counts as done and its wall time enters the estimate."""
        if self.run_started_s is not None:
            self.run_times_s.append(self._clock() - self.run_started_s)
        self.run_started_s = None
        self.runs_done += 1


def result_line(record: dict[str, Any]) -> str:
    """The one line a finished run gets: ``    ok: <batches/s>, <goodput MB/s>, <accuracy %>`` (a language
    model: ``validation loss <nats>``) or ``    FAILED: <error>`` (goodput in MB/s = 1e6 bytes/s; accuracy
    of the held-out split, %). A sharded run whose coordinator probed its links (``partitions_per_shard:
    auto``, `wiiide.server.ps.link_probe`) adds ``; <n> partitions over <k> shards (links probed at <Mbit/s>)``."""
    totals = record.get("totals") or {}
    if record.get("status") == "ok":
        return (f"    ok: {totals.get('batches_per_s') or 0:.0f} batches/s, "
                f"{(totals.get('goodput_bytes_per_s') or 0) / 1e6:.2f} MB/s goodput, "
                + (f"validation loss {totals['validation_loss']:.3f}" if totals.get("validation_loss") is not None
                 else f"held-out accuracy {100 * (totals.get('test_accuracy') or 0):.1f} %") + _pieces_note(record)
                + _lossy_note(record))
    return f"    FAILED: {record.get('error')}"


def lossy_never_applied(record: dict[str, Any]) -> str | None:
    """The fixed lossy codec (``fixed:<codec>``, e.g. ``int8``) a run's nodes were given and none of them
    sent a frame with, or None (no fixed lossy codec, or one that applied).

    A lossy codec waits for ``lossy_warmup_steps`` uncompressed gradient messages
    (`wiiide.codecs.policy`), so a run shorter than that compresses nothing and measures the fp32
    server under a lossy codec's name. Read from the nodes' ``compression_policy`` and ``codec_counts``
    (frames sent by wire id) in the run's metrics.
    """
    nodes = [n for n in (record.get("nodes") or {}).values() if isinstance(n, dict)]
    policies = {(n.get("compression_policy") or {}).get("policy") for n in nodes}
    fixed = [p for p in policies if isinstance(p, str) and p.startswith("fixed:")]
    if len(fixed) != 1:
        return None
    try:
        codec = codec_from_name(fixed[0].removeprefix("fixed:"))
    except ValueError:
        return None
    if codec.lossless:
        return None
    sent = any((n.get("codec_counts") or {}).get(codec.wire_id) for n in nodes)
    return None if sent else fixed[0]


def _lossy_note(record: dict[str, Any]) -> str:
    name = lossy_never_applied(record)
    if name is None:
        return ""
    warmup = next((n["compression_policy"].get("lossy_warmup_steps") for n in record["nodes"].values()
                   if isinstance(n, dict) and n.get("compression_policy")), None)
    return (f"; WARNING: {name} never applied (no node sent a frame with it: the run ended within "
            f"lossy_warmup_steps={warmup} uncompressed gradient messages; lower it or run longer)")


def _pieces_note(record: dict[str, Any]) -> str:
    ps = (((record.get("nodes") or {}).get("coordinator") or {}).get("ps")) or {}
    probe = ps.get("link_probe")
    if not isinstance(probe, dict) or not isinstance(probe.get("rate_bps"), (int, float)):
        return ""
    rate_mbps, shards = probe["rate_bps"] / 1e6, ps.get("ps_shards")
    return f"; {ps.get('partitions')} partitions over {shards} shards (links probed at {rate_mbps:,.0f} Mbit/s)"


def sweep_line(info: SweepInfo) -> str:
    """The sweep's first line: points x repeats, backend, estimate in minutes, the report's path."""
    return (f"sweep {info.name}: {info.points} points x {info.repeats} repeats on the {info.backend} "
            f"backend, about {info.estimate_s / 60:.1f} min; report: {info.report_path}")


def run_line(info: SweepInfo, run: RunInfo, left_s: float) -> str:
    """``[run/total] point p/points {params} repeat r/repeats, about <minutes> min left``."""
    return (f"[{run.run}/{info.runs_total}] point {run.point}/{info.points} {run.params} "
            f"repeat {run.repeat}/{info.repeats}, about {left_s / 60:.1f} min left")


class PlainProgress:
    """The sweep's plain lines, one `emit(line)` each (default: stderr, flushed). Live updates are not
    printed (a pipe gets no line per poll); the backend's own ``running: ...`` lines still come as notes.

    Args:
        emit: where each line goes.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(self, emit: Emit | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.emit = emit or _stderr_line
        self.clock = RunClock(clock)

    def start_sweep(self, info: SweepInfo) -> None:
        """Print `sweep_line`."""
        self.clock.start(info)
        self.emit(sweep_line(info))

    def note(self, line: str) -> None:
        """Print `line` as it is."""
        self.emit(line)

    def skip_point(self, point: int, params: dict[str, Any]) -> None:
        """Print that the point is skipped; its repeats count as done."""
        assert self.clock.info is not None
        self.clock.runs_done += self.clock.info.repeats
        self.emit(f"skipping point {point}/{self.clock.info.points} {params}: finished in the run resumed")

    def start_point(self, run: RunInfo) -> None:
        """Print `run_line` with the time left."""
        assert self.clock.info is not None
        self.emit(run_line(self.clock.info, run, self.clock.left_s()))
        self.clock.begin_run()

    def live_update(self, training: Training) -> None:
        """Nothing: plain output gets no line per poll."""

    def end_point(self, run: RunInfo, record: dict[str, Any]) -> None:
        """Print `result_line`."""
        self.clock.end_run()
        self.emit(result_line(record))

    def end_sweep(self, complete: bool) -> None:
        """Nothing to close."""


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _hms(seconds: float) -> str:
    return str(timedelta(seconds=int(max(0.0, seconds))))


@dataclass
class _Running:
    run: RunInfo
    training: Training = field(default_factory=Training)


class RichProgress:
    """A live display on a terminal: a bar of runs done, repeats, elapsed, time left, and the running
    point with its coordinator's step and batches/s; each run's result line is printed above it.

    Args:
        console: where to draw (default: a `rich.console.Console` on stdout).
        clock: monotonic seconds (tests pass a fake).
        refresh_per_second: redraws a second while running.
    """

    def __init__(self, console: Console | None = None, clock: Callable[[], float] = time.monotonic,
                 refresh_per_second: float = 2.0) -> None:
        self.console = console or Console()
        self.clock = RunClock(clock)
        self._running: _Running | None = None
        self._last: str | None = None
        self._live = Live(get_renderable=self.renderable, console=self.console,
                          refresh_per_second=refresh_per_second, transient=False, redirect_stdout=False,
                          redirect_stderr=False)

    def renderable(self) -> Group:
        """What the display shows now (a `rich.console.Group`); `Live` redraws it."""
        info = self.clock.info
        if info is None:
            return Group(Text("sweep starting"))
        done, total = self.clock.runs_done, info.runs_total
        head = Table.grid(padding=(0, 1))
        head.add_row(Text(f"sweep {info.name}", style="bold"),
                     Text(f"{info.points} points x {info.repeats} repeats on the {info.backend} backend"))
        bar = Table.grid(padding=(0, 2))
        bar.add_row(ProgressBar(total=max(1, total), completed=done, width=30),
                    Text(f"{done // max(1, info.repeats)}/{info.points} points"), Text(f"{done}/{total} runs"),
                    Text(f"elapsed {_hms(self.clock.elapsed_s())}"),
                    Text(f"left ~{_hms(self.clock.left_s())}", style="cyan"))
        rows: list[Any] = [head, bar]
        if self._running is not None:
            run, training = self._running.run, self._running.training
            text = Text(f"running: point {run.point}/{info.points} {run.params} repeat {run.repeat}/{info.repeats}"
                        f", {self.clock.run_elapsed_s():.0f} s")
            if run.duration_s:
                text.append(f" of about {run.duration_s:.0f} s")
            text.append(" · ")
            text.append_text(_training_text(training, info.live_source))
            rows.append(text)
        if self._last:
            rows.append(Text(f"last: {self._last.strip()}", style="dim"))
        rows.append(Text(f"report: {info.report_path}", style="dim"))
        return Group(*rows)

    def start_sweep(self, info: SweepInfo) -> None:
        """Start drawing."""
        self.clock.start(info)
        self._live.start()

    def note(self, line: str) -> None:
        """Print `line` above the display."""
        self._live.console.print(Text(line))

    def skip_point(self, point: int, params: dict[str, Any]) -> None:
        """Count the point's repeats as done; print that it is skipped."""
        assert self.clock.info is not None
        self.clock.runs_done += self.clock.info.repeats
        self.note(f"skipping point {point}/{self.clock.info.points} {params}: finished in the run resumed")

    def start_point(self, run: RunInfo) -> None:
        """Show `run` as running (no live figures yet)."""
        self.clock.begin_run()
        self._running = _Running(run)
        self._live.refresh()

    def live_update(self, training: Training) -> None:
        """Show the running point's latest step and batches/s."""
        if self._running is not None and training.source != "none":
            self._running.training = training

    def end_point(self, run: RunInfo, record: dict[str, Any]) -> None:
        """Print the run's result above the display; count it done."""
        self.clock.end_run()
        self._running = None
        assert self.clock.info is not None
        self._last = (f"point {run.point}/{self.clock.info.points} {run.params} repeat "
                      f"{run.repeat}/{self.clock.info.repeats}:{result_line(record)[3:]}")
        self.note(self._last)
        self._live.refresh()

    def end_sweep(self, complete: bool) -> None:
        """Draw the last state and stop the display (it stays on screen)."""
        self._running = None
        self._live.stop()
        if not complete:
            self.console.print(Text("sweep incomplete: the report keeps every finished run", style="yellow"))


def _training_text(training: Training, live_source: str | None) -> Text:
    if live_source is None:
        return Text("no live figures on this backend", style="dim")
    if training.source == "none":
        return Text(f"no progress line yet in {live_source} (one every log_every_steps steps at log_tier "
                    "normal or verbose)", style="dim")
    parts = [f"step {training.step}"]
    if training.batches_per_s is not None:
        parts.append(f"{training.batches_per_s:.1f} batches/s")
    return Text(", ".join(parts), style="green")


def choose_progress(emit: Emit | None = None) -> SweepProgress:
    """`RichProgress` on stdout when it is a terminal (``sys.stdout.isatty()``), else `PlainProgress`
    writing to `emit` (default: stderr)."""
    if sys.stdout.isatty():
        return RichProgress()
    return PlainProgress(emit)
