"""harness.bench.overhead: the nodes' side of a run from container and metrics times, and the summary
per worker count and per node image (``--images``)."""

from __future__ import annotations

from harness.bench.overhead import format_summary, node_phases, summarize


def _run(workers: int, image: str | None, wall_s: float, train_s: float, status: str = "ok") -> dict:
    return {"num_workers": workers, "image": image, "status": status, "wall_s": wall_s, "train_time_s": train_s,
            "overhead_s": round(wall_s - train_s, 3), "phases_s": {"create": 1.0, "run": wall_s - 1.5},
            "nodes_s": {"to_training_s": 4.0, "train_time_s": train_s, "after_training_s": 0.5}}


def test_node_phases_from_container_and_metrics_times():
    containers = {
        "coordinator": {"started_at_utc": "2026-11-23T08:52:14.100000000Z", "finished_at_utc": "2026-11-23T08:52:27.500Z"},
        "worker_1": {"started_at_utc": "2026-11-23T08:52:15.600123456Z", "finished_at_utc": "2026-11-23T08:52:27.900Z"},
    }
    coordinator = {"ended_at_utc": "2026-11-23T08:52:27.300000+00:00", "train_time_s": 5.0}
    phases = node_phases(containers, coordinator)
    # training started at 27.3 - 5.0 = 22.3, the first container at 14.1; the last exit at 27.9
    assert phases == {"to_training_s": 8.2, "train_time_s": 5.0, "after_training_s": 0.6}


def test_node_phases_without_container_times_are_none():
    phases = node_phases({"worker_1": {"started_at_utc": None, "finished_at_utc": None}},
                         {"ended_at_utc": "2026-11-23T08:52:27Z", "train_time_s": 5.0})
    assert phases == {"to_training_s": None, "train_time_s": 5.0, "after_training_s": None}


def test_summary_has_a_row_per_image_and_worker_count():
    runs = [_run(8, "old:1", 20.0, 5.0), _run(8, "new:1", 14.0, 5.0), _run(8, "old:1", 22.0, 5.0),
            _run(8, "new:1", 15.0, 5.0), _run(8, "new:1", 30.0, 5.0, status="failed"),
            _run(4, "old:1", 17.0, 5.0), _run(4, "new:1", 12.0, 5.0)]
    summary = summarize(runs)
    assert list(summary) == ["1+4 old:1", "1+4 new:1", "1+8 old:1", "1+8 new:1"]  # images in the order given
    new8 = summary["1+8 new:1"]
    assert new8["runs"] == 3 and new8["runs_ok"] == 2  # the failed run is counted, not measured
    assert new8["wall_s"] == {"count": 2, "median": 14.5, "min": 14.0, "max": 15.0}
    assert summary["1+8 old:1"]["overhead_s"]["median"] == 16.0
    table = format_summary(summary)
    assert "1+8 new:1" in table and "1+4 old:1" in table


def test_summary_of_one_image_keeps_the_plain_keys():
    summary = summarize([_run(4, None, 17.0, 5.0), _run(8, None, 21.0, 5.0)])
    assert list(summary) == ["1+4", "1+8"]
    assert summary["1+8"]["overhead_s"]["median"] == 16.0


def test_summary_keeps_runs_in_reused_and_fresh_containers_apart():
    runs = [{**_run(8, None, 40.0, 5.0), "reused": False}, {**_run(8, None, 8.0, 5.0), "reused": True},
            {**_run(8, None, 7.0, 5.0), "reused": True}]
    s = summarize(runs)["1+8"]
    assert s["overhead_s"]["median"] == 3.0  # all three runs
    assert s["overhead_s_reused"] == {"count": 2, "median": 2.5, "min": 2.0, "max": 3.0}
    assert s["overhead_s_fresh"] == {"count": 1, "median": 35.0, "min": 35.0, "max": 35.0}
