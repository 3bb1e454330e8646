"""wiiide.metrics: summaries of raw values, atomic JSON files, and the per-node counters."""

from __future__ import annotations

import json
import os
import statistics
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from wiiide.codecs import NoCodec, ZlibCodec
from wiiide.metrics import SCHEMA_VERSION, NodeMetrics, summarize, write_json_atomic
from wiiide.metrics_model import NodeMetricsFile
from wiiide.wire.encode import encode_message
from wiiide.wire.messages import WireTensor
from wiiide.wire.reader import FrameReader
from wiiide.wire.send import send_frames


@pytest.mark.parametrize("values", [
    [1.0, 2.0, 3.0, 4.0],
    [0.5, 0.1, 0.9, 0.3, 0.7],
    list(np.random.default_rng(0).exponential(size=101)),
    [3, 3, 3],
])
def test_summarize_matches_statistics(values):
    s = summarize(values)
    assert s["count"] == len(values)
    assert s["mean"] == pytest.approx(statistics.fmean(values))
    assert s["stdev"] == pytest.approx(statistics.stdev(values))
    assert s["median"] == pytest.approx(statistics.median(values))
    assert s["min"] == min(values) and s["max"] == max(values)
    assert min(values) <= s["p95"] <= max(values)


def test_summarize_p95_nearest_rank():
    s = summarize(range(1, 101))  # 1..100
    assert s["p95"] == 95.0  # index round(0.95 * 99) = 94 of the sorted values
    assert summarize([5.0, 1.0])["p95"] == 5.0


def test_summarize_unsorted_input():
    s = summarize([9.0, 1.0, 5.0])
    assert (s["min"], s["median"], s["max"]) == (1.0, 5.0, 9.0)


def test_summarize_single_and_empty():
    assert summarize([2.5]) == {"count": 1, "mean": 2.5, "stdev": 0.0, "median": 2.5, "min": 2.5, "max": 2.5,
                                "p95": 2.5}
    empty = summarize([])
    assert empty["count"] == 0
    assert all(empty[k] is None for k in ("mean", "stdev", "median", "min", "max", "p95"))
    assert summarize(iter([1, 2]))["count"] == 2  # any iterable, consumed once


def test_write_json_atomic(tmp_path):
    path = tmp_path / "sub" / "node.json"
    payload = {"a": 1, "nested": {"b": [1.5, None, "x"]}, "path": tmp_path}
    write_json_atomic(path, payload)
    assert os.listdir(path.parent) == ["node.json"]  # no temporary file left
    assert json.loads(path.read_text()) == {"a": 1, "nested": {"b": [1.5, None, "x"]}, "path": str(tmp_path)}
    write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert os.listdir(path.parent) == ["node.json"]


def test_write_json_atomic_failure_keeps_old_file_and_no_temp(tmp_path):
    path = tmp_path / "node.json"
    write_json_atomic(path, {"ok": True})
    circular: dict = {}
    circular["self"] = circular
    with pytest.raises(ValueError):
        write_json_atomic(path, circular)
    assert os.listdir(tmp_path) == ["node.json"]
    assert json.loads(path.read_text()) == {"ok": True}


def sent_frames():
    zeros = [WireTensor("p", np.zeros(10_000, np.float32))]
    return [encode_message("params", {}, zeros, ZlibCodec(9)),
            encode_message("params", {}, zeros, ZlibCodec(9)),
            encode_message("batch", {}, [WireTensor("x", np.ones(100, np.float32))], NoCodec()),
            encode_message("stop")]


def test_node_metrics_sent_counters_and_compression_ratio():
    m = NodeMetrics("worker", "w1")
    frames = sent_frames()
    for f in frames:
        m.record_sent(f, 0.25)
    d = m.to_dict("ok")
    payload = sum(f.raw_nbytes for f in frames)
    encoded = sum(f.payload_nbytes for f in frames)
    assert payload == 2 * 40_000 + 400
    assert d["frames_sent"] == 4
    assert d["payload_bytes_sent"] == payload
    assert d["encoded_bytes_sent"] == encoded
    assert d["wire_bytes_sent"] == sum(f.wire_nbytes for f in frames)
    assert d["compression_ratio"] == pytest.approx(payload / encoded)
    assert d["compression_ratio"] > 10  # zeros compress well
    assert d["codec_counts"] == {"zlib-9": 2, "none": 2}
    zlib = [f for f in frames if f.codec == "zlib-9"]
    assert d["codec_bytes_sent"] == {
        "zlib-9": {"raw_bytes": 80_000, "payload_bytes": sum(f.payload_nbytes for f in zlib)},
        "none": {"raw_bytes": 400, "payload_bytes": 400}}  # the batch; the stop carries no tensor
    assert d["send_time_s"] == pytest.approx(1.0)
    assert d["compression_time_s"] == pytest.approx(sum(f.encode_s for f in frames))


def test_every_field_a_node_writes_is_in_its_published_model():
    """A node's file loads as `NodeMetricsFile` with no key the model does not name, typed (a new field of
    `to_dict` without a field in the model, and in the shipped schema, fails here)."""
    m = NodeMetrics("worker", "w1")
    m.rank = 1
    for f in sent_frames():
        m.record_sent(f, 0.25)
    m.record_worker_step(32, 0.5, 0.01)
    m.event("joined", rank=1)
    d = json.loads(json.dumps(m.to_dict("ok")))
    record = NodeMetricsFile.model_validate(d)
    assert record.model_extra == {}
    assert record.step_time_s.count == 1 and record.training_summary.total_steps == 1
    assert record.model_dump(mode="json", exclude_unset=True) == d  # nothing lost or changed
    with pytest.raises(ValidationError, match="steps"):
        NodeMetricsFile.model_validate({**d, "steps": "many"})


def test_node_metrics_no_compression_ratio_without_sends():
    assert NodeMetrics("coordinator", "c").to_dict("ok")["compression_ratio"] is None


def test_node_metrics_received_counters(sock_pair):
    writer, reader_sock = sock_pair
    frames = sent_frames()
    send_frames(writer, frames)
    reader = FrameReader(reader_sock, 64 * 1024 * 1024)
    m = NodeMetrics("coordinator", "c")
    for _ in frames:
        m.record_received(reader.read_message(), 0.5)
    d = m.to_dict("ok")
    assert d["frames_received"] == 4
    assert d["payload_bytes_received"] == sum(f.raw_nbytes for f in frames)
    assert d["wire_bytes_received"] == sum(f.wire_nbytes for f in frames)
    assert d["recv_time_s"] == pytest.approx(2.0)
    assert d["network_time_s"] == pytest.approx(2.0)


def test_node_metrics_encoded_bytes_received(sock_pair):
    writer, reader_sock = sock_pair
    frames = sent_frames()
    send_frames(writer, frames)
    reader = FrameReader(reader_sock, 64 * 1024 * 1024)
    m = NodeMetrics("coordinator", "c")
    for _ in frames:
        m.record_received(reader.read_message(), 0.0)
    assert m.encoded_bytes_received == sum(f.payload_nbytes for f in frames)


def _kernel_peak_rss_bytes() -> int:
    """VmHWM (the kernel's peak resident set) from /proc/self/status, independent of psutil and getrusage."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def test_node_metrics_to_dict_fields():
    ticks = iter([100.0, 100.25, 102.5])  # start, the event, to_dict
    start = datetime(2024, 5, 1, 12, 0, 0, tzinfo=timezone.utc)
    moments = iter([start, start + timedelta(seconds=2.5)])
    m = NodeMetrics("worker", "w7", clock=lambda: next(ticks), utc_now=lambda: next(moments))
    m.rank = 3
    m.steps, m.batches, m.samples = 10, 10, 320
    m.train_time_s = 2.0
    m.step_times_s = [0.1, 0.3, 0.2]
    m.losses = [2.0, 1.0, 0.5]
    m.event("connected", attempts=2)
    m.extra["test_accuracy"] = 0.9
    m.payload_bytes_sent, m.payload_bytes_received = 1000, 3000
    ballast = bytearray(32 * 1024 * 1024)  # 32 MiB touched: resident now
    ballast[::4096] = b"x" * len(ballast[::4096])
    peak_before = _kernel_peak_rss_bytes()
    d = m.to_dict("failed", "boom")
    peak_after = _kernel_peak_rss_bytes()
    del ballast
    assert d["schema_version"] == SCHEMA_VERSION
    assert (d["role"], d["node_id"], d["rank"], d["status"], d["error"]) == ("worker", "w7", 3, "failed", "boom")
    assert d["pid"] == os.getpid()
    assert d["batches_per_s"] == pytest.approx(5.0)  # 10 batches in 2.0 s of training
    assert d["goodput_bps"] == pytest.approx(16_000.0)  # 4,000 payload bytes = 32,000 bits in 2.0 s
    assert d["step_time_s"] == summarize([0.1, 0.3, 0.2])
    assert d["loss_avg"] == pytest.approx(3.5 / 3) and d["loss_final"] == 0.5
    assert d["events"] == [{"t_s": 0.25, "event": "connected", "attempts": 2}]  # 100.25 - 100.0
    assert d["wall_time_s"] == pytest.approx(2.5)  # 102.5 - 100.0
    assert d["started_at_utc"] == "2024-05-01T12:00:00+00:00"
    assert d["ended_at_utc"] == "2024-05-01T12:00:02.500000+00:00"
    assert d["test_accuracy"] == 0.9
    # the peak is the kernel's high-water mark (getrusage) or a higher psutil sample: between the two reads.
    # getrusage and /proc/self/status sum the kernel's per-CPU RSS counters with different precision
    # (Linux 6.2+), so they may differ by a few pages (40 KiB seen here at 600 MB): 1 MiB of slack, far
    # below the 32 MiB ballast the reads must include.
    slack = 1024 * 1024
    assert peak_before - slack <= d["peak_rss_bytes"] <= peak_after + slack
    json.dumps(d, allow_nan=False)  # JSON-ready


def test_node_metrics_empty_run():
    d = NodeMetrics("worker", "w").to_dict("ok")
    assert d["loss_avg"] is None and d["loss_final"] is None
    assert d["step_time_s"]["count"] == 0


@pytest.mark.parametrize("role, rank, node_id, expected", [
    ("coordinator", 0, "host-a", "coordinator.json"),
    ("worker", 2, "host-b", "worker-2.json"),
    ("worker", None, "host-c", "worker-host-c.json"),
])
def test_node_metrics_write_file_name(tmp_path, role, rank, node_id, expected):
    m = NodeMetrics(role, node_id)
    m.rank = rank
    path = m.write(tmp_path / "nodes", "ok")
    assert path == tmp_path / "nodes" / expected
    assert os.listdir(tmp_path / "nodes") == [expected]
    data = json.loads(path.read_text())
    assert data["role"] == role and data["status"] == "ok" and data["rank"] == rank


def test_step_cpu_counts_the_process_cpu_of_each_step_not_its_wall_time():
    """A step that sleeps takes wall time and almost no CPU; one that computes takes CPU. The summary
    leaves the warm-up steps out, as the Training Summary does."""
    import time

    m = NodeMetrics("worker", "w1")
    m.warmup_steps = 1
    m.record_step_time(0.0)  # warm-up: everything since the object was made
    t0 = time.perf_counter()
    time.sleep(0.2)
    m.record_step_time(time.perf_counter() - t0)
    start_cpu_s = time.process_time()
    while time.process_time() - start_cpu_s < 0.05:  # burn at least 50 ms of CPU
        sum(range(1000))
    m.record_step_time(0.0)
    slept_cpu_s, busy_cpu_s = m.step_cpu_s[1], m.step_cpu_s[2]
    assert busy_cpu_s >= 0.05
    assert slept_cpu_s < busy_cpu_s
    assert slept_cpu_s < 0.2 / 4  # the 0.2 s of sleep is not CPU
    d = m.to_dict("ok")
    assert d["step_cpu_s"]["count"] == 2 and d["step_cpu_s"]["max"] == busy_cpu_s
    assert d["cpu_time_s"] >= sum(m.step_cpu_s)
    assert m.step_times_s[1] >= 0.2


def test_host_cpu_covers_the_timed_steps_of_the_whole_machine():
    """The coordinator's window of the machine's CPU opens at the end of the last warm-up step: CPU burnt
    in the warm-up stays out, the CPU of a timed step is in it, and its kinds add up to every CPU's time
    over the window (``/proc/stat``'s ticks are 10 ms, hence the tolerance). Untracked nodes have none."""
    import time

    import psutil

    assert NodeMetrics("worker", "w1").to_dict("ok")["host_cpu_s"] is None
    m = NodeMetrics("coordinator", "c")
    m.warmup_steps = 1
    m.track_host_cpu()
    assert m.to_dict("ok")["host_cpu_s"] is None  # no timed step yet
    start_cpu_s = time.process_time()
    while time.process_time() - start_cpu_s < 0.3:  # the warm-up step burns 0.3 s
        sum(range(1000))
    before_opened = time.monotonic()
    m.record_step_time(0.3)
    after_opened = time.monotonic()
    time.sleep(0.4)
    start_cpu_s = time.process_time()
    while time.process_time() - start_cpu_s < 0.1:  # the timed step burns 0.1 s
        sum(range(1000))
    before_closed = time.monotonic()
    m.record_step_time(0.5)
    after_closed = time.monotonic()
    window = m.to_dict("ok")["host_cpu_s"]
    # its bounds: the end of the warm-up step (so the warm-up's burn is out) and of the timed one
    assert before_opened <= window["start_monotonic_s"] <= after_opened
    assert before_closed <= window["end_monotonic_s"] <= after_closed
    assert window["end_monotonic_s"] - window["start_monotonic_s"] == pytest.approx(window["window_s"], abs=0.01)
    assert window["steps"] == 1 and window["cpu_count"] == psutil.cpu_count()
    kinds = sum(v for k, v in window.items() if k not in ("window_s", "steps", "cpu_count", "guest", "guest_nice",
                                                        "start_monotonic_s", "end_monotonic_s"))
    assert kinds == pytest.approx(window["window_s"] * window["cpu_count"], rel=0.15)
    assert window["user"] + window["system"] >= 0.1 - 0.02  # this process's timed burn, at least


def test_the_slowest_and_median_workers_compute_are_summarized_over_the_timed_steps_that_reported_it():
    """The sharded coordinator's slowest and median worker per step: the warm-up step and a step with a
    worker that did not report are left out; a node that never recorded them has None."""
    assert NodeMetrics("worker", "w1").to_dict("ok")["compute_max_s"] is None
    assert NodeMetrics("worker", "w1").to_dict("ok")["compute_median_s"] is None
    m = NodeMetrics("coordinator", "c")
    m.warmup_steps = 1
    for step_s, workers_s in ((0.9, [0.8, 0.7, 0.9]), (0.2, [0.05, 0.01, 0.02]), (0.2, [0.01, None, 0.02]),
                              (0.3, [0.07, 0.03, 0.01]), (0.2, [0.06, 0.04, 0.04])):
        m.record_step_time(step_s)
        m.record_workers_compute(workers_s)
    slowest, median = m.to_dict("ok")["compute_max_s"], m.to_dict("ok")["compute_median_s"]
    assert slowest["count"] == 3 and slowest["median"] == pytest.approx(0.06) and slowest["max"] == pytest.approx(0.07)
    assert median["count"] == 3 and median["median"] == pytest.approx(0.03) and median["max"] == pytest.approx(0.04)


def test_stage_cpu_adds_up_each_timed_steps_cpu_per_stage():
    """Several threads add to one step's stage; warm-up steps and steps that are no int are left out;
    a stage nothing was added to is not listed, and a node without any has None."""
    import threading

    assert NodeMetrics("worker", "w1").to_dict("ok")["stage_cpu_s"] is None
    m = NodeMetrics("worker", "w1")
    m.warmup_steps = 2

    def pushes(step: int) -> None:
        for _ in range(1000):
            m.add_stage_cpu("push_encode", step, 0.001)

    threads = [threading.Thread(target=pushes, args=(step,)) for step in (1, 2, 2, 3) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m.add_stage_cpu("update", True, 5.0)  # a bool is no step
    m.add_stage_cpu("update", "3", 5.0)
    stages = m.to_dict("ok")["stage_cpu_s"]
    assert set(stages) == {"push_encode"}  # nothing kept for update
    assert stages["push_encode"]["count"] == 2  # steps 2 and 3; step 1 is warm-up
    assert stages["push_encode"]["max"] == pytest.approx(4.0) and stages["push_encode"]["min"] == pytest.approx(2.0)
    with pytest.raises(KeyError):
        m.add_stage_cpu("compute", 3, 1.0)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux's per-thread schedstat")
def test_run_delay_is_the_threads_wait_for_a_cpu_over_the_timed_steps():
    """Two threads hashing on one CPU (the hash lets go of the GIL, so both are runnable): each waits
    while the other runs, so the process's run-queue delay over the window grows by about as much as one
    of them ran (0.2 s); the window starts after the warm-up steps and ends at the latest tenth step."""
    import threading

    from wiiide.metrics import RUN_DELAY_EVERY_STEPS

    m = NodeMetrics("worker", "w1")
    m.warmup_steps = 2
    assert m.to_dict("ok")["run_delay_s"] is None
    affinity = os.sched_getaffinity(0)
    done = threading.Event()
    os.sched_setaffinity(0, {min(affinity)})
    try:
        for step in range(2 + 2 * RUN_DELAY_EVERY_STEPS + 3):
            if step == 2:  # inside the window: a second thread competes for the one CPU, and lives on
                hashing = threading.Thread(target=lambda: (_hash_for(0.2), done.wait()))
                hashing.start()
                _hash_for(0.2)
            m.record_step_time(0.001)
    finally:
        done.set()
        os.sched_setaffinity(0, affinity)
    hashing.join()
    window = m.to_dict("ok")["run_delay_s"]
    assert window["steps"] == 2 * RUN_DELAY_EVERY_STEPS and window["threads"] >= 2
    assert window["per_step_s"] * window["steps"] > 0.1


def _hash_for(cpu_s: float) -> None:
    """Hash for `cpu_s` of this thread's CPU, without the GIL (hashlib lets go of it for large buffers)."""
    import hashlib
    import time as _time

    block = bytes(1 << 20)
    end = _time.thread_time() + cpu_s
    while _time.thread_time() < end:
        hashlib.sha256(block).digest()
