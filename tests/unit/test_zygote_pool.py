"""harness.run.zygote_pool: which runs share warm containers, the run request and the nodes' ends as
`wiiide.zygote` writes them; harness.run.stats.since_baseline: a kept container's bytes per run."""

from __future__ import annotations

from pathlib import Path

from harness.run.stats import since_baseline
from harness.run.zygote_pool import ZygotePool, pool_key, results_root
from harness.spec.cluster import ClusterSettings, parse_cluster
from wiiide.zygote import read_request, write_json_atomic


def test_pool_key_differs_with_workers_image_limits_and_mount():
    root = Path("/r")
    base = pool_key("img:1", 8, ClusterSettings(), root)
    assert base == pool_key("img:1", 8, ClusterSettings(), root)
    others = {pool_key("img:2", 8, ClusterSettings(), root), pool_key("img:1", 4, ClusterSettings(), root),
              pool_key("img:1", 8, parse_cluster({"cpus": 0.5}, {}, 8, {"cpus": "base.cpus"}), root),
              pool_key("img:1", 8, ClusterSettings(), Path("/s")),
              pool_key("img:1", 8, ClusterSettings(), root, "cubic")}  # ddp's congestion control on the routes
    assert base not in others and len(others) == 5


def test_results_root_is_the_sweeps_folder_never_the_filesystems_root(tmp_path):
    assert results_root(tmp_path / "sweep" / "point-000" / "repeat-1") == tmp_path / "sweep"
    assert results_root(Path("/run1")) == Path("/")
    assert results_root(Path("/a/run1")) == Path("/a")


def test_a_run_request_reaches_the_zygote_and_its_ends_are_read_back(tmp_path):
    pool = ZygotePool(tmp_path / "ctl")
    pool.reset()
    assert not pool.usable("k")
    pool.adopt("k", tmp_path, ["c1"], {"p_coordinator_1": "coordinator"})
    assert pool.usable("k") and not pool.usable("other")
    run_id = pool.next_run_id()
    pool.write_request({"coordinator": {"WIIIIIDE_PORT": "1"}, "worker": {}})
    assert read_request(pool.control_dir) == {"run_id": run_id, "env": {"coordinator": {"WIIIIIDE_PORT": "1"}, "worker": {}}}
    assert pool.exit_record("coordinator") is None and pool.log_bytes("coordinator") == b""
    write_json_atomic(pool.run_dir() / "coordinator.exit.json", {"exit_code": 0, "started_at_utc": "a", "finished_at_utc": "b"})
    (pool.run_dir() / "coordinator.log").write_text("hello\n")
    assert pool.exit_record("coordinator")["exit_code"] == 0 and pool.log_bytes("coordinator") == b"hello\n"
    pool.end_run()
    assert not pool.run_dir().exists() and read_request(pool.control_dir) is None
    assert pool.next_run_id() != run_id and not pool.clean
    pool.mark_dirty("kill worker-1")
    pool.mark_dirty("pause worker-2")
    assert pool.dirty_reason == "kill worker-1"
    pool.reset()
    assert not pool.usable("k") and list(pool.control_dir.iterdir()) == []


def test_since_baseline_counts_bytes_after_the_baseline_only():
    record = {"t_s": 1.0, "cpu_percent": 50.0, "memory_bytes": 10, "net_rx_bytes": 1500, "net_tx_bytes": 700,
              "blk_read_bytes": 0, "blk_write_bytes": 4096}
    base = {"net_rx_bytes": 1000, "net_tx_bytes": 200, "blk_read_bytes": 0, "blk_write_bytes": 8192}
    out = since_baseline(record, base)
    # a counter below its baseline (the container restarted since) is kept as read
    assert out == {**record, "net_rx_bytes": 500, "net_tx_bytes": 500, "blk_write_bytes": 4096}
    assert since_baseline(record, None) == record
