"""harness.run.stats: one-shot stats reads, CPU % against the previous read, a last read at stop."""

from __future__ import annotations

import threading

import pytest

from harness.run.stats import StatsReader, parse_sample, stop_readers, summarize_samples


def raw_sample(container_ns: int, system_ns: int, rx: int) -> dict:
    """An Engine API one-shot sample (cgroup v2 memory fields), with no precpu_stats as one-shot gives it."""
    return {"cpu_stats": {"cpu_usage": {"total_usage": container_ns}, "system_cpu_usage": system_ns, "online_cpus": 2},
            "precpu_stats": {}, "memory_stats": {"usage": 50_000_000, "stats": {"inactive_file": 10_000_000}},
            "networks": {"eth0": {"rx_bytes": rx, "tx_bytes": rx // 2}}}


class FakeApi:
    """Hands out `samples` in turn (the last one again once they run out) and counts the calls."""

    def __init__(self, samples: list[dict]) -> None:
        self.samples, self.calls, self.kwargs = samples, 0, []
        self.fail = False
        self.read = threading.Event()

    def stats(self, container_id, **kwargs):
        self.kwargs.append(kwargs)
        if self.fail:
            raise RuntimeError("No such container")
        sample = self.samples[min(self.calls, len(self.samples) - 1)]
        self.calls += 1
        self.read.set()
        return {key: dict(value) for key, value in sample.items()}


class FakeContainer:
    def __init__(self, api: FakeApi) -> None:
        self.id, self.name = "abc", "wiiide_worker_1"
        self.client = type("Client", (), {"api": api})()


def test_cpu_percent_is_against_the_previous_one_shot_read():
    api = FakeApi([raw_sample(1_000_000_000, 100_000_000_000, 1000),
                   raw_sample(1_500_000_000, 102_000_000_000, 5000),  # 0.5 s of 2 s of both cores' time
                   raw_sample(2_500_000_000, 104_000_000_000, 9000)])
    reader = StatsReader(FakeContainer(api), t0=0.0, interval_s=0.01)
    while api.calls < 3:
        api.read.wait(1.0)
        api.read.clear()
    reader.stop()
    assert all(kw == {"stream": False, "one_shot": True} for kw in api.kwargs)
    cpu = [s["cpu_percent"] for s in reader.samples]
    assert cpu[0] == 0.0  # the first read has nothing to compare with
    assert cpu[1] == pytest.approx(50.0)  # 0.5 / 2 x 2 cores x 100
    assert cpu[2] == pytest.approx(100.0)
    assert reader.samples[-1]["net_rx_bytes"] == 9000
    assert reader.samples[0]["memory_bytes"] == 40_000_000


def test_stop_takes_a_last_read_and_none_after_it():
    api = FakeApi([raw_sample(1_000_000_000, 100_000_000_000, 1000), raw_sample(1_200_000_000, 101_000_000_000, 7000)])
    reader = StatsReader(FakeContainer(api), t0=0.0, interval_s=3600.0)  # no read between the first and the stop
    api.read.wait(1.0)
    stop_readers([reader])
    assert api.calls == 2
    assert [s["net_rx_bytes"] for s in reader.samples] == [1000, 7000]
    assert reader.samples[1]["cpu_percent"] == pytest.approx(40.0)
    summary = summarize_samples(reader.samples)
    assert summary["sample_count"] == 2 and summary["net_rx_bytes"] == 7000
    assert summary["cpu_percent"]["median"] == pytest.approx(40.0)  # the first sample's 0 is left out


def test_reads_that_fail_keep_the_samples_read_before():
    api = FakeApi([raw_sample(1_000_000_000, 100_000_000_000, 1000)])
    reader = StatsReader(FakeContainer(api), t0=0.0, interval_s=0.01)
    api.read.wait(1.0)
    api.fail = True
    reader.stop()
    assert len(reader.samples) >= 1 and reader.samples[0]["net_rx_bytes"] == 1000


def test_a_stopped_container_s_empty_sample_is_no_record():
    assert parse_sample({"cpu_stats": {}, "memory_stats": {}, "precpu_stats": {}}, 1.0) is None


def test_the_first_reads_come_before_one_interval_is_over():
    """A run shorter than one interval (a worker of a 4 s run exits before a read at 5 s) is still read
    after its traffic began: at 1, 2 and 4 s, then every interval."""
    api = FakeApi([raw_sample(1_000_000_000, 100_000_000_000, 1000)])
    api.fail = True  # no samples are needed: the schedule alone
    reader = StatsReader(FakeContainer(api), t0=0.0, interval_s=5.0)
    reader.stop()
    offsets = reader.read_offsets_s()
    assert [next(offsets) for _ in range(6)] == [1.0, 2.0, 4.0, 9.0, 14.0, 19.0]
    fast = StatsReader(FakeContainer(api), t0=0.0, interval_s=0.5)  # early reads never wider than the interval
    fast.stop()
    offsets = fast.read_offsets_s()
    assert [next(offsets) for _ in range(4)] == [0.5, 1.0, 1.5, 2.0]
