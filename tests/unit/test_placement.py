"""Where the shards go (`wiiide.server.ps.placement`): the workers with the most CPU, read from the cgroup."""

from __future__ import annotations

import os

import pytest

from wiiide.server.ps.placement import hello_cpus, node_cpus, place_shards


def test_equal_cpu_keeps_the_placement_by_rank():
    workers = [(1, 2.0), (2, 2.0), (3, 2.0), (4, 2.0)]
    assert place_shards(workers, 5, all_nodes=True) == {1: 1, 2: 2, 3: 3, 4: 4}
    assert place_shards(workers, 3, all_nodes=False) == {1: 1, 2: 2}
    assert place_shards([(1, None), (2, None)], 3, all_nodes=True) == {1: 1, 2: 2}  # not reported: the most


def test_all_leaves_a_worker_short_of_cpu_without_a_shard():
    workers = [(4, 0.25), (1, 2.0), (2, 2.0), (3, 2.0)]
    assert place_shards(workers, 5, all_nodes=True) == {1: 1, 2: 2, 3: 3}  # 4 shards: the coordinator's and 1-3
    assert place_shards([(1, 0.25), (2, 2.0), (3, 1.0)], 4, all_nodes=True) == {2: 1, 3: 2}  # 1.0 >= half of 2.0


def test_a_count_keeps_its_shards_on_the_most_cpu():
    workers = [(1, 0.25), (2, 2.0), (3, 1.0), (4, 2.0)]
    assert place_shards(workers, 3, all_nodes=False) == {2: 1, 4: 2}
    assert place_shards(workers, 5, all_nodes=False) == {1: 1, 2: 2, 3: 3, 4: 4}  # a count is kept: everyone hosts


def test_node_cpus_reads_the_cgroup_quota(tmp_path):
    cores = len(os.sched_getaffinity(0))
    limited = tmp_path / "cpu.max"
    limited.write_text("25000 100000\n")
    assert node_cpus(limited) == min(cores, 0.25)
    unlimited = tmp_path / "unlimited"
    unlimited.write_text("max 100000\n")
    assert node_cpus(unlimited) == cores
    assert node_cpus(tmp_path / "absent", tmp_path / "absent") == cores
    v1 = tmp_path / "cpu"
    v1.mkdir()
    (v1 / "cpu.cfs_quota_us").write_text("25000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert node_cpus(tmp_path / "absent", v1) == min(cores, 0.25)  # Docker's --cpus 0.25 on cgroup v1
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert node_cpus(tmp_path / "absent", v1) == cores


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "2", 1e9])
def test_a_bad_hello_cpus_is_refused(bad):
    with pytest.raises(ValueError, match="cpus"):
        hello_cpus(bad)
    assert hello_cpus(None) is None and hello_cpus(2) == 2.0
