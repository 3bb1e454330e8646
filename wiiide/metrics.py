"""Per-node metrics: counters kept during a run and written as one JSON file when the node ends.

The file is written atomically (temporary file, then rename) when the node ends for any reason,
including SIGTERM, so a harness never reads half a file. `SCHEMA_VERSION` changes when a field's
meaning changes; the harness reads files of this schema (``harness`` imports this module, never the
reverse).

Field units are in their names. Sources:
- ``peak_rss_bytes``: the larger of psutil's RSS sampled during the run and the kernel's own peak
  (``getrusage(RUSAGE_SELF).ru_maxrss``, KiB on Linux).
- ``iface_bytes_sent/recv``: psutil.net_io_counters() of the node's network namespace, end minus
  start (in a container: its eth0 and lo).
- ``cpu_time_s``: the process's CPU seconds, user + system of every thread (`time.process_time`), since
  the process started (a node forked from a zygote counts from its fork); ``step_cpu_s``: the CPU seconds of each step (from one recorded step to the next,
  `NodeMetrics.record_step_time`) summarized over the timed steps (warm-up steps left out, as the
  Training Summary does). Unlike the wall-time figures it does not grow while the process waits for
  a core, so the CPU a step needs can be told from the CPU it had (the round model's CPU term).
- ``compute_time_s`` / ``compute_cpu_s``: a worker's forward and backward over the run, wall seconds
  (`time.perf_counter`) and the training thread's CPU seconds (`time.thread_time`; with
  ``torch_threads`` 1 torch computes on that thread): what the compute phase of a step needs from the
  cores, apart from the threads that push, pull and serve a shard.
- ``compute_max_s`` (the sharded servers' coordinator; None elsewhere): per timed step the slowest
  worker's forward and backward, wall seconds as each worker measured it (its ``compute_time_s`` of that
  step, sent with ``step_done``), summarized as ``step_cpu_s`` is. A synchronous step waits for its
  slowest worker's pushes, so the step is at least this and the round after it (the ``w`` of a
  bulk-synchronous superstep is the maximum over the processors: Valiant 1990; the round model's
  slowest path). On a machine the nodes share it is longer than the median worker's: a worker that
  gets the cores last computes while the others already encode and serve pushes. ``compute_median_s``:
  the same for each timed step's median worker (the round model's compute of a step; a worker's own
  ``compute_time_s`` / ``steps`` also counts the warm-up steps, whose first ones can raise that mean
  several times over: 4x on digits in one run).
- ``stage_cpu_s`` (nodes of the sharded servers; None elsewhere): the CPU seconds of each timed step in
  each stage of the round, summarized over those steps as ``step_cpu_s`` is, from the thread that did
  the work (`time.thread_time`). Each direction has four stages, in the order a message goes through
  them: ``push_encode`` (a worker's error feedback and encoding of its pushes: before a push can
  leave), ``push_send`` (the worker's sender threads writing pushes to their sockets: while the bytes
  leave), ``push_receive`` (a shard reading pushes from its sockets and parsing their frames: while
  the bytes arrive), ``push_decode`` (the shard decoding each push's payload and keeping it: once all
  of it is in); ``update`` (a shard averaging, stepping its optimizer and encoding the pull);
  ``pull_send``, ``pull_receive`` (as for pushes) and ``pull_decode`` (a worker decoding and applying
  its pulls: what follows a pull's arrival). Sends and reads of a blocked socket take no CPU while
  they wait. The coordinator's barrier and batch handout are in none. A codec with ``codec_threads``
  > 1 encodes and decodes large lossless payloads on its pool's threads, which are not counted.
  Reports before 2026-11-28 (commit 5f11ce3) have four stages: ``push_receive`` and ``pull_receive`` then included the
  decoding, and the sends were in none.
- ``host_cpu_s`` (the coordinator; None elsewhere): the whole machine's CPU seconds over the timed steps
  by kind (``psutil.cpu_times``: the kernel's ``/proc/stat``, which a container shares with its host),
  summed over every CPU, from the end of the last warm-up step (or `NodeMetrics.track_host_cpu`'s call,
  with no warm-up) to the last recorded step, with that window's wall ``window_s``, its ``steps`` and
  ``cpu_count``. It tells apart what the nodes' own ``step_cpu_s`` leaves out: the kernel's network
  work in softirq (not charged to any process when the kernel accounts IRQ time), other processes on the
  machine (the container engine, the harness) and a hypervisor's ``steal``. ``start_monotonic_s`` and
  ``end_monotonic_s`` bound the window on the machine's CLOCK_MONOTONIC (`time.monotonic`), which
  every container of one kernel shares: the harness's scheduler trace (``sched_trace``) is cut to it.
- ``run_delay_s`` (every node on Linux; None elsewhere or before 1 + `RUN_DELAY_EVERY_STEPS` steps): the
  seconds the process's threads spent runnable but waiting for a CPU (the run-queue delay, the second
  field of ``/proc/self/task/*/schedstat``; the kernel's Documentation/scheduler/sched-stats.rst),
  summed over its threads, per step: ``per_step_s`` over a window of ``steps`` steps from the end of
  the last warm-up step (or of the first step) to the latest multiple of `RUN_DELAY_EVERY_STEPS` steps
  after it, and the ``threads`` read at its end. Read every `RUN_DELAY_EVERY_STEPS` steps (about 0.3 ms
  of CPU a read with 15 threads). Beside ``host_cpu_s``'s idle it tells whether the cores sat idle
  while threads waited for them; threads that ended within the window are not counted.
- ``tensor_memory`` (workers and every ddp/fsdp rank): the bytes of the parameters, gradients, optimizer
  state and one forward's activations the node holds, from the tensors themselves (`wiiide.tensor_memory`).
- ``events``: the first MAX_EVENTS_PER_KIND events of each kind; ``event_counts``: every event by
  kind; ``events_dropped``: those beyond the cap, by kind and ``reason`` (a refusal flood stays small).
"""

from __future__ import annotations

import os
import resource
import socket
import statistics
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import psutil

from wiiide.atomic_write import (  # noqa: F401 (re-exported: the nodes and the harness import them here)
    write_bytes_atomic,
    write_json_atomic,
    write_text_atomic,
)
from wiiide.summary import summarize, training_summary  # noqa: F401 (summarize: re-exported)
from wiiide.trace import StepTrace, message_step

SCHEMA_VERSION = 1
STAGES = ("push_encode", "push_send", "push_receive", "push_decode", "update", "pull_send", "pull_receive",
          "pull_decode")  # stage_cpu_s's stages of a sharded step, in a message's order
RUN_DELAY_EVERY_STEPS = 10  # run_delay_s: steps between two reads of the threads' run-queue delay
MAX_EVENTS_PER_KIND = 100  # events of one kind kept in full; beyond, only counted (by their `reason`)
MAX_DROPPED_REASONS = 32  # distinct reasons counted per kind beyond the cap; more count as "other"


def threads_run_delay_ns() -> tuple[int, int] | None:
    """(nanoseconds, threads): the run-queue delay of every thread of this process so far, summed (Linux
    ``/proc/self/task/<tid>/schedstat``: CPU time, run-queue delay, timeslices, in ns), and how many
    threads were read; None where the file does not exist (not Linux, or a kernel without schedstats)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    total = threads = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[1])
            threads += 1
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile, or no schedstats
            continue
    return (total, threads) if threads else None


def _utc_now() -> datetime:
    return datetime.now(timezone.utc)


class NodeMetrics:
    """Counters of one node. Network and codec counters are updated by `record_sent`/`record_received`.

    Args:
        role: ``coordinator`` or ``worker`` (names the metrics file).
        node_id: the node's name (the hostname unless configured).
        clock: monotonic seconds for ``wall_time_s`` and event ``t_s`` (default `time.perf_counter`).
        utc_now: wall-clock time for ``started_at_utc``/``ended_at_utc`` (an aware UTC datetime).
    """

    def __init__(self, role: str, node_id: str, *, clock: Callable[[], float] = time.perf_counter,
                 utc_now: Callable[[], datetime] = _utc_now) -> None:
        self.role = role
        self.node_id = node_id
        self.rank: int | None = None
        self._clock, self._utc_now = clock, utc_now
        self.started_at = utc_now()
        self._t0 = clock()
        self._proc = psutil.Process()
        self._rss_peak = 0
        self._net0 = _net_counters()
        self.steps = 0
        self.batches = 0
        self.samples = 0
        self.frames_sent = self.frames_received = 0
        self.payload_bytes_sent = self.payload_bytes_received = 0  # tensor bytes before encoding
        self.encoded_bytes_sent = self.encoded_bytes_received = 0  # tensor bytes after encoding
        self.wire_bytes_sent = self.wire_bytes_received = 0  # whole frames
        self.send_time_s = self.recv_time_s = 0.0
        self.compression_time_s = self.decompression_time_s = 0.0
        self.compute_time_s = 0.0
        self.compute_cpu_s = 0.0  # the training thread's CPU seconds in forward and backward (`time.thread_time`)
        self.train_time_s: float | None = None  # time in the training loop (set by the node), None: wall time
        self.codec_counts: dict[str, int] = {}
        self.codec_bytes_sent: dict[str, list[int]] = {}  # codec name -> [raw bytes, payload bytes]
        self.step_times_s: list[float] = []
        self.step_cpu_s: list[float] = []  # process CPU seconds of each step (record_step_time)
        self.compute_max_s: list[float | None] = []  # sharded coordinator: each step's slowest worker's compute
        self.compute_median_s: list[float | None] = []  # ... and its median worker's
        self._stage_cpu_s: dict[str, dict[int, float]] = {stage: {} for stage in STAGES}  # stage -> step -> CPU s
        self._stage_lock = threading.Lock()  # pushes, pulls and updates are timed on several threads
        self._cpu_mark_s = time.process_time()
        self.losses: list[float] = []
        self.socket_options: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.event_counts: dict[str, int] = {}  # every event recorded, by kind, kept or not
        self.events_dropped: dict[str, dict[str, int]] = {}  # beyond the cap: kind -> reason -> count
        self._events_lock = threading.Lock()  # handshake threads record events, too
        self.extra: dict[str, Any] = {}
        self.warmup_steps = 0  # first steps left out of the Training Summary's timings (run_node sets it)
        self._host_cpu_start: tuple[float, int, Any, float] | None = None  # (clock, steps, cpu_times, monotonic)
        self._host_cpu_end: tuple[float, int, Any, float] | None = None
        self._run_delay_start: tuple[int, int] | None = None  # (steps, ns): run_delay_s's window
        self._run_delay_end: tuple[int, int, int] | None = None  # (steps, ns, threads)
        self.samples_per_step: float | None = None  # global batch of one step; None: samples / steps
        self.rss_samples_bytes: list[int] = []
        self.trace: StepTrace | None = None  # trace_steps > 0: the spans of those steps (wiiide.trace)
        self.sample_rss()

    def elapsed_s(self) -> float:
        """Seconds since this object was made (the node's start)."""
        return self._clock() - self._t0

    def record_worker_step(self, samples: int, loss: float, seconds: float, batches: int = 1) -> None:
        """Count one step (one push) of a worker: `batches` trained batches (local SGD: H of them) of
        `samples` samples in all, their mean `loss` and the step's `seconds`; samples the RSS every 50 steps."""
        self.steps += 1
        self.batches += batches
        self.samples += samples
        self.losses.append(loss)
        self.record_step_time(seconds)
        if self.steps % 50 == 0:
            self.sample_rss()

    def record_step_time(self, seconds: float) -> None:
        """Keep one step's wall `seconds` and the process's CPU seconds (all threads, `time.process_time`)
        since the step recorded before it (or since this object was made)."""
        if self.trace is not None:
            self.trace.add("step", "step", len(self.step_times_s), seconds)
        self.step_times_s.append(seconds)
        cpu_s = time.process_time()
        self.step_cpu_s.append(cpu_s - self._cpu_mark_s)
        self._cpu_mark_s = cpu_s
        self._mark_run_delay(len(self.step_times_s))
        if self._host_cpu_start is not None:
            mark = (self._clock(), len(self.step_times_s), psutil.cpu_times(), time.monotonic())
            if mark[1] <= self.warmup_steps:
                self._host_cpu_start = mark  # the window opens at the end of the last warm-up step
            else:
                self._host_cpu_end = mark

    def record_workers_compute(self, seconds: list[float | None]) -> None:
        """Keep the step just recorded (`record_step_time`)'s slowest and median worker's forward and
        backward, from every worker's wall `seconds` as reported with ``step_done``; a None (a worker that
        did not report it) leaves the step out of both."""
        known = None not in seconds and bool(seconds)
        self.compute_max_s.append(max(seconds) if known else None)
        self.compute_median_s.append(statistics.median(seconds) if known else None)

    def add_stage_cpu(self, stage: str, step: Any, seconds: float) -> None:
        """Add a thread's CPU `seconds` in one of a sharded step's `STAGES` to `step`'s; a warm-up step (or
        a step that is not an int) is not kept (``stage_cpu_s`` in the module docstring).

        Raises:
            KeyError: `stage` is not one of `STAGES`.
        """
        by_step = self._stage_cpu_s[stage]
        if type(step) is int and step >= self.warmup_steps:  # noqa: E721 (a bool is no step)
            with self._stage_lock:
                by_step[step] = by_step.get(step, 0.0) + seconds

    def _timed_summary(self, per_step: list[float | None]) -> dict[str, Any] | None:
        """`summarize` of a per-step list over the timed steps, the steps without a value left out; None
        when nothing was ever recorded."""
        return summarize(v for v in per_step[self.warmup_steps:] if v is not None) if per_step else None

    def _mark_run_delay(self, steps: int) -> None:
        """Open ``run_delay_s``'s window at the end of the last warm-up step (or of the first step) and move
        its end every `RUN_DELAY_EVERY_STEPS` steps after it."""
        opened = max(self.warmup_steps, 1)
        if steps == opened or (steps > opened and (steps - opened) % RUN_DELAY_EVERY_STEPS == 0):
            read = threads_run_delay_ns()
            if read is None:
                return
            if steps == opened:
                self._run_delay_start = (steps, read[0])
            elif self._run_delay_start is not None:
                self._run_delay_end = (steps, read[0], read[1])

    def run_delay_window(self) -> dict[str, Any] | None:
        """``run_delay_s`` (module docstring); None before its window has a step."""
        if self._run_delay_start is None or self._run_delay_end is None:
            return None
        (n0, ns0), (n1, ns1, threads) = self._run_delay_start, self._run_delay_end
        return {"per_step_s": max(0, ns1 - ns0) / 1e9 / (n1 - n0), "steps": n1 - n0, "threads": threads}

    def track_host_cpu(self) -> None:
        """Record the machine's CPU time by kind over the timed steps (``host_cpu_s``, module docstring):
        one ``/proc/stat`` read now and one per recorded step after it (about 20 us each)."""
        self._host_cpu_start = (self._clock(), len(self.step_times_s), psutil.cpu_times(), time.monotonic())

    def host_cpu_window(self) -> dict[str, Any] | None:
        """``host_cpu_s``: the machine's CPU seconds by kind (``user``, ``system``, ``softirq``, ``idle``,
        ``steal`` ... as `psutil.cpu_times` names them), summed over its CPUs, from the window's start to
        its last recorded step, with ``window_s``, ``steps``, ``cpu_count`` and the bounds on CLOCK_MONOTONIC
        (``start_monotonic_s``, ``end_monotonic_s``); None when not tracked or no timed step was recorded."""
        if self._host_cpu_start is None or self._host_cpu_end is None:
            return None
        (t0, n0, c0, m0), (t1, n1, c1, m1) = self._host_cpu_start, self._host_cpu_end
        return {"window_s": t1 - t0, "steps": n1 - n0, "cpu_count": psutil.cpu_count(logical=True),
                "start_monotonic_s": m0, "end_monotonic_s": m1,
                **{kind: getattr(c1, kind) - getattr(c0, kind) for kind in c0._fields}}

    def sample_rss(self) -> int:
        """The process's resident set size now, in bytes (psutil); kept for the peak and the summary."""
        rss = self._proc.memory_info().rss
        self._rss_peak = max(self._rss_peak, rss)
        self.rss_samples_bytes.append(rss)
        return rss

    def add_compute(self, step: Any, seconds: float, cpu_s: float) -> None:
        """Add a worker's forward and backward of `step`: `seconds` of wall time, `cpu_s` of its thread's CPU."""
        self.compute_time_s += seconds
        self.compute_cpu_s += cpu_s
        if self.trace is not None:
            self.trace.add("compute", "compute", step, seconds, cpu_s=round(cpu_s, 6))

    def record_sent(self, frame: Any, seconds: float, peer: str | None = None) -> None:
        """Account one sent `wiiide.wire.messages.Frame` (to `peer`, for the trace) and the seconds its send took."""
        if self.trace is not None and frame.header is not None:
            self.trace.add(frame.kind, "send", message_step(frame.header.get("meta")), seconds,
                           wire_bytes=frame.wire_nbytes, peer=peer)
        self.frames_sent += 1
        self.payload_bytes_sent += frame.raw_nbytes
        self.encoded_bytes_sent += frame.payload_nbytes
        self.wire_bytes_sent += frame.wire_nbytes
        self.compression_time_s += frame.encode_s
        self.send_time_s += seconds
        self.codec_counts[frame.codec] = self.codec_counts.get(frame.codec, 0) + 1
        sent = self.codec_bytes_sent.get(frame.codec)
        if sent is None:
            self.codec_bytes_sent[frame.codec] = [frame.raw_nbytes, frame.payload_nbytes]
        else:
            sent[0] += frame.raw_nbytes
            sent[1] += frame.payload_nbytes

    def record_received(self, msg: Any, seconds: float, peer: str | None = None) -> None:
        """Account one received `wiiide.wire.messages.Message` (from `peer`, for the trace) and the seconds its
        receive took (the wait for it included)."""
        if self.trace is not None:
            self.trace.add(msg.kind, "receive", message_step(msg.meta), seconds, wire_bytes=msg.wire_nbytes, peer=peer)
        self.frames_received += 1
        self.payload_bytes_received += msg.raw_nbytes
        self.encoded_bytes_received += msg.payload_nbytes
        self.wire_bytes_received += msg.wire_nbytes
        self.decompression_time_s += msg.decode_s
        self.recv_time_s += seconds

    def event(self, kind: str, **fields: Any) -> bool:
        """Record a named event at ``t_s`` seconds since start (rounded to 1 us) with JSON-ready `fields`.

        The first MAX_EVENTS_PER_KIND events of each kind are kept in full; later ones are only
        counted in ``events_dropped[kind][reason]`` (`reason`: the event's ``reason`` field, a short
        category, or ``""``), so a flood of refused connections costs a bounded amount of memory and
        file, and cannot push out the few events of other kinds (``worker_lost``). Thread-safe.

        Returns:
            True if the event was kept in full, False if it was only counted.
        """
        with self._events_lock:
            count = self.event_counts.get(kind, 0) + 1
            self.event_counts[kind] = count
            if count <= MAX_EVENTS_PER_KIND:
                self.events.append({"t_s": round(self.elapsed_s(), 6), "event": kind, **fields})
                return True
            by_reason = self.events_dropped.setdefault(kind, {})
            reason = str(fields.get("reason", ""))[:64]
            if reason not in by_reason and len(by_reason) >= MAX_DROPPED_REASONS:
                reason = "other"  # the counts stay bounded whatever reasons a caller makes up
            by_reason[reason] = by_reason.get(reason, 0) + 1
            return False

    def training_summary(self, peak_rss_bytes: int | None = None) -> dict[str, Any]:
        """The seeds' guide's Training Summary of this node's steps so far (`wiiide.summary.training_summary`:
        warm-up steps left out of the timings); `peak_rss_bytes` None: the peak RSS sampled or getrusage's."""
        if peak_rss_bytes is None:
            peak_rss_bytes = max(self._rss_peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        return training_summary(self.step_times_s, self.losses, self.warmup_steps,
                                self.samples_per_step or (self.samples / self.steps if self.steps else None),
                                self.rss_samples_bytes, peak_rss_bytes, self.extra.get("tokens_per_sample"))

    def to_dict(self, status: str, error: str | None = None) -> dict[str, Any]:
        """The metrics file's content (JSON-ready): `status` is ``ok``, ``failed`` ...; `error` its one line.

        Rates divide by ``train_time_s`` when the node set it, else by the wall time; ``goodput_bps`` is
        8 x (payload bytes sent + received) per second (bits of tensors before encoding).
        """
        wall = self.elapsed_s()
        self.sample_rss()
        peak_rss = max(self._rss_peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        net1 = _net_counters()
        compression_ratio = (self.payload_bytes_sent / self.encoded_bytes_sent) if self.encoded_bytes_sent else None
        return {
            "schema_version": SCHEMA_VERSION,
            "role": self.role,
            "node_id": self.node_id,
            "rank": self.rank,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "status": status,
            "error": error,
            "started_at_utc": self.started_at.isoformat(),
            "ended_at_utc": self._utc_now().isoformat(),
            "wall_time_s": wall,
            "steps": self.steps,
            "batches": self.batches,
            "samples": self.samples,
            "train_time_s": self.train_time_s,
            "batches_per_s": self.batches / (self.train_time_s or wall) if (self.train_time_s or wall) > 0 else None,
            "frames_sent": self.frames_sent,
            "frames_received": self.frames_received,
            "payload_bytes_sent": self.payload_bytes_sent,
            "payload_bytes_received": self.payload_bytes_received,
            "encoded_bytes_sent": self.encoded_bytes_sent,
            "encoded_bytes_received": self.encoded_bytes_received,
            "wire_bytes_sent": self.wire_bytes_sent,
            "wire_bytes_received": self.wire_bytes_received,
            "goodput_bps": (8 * (self.payload_bytes_sent + self.payload_bytes_received) / (self.train_time_s or wall)
                            if (self.train_time_s or wall) > 0 else None),
            "iface_bytes_sent": net1[0] - self._net0[0],
            "iface_bytes_recv": net1[1] - self._net0[1],
            "network_time_s": self.send_time_s + self.recv_time_s,
            "send_time_s": self.send_time_s,
            "recv_time_s": self.recv_time_s,
            "compute_time_s": self.compute_time_s,
            "compute_cpu_s": self.compute_cpu_s,
            "compression_time_s": self.compression_time_s,
            "decompression_time_s": self.decompression_time_s,
            "compression_ratio": compression_ratio,
            "codec_counts": dict(self.codec_counts),
            "codec_bytes_sent": {codec: {"raw_bytes": raw, "payload_bytes": payload}
                                 for codec, (raw, payload) in self.codec_bytes_sent.items()},
            "peak_rss_bytes": peak_rss,
            "socket_options": self.socket_options,
            "step_time_s": summarize(self.step_times_s),
            "cpu_time_s": time.process_time(),
            "step_cpu_s": summarize(self.step_cpu_s[self.warmup_steps:]),
            "host_cpu_s": self.host_cpu_window(),
            "run_delay_s": self.run_delay_window(),
            "compute_max_s": self._timed_summary(self.compute_max_s),
            "compute_median_s": self._timed_summary(self.compute_median_s),
            "stage_cpu_s": {stage: summarize(by_step.values()) for stage, by_step in self._stage_cpu_s.items()
                            if by_step} or None,
            "loss_first": self.losses[0] if self.losses else None,
            "loss_avg": (sum(self.losses) / len(self.losses)) if self.losses else None,
            "loss_final": self.losses[-1] if self.losses else None,
            "training_summary": self.training_summary(peak_rss),
            "events": list(self.events),
            "event_counts": dict(self.event_counts),
            "events_dropped": {kind: dict(counts) for kind, counts in self.events_dropped.items()},
            **({"trace": self.trace.to_dict()} if self.trace is not None else {}),
            **self.extra,
        }

    def write(self, metrics_dir: str | Path, status: str, error: str | None = None) -> Path:
        """Write ``<metrics_dir>/<role>-<rank or node_id>.json`` atomically; return its path."""
        suffix = self.rank if self.role == "worker" and self.rank is not None else self.node_id
        name = "coordinator.json" if self.role == "coordinator" else f"{self.role}-{suffix}.json"
        path = Path(metrics_dir) / name
        write_json_atomic(path, self.to_dict(status, error))
        return path


def _net_counters() -> tuple[int, int]:
    c = psutil.net_io_counters()
    return (c.bytes_sent, c.bytes_recv) if c else (0, 0)
