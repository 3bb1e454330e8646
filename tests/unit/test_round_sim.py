"""The simulation of the sharded servers' steps on shared cores and shaped links (harness/analysis/round_sim.py)."""

from __future__ import annotations

import pytest

from harness.analysis.round_model import sharded_round_s
from harness.analysis.round_sim import NodeCpu, cgroup_fair_shares, simulate_sharded_steps

MB = 1_000_000
RATE_BPS = 8 * MB  # one MB/s: a 1 MB message takes 1 s on the link
FAST_BPS = 8e15  # a link that takes no time


@pytest.mark.parametrize("runnable, cores, expected", [
    ({0: 3, 1: 1}, 2, {0: 1.0, 1: 1.0}),  # equal groups, whatever their threads
    ({0: 3, 1: 1}, 3, {0: 2.0, 1: 1.0}),  # node 1 can use one core: node 0 gets the rest
    ({0: 1, 1: 1, 2: 1}, 2, {0: 2 / 3, 1: 2 / 3, 2: 2 / 3}),
    ({0: 1, 1: 4}, 8, {0: 1.0, 1: 4.0}),  # more cores than threads: one each
])
def test_cgroup_fair_shares_split_the_cores_equally_between_busy_nodes(runnable, cores, expected):
    assert cgroup_fair_shares(runnable, cores) == pytest.approx(expected)


@pytest.mark.parametrize("partitions, workers", [
    ([(0, 1 * MB), (1, 1 * MB), (2, 1 * MB)], 2),
    ([(0, 0.5 * MB), (1, 2 * MB), (2, 1 * MB), (3, 1 * MB), (1, 0.25 * MB)], 3),
    ([(0, 1 * MB), (1, 1 * MB), (2, 1 * MB), (3, 1 * MB), (4, 1 * MB)], 4),
])
@pytest.mark.parametrize("burst_bytes", [0.0, 50_000.0])
@pytest.mark.parametrize("window_bytes", [None, 0.0, 100_000.0])
def test_without_cpu_a_step_is_the_compute_then_the_links_round(partitions, workers, burst_bytes, window_bytes):
    """No CPU: one step is the compute and the links' round as the round model's own fluid simulation of
    the links has it (two codes of one model of the links), with concurrent or ordered pushes."""
    nodes = [NodeCpu()] + [NodeCpu(compute_floor_s=0.2) for _ in range(workers)]
    round_s = sharded_round_s(partitions, workers, RATE_BPS, push_window_bytes=window_bytes, burst_bytes=burst_bytes)
    assert simulate_sharded_steps(partitions, workers, RATE_BPS, nodes, 2.0, burst_bytes=burst_bytes,
                                  push_window_bytes=window_bytes, steps=1, skipped_steps=0) == \
        pytest.approx(0.2 + round_s, rel=1e-6)


def test_steps_overlap_where_the_workers_finish_apart():
    """With shards of unequal loads a worker whose pulls are in early starts its next step while the
    others still receive theirs; its pushes then queue behind the round still under way on the shared
    links, so the steady step is longer than one isolated round (and never shorter)."""
    partitions, workers = [(0, 0.5 * MB), (1, 2 * MB), (2, 1 * MB), (3, 1 * MB), (1, 0.25 * MB)], 3
    nodes = [NodeCpu()] + [NodeCpu(compute_floor_s=0.2) for _ in range(workers)]
    one = simulate_sharded_steps(partitions, workers, RATE_BPS, nodes, 2.0, steps=1, skipped_steps=0)
    assert simulate_sharded_steps(partitions, workers, RATE_BPS, nodes, 2.0) > one * 1.02
    symmetric = [(0, 1 * MB), (1, 1 * MB), (2, 1 * MB)]
    nodes = nodes[:3]
    assert simulate_sharded_steps(symmetric, 2, RATE_BPS, nodes, 2.0) == \
        pytest.approx(simulate_sharded_steps(symmetric, 2, RATE_BPS, nodes, 2.0, steps=1, skipped_steps=0))


def test_compressed_bytes_cross_faster():
    partitions, nodes = [(0, 1 * MB), (1, 1 * MB)], [NodeCpu(), NodeCpu()]
    dense = simulate_sharded_steps(partitions, 1, RATE_BPS, nodes, 1.0)
    assert dense == pytest.approx(2.0)  # the worker pushes 1 MB to the coordinator, which pulls 1 MB back
    assert simulate_sharded_steps(partitions, 1, RATE_BPS, nodes, 1.0, worker_ratio=4, coordinator_ratio=2) == \
        pytest.approx(0.25 + 0.5)


@pytest.mark.parametrize("cores, expected_s", [(1.0, 0.2), (2.0, 0.1), (4.0, 0.1)])
def test_workers_compute_on_the_shared_cores(cores, expected_s):
    """Two workers with 0.1 s of forward and backward each and links that take no time: one core runs
    them one after the other's share (0.2 s), two side by side; a thread never runs on two cores."""
    nodes = [NodeCpu()] + [NodeCpu(compute_s=0.1) for _ in range(2)]
    assert simulate_sharded_steps([(1, 1000.0), (2, 1000.0)], 2, FAST_BPS, nodes, cores) == \
        pytest.approx(expected_s, rel=1e-6)


def test_send_and_receive_cpu_run_while_the_bytes_cross_and_the_decode_after():
    """One worker, its partition on the coordinator: 1 s of link each way. The send and receive CPU
    (0.5 s each side) hide under the link; each decode (0.3 s) follows its message's arrival."""
    partitions = [(0, 1 * MB)]
    overlapped = {"push_send": 0.5, "pull_receive": 0.5}
    nodes = [NodeCpu(stages={"push_receive": 0.5, "pull_send": 0.5}), NodeCpu(stages=overlapped)]
    assert simulate_sharded_steps(partitions, 1, RATE_BPS, nodes, 2.0) == pytest.approx(2.0)
    nodes = [NodeCpu(stages={"push_decode": 0.3}), NodeCpu(stages={"pull_decode": 0.3})]
    assert simulate_sharded_steps(partitions, 1, RATE_BPS, nodes, 2.0) == pytest.approx(2.6)


def test_a_slow_sender_holds_its_message_back():
    """A send that needs more CPU than the link's time (1.5 s against 1 s) sets the message's pace."""
    nodes = [NodeCpu(), NodeCpu(stages={"push_send": 1.5})]
    assert simulate_sharded_steps([(0, 1 * MB)], 1, RATE_BPS, nodes, 1.0) == pytest.approx(2.5)


def test_ordered_pushes_are_encoded_ahead_by_one_thread():
    """Ordered pushes: one thread encodes them in order (0.25 s each of two), another sends each once the
    one before has crossed (window 0): the second encode hides under the first push's link time, and
    the first pull crosses the coordinator's link while the second push crosses the worker's."""
    nodes = [NodeCpu(), NodeCpu(stages={"push_encode": 0.5})]
    partitions = [(0, 1 * MB), (0, 1 * MB)]
    assert simulate_sharded_steps(partitions, 1, RATE_BPS, nodes, 2.0, push_window_bytes=0.0, steps=1,
                                  skipped_steps=0) == pytest.approx(0.25 + 1.0 + 1.0 + 1.0)
    concurrent = simulate_sharded_steps(partitions, 1, RATE_BPS, nodes, 2.0, steps=1, skipped_steps=0)
    assert concurrent == pytest.approx(0.25 + 2.0 + 1.0)  # one sender thread: encode, send, encode, send


def test_encode_and_update_come_between_the_compute_and_the_links():
    """The worker encodes (0.2 s) before its push leaves, the shard updates (0.1 s) before its pull."""
    nodes = [NodeCpu(stages={"update": 0.1}), NodeCpu(stages={"push_encode": 0.2})]
    assert simulate_sharded_steps([(0, 1 * MB)], 1, RATE_BPS, nodes, 2.0) == pytest.approx(2.3)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="out of range"):
        simulate_sharded_steps([(0, MB)], 1, RATE_BPS, [NodeCpu()], 1.0)  # two nodes needed
    with pytest.raises(ValueError, match="out of range"):
        simulate_sharded_steps([(2, MB)], 1, RATE_BPS, [NodeCpu(), NodeCpu()], 1.0)  # no shard 2
    with pytest.raises(ValueError, match="out of range"):
        simulate_sharded_steps([(0, MB)], 1, RATE_BPS, [NodeCpu(), NodeCpu()], 0.0)
