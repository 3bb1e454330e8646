"""wiiide.server.ps.paced_recovery: the state after a loss under on-arrival pacing, from ps_state frames that
went through the wire. A partition whose shard survived starts from that shard (values and momentum);
a lost shard's partition from the survivor copy with the highest version (ties: the lowest rank),
with zero momentum; a copy whose digest or versions are malformed is not used."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.test_ps_sparse_rows import _wire
from tests.unit.test_workloads import decode
from wiiide.server.ps.digest import params_digest
from wiiide.server.ps.paced_recovery import assemble, worker_answer
from wiiide.server.ps.partition import Partition
from wiiide.wire.encode import encode_message

# 3 partitions of 4, 4 and 2 values on shards 0 (the coordinator), 1 (worker 1) and 2 (worker 2, lost)
PARTS = [Partition(0, 0, 4, 0), Partition(1, 4, 8, 1), Partition(2, 8, 10, 2)]


class _ClosedShard:
    """What worker_answer reads of a closed ShardServer: its partition_states."""

    def __init__(self, states):
        self.states = states

    def partition_states(self):
        return self.states


def _answer(rank_copy: np.ndarray, versions: list, shard=None, sha=None):
    meta = {"step": 7, "sha256": sha or params_digest(rank_copy)["sha256"], "latest_step": 3}
    tensors = worker_answer(meta, rank_copy, versions, shard)
    msg = decode(_wire(encode_message("ps_state", meta, tensors)))
    return msg.meta, msg


def _full(value: float) -> np.ndarray:
    return np.full(10, value, np.float32)


def test_surviving_shards_keep_their_partitions_and_the_newest_copy_fills_the_lost_one():
    own = [(0, 9, np.full(4, 0.5, np.float32), np.zeros(4, np.float32), np.full(4, 10.0, np.float32))]
    shard1 = _ClosedShard([(1, 8, np.full(4, 0.25, np.float32), np.zeros(4, np.float32), np.full(4, 11.0, np.float32))])
    answers = {1: _answer(_full(1.0), [9, 8, 5], shard1),  # worker 1 hosts shard 1; its copy of p2 at version 5
               3: _answer(_full(3.0), [9, 8, 6])}  # worker 3's copy of p2 is newer: version 6
    params, momentum, record = assemble(PARTS, 10, own, answers, with_momentum=True)
    np.testing.assert_array_equal(params, np.array([10] * 4 + [11] * 4 + [3] * 2, np.float32))
    np.testing.assert_array_equal(momentum, np.array([0.5] * 4 + [0.25] * 4 + [0] * 2, np.float32))
    assert record == {"from_shards": 2, "from_copies": {"2": {"rank": 3, "version": 6}}, "momentum_kept": 2}


def test_equal_versions_take_the_lowest_rank_and_no_momentum_is_kept_without_it():
    answers = {3: _answer(_full(3.0), [1, 1, 4]), 1: _answer(_full(1.0), [1, 1, 4])}
    params, momentum, record = assemble(PARTS, 10, [], answers, with_momentum=False)
    np.testing.assert_array_equal(params, _full(1.0))
    assert momentum is None and record["from_shards"] == 0 and record["momentum_kept"] == 0
    assert record["from_copies"] == {str(i): {"rank": 1, "version": v} for i, v in enumerate([1, 1, 4])}


def test_a_copy_with_a_wrong_digest_or_versions_is_not_used():
    bad_digest = _answer(_full(5.0), [0, 0, 9], sha="0" * 64)
    short_versions = _answer(_full(6.0), [0, 9])
    answers = {1: bad_digest, 2: short_versions, 3: _answer(_full(3.0), [0, 0, 2])}
    params, _, record = assemble(PARTS, 10, [], answers, with_momentum=False)
    np.testing.assert_array_equal(params, _full(3.0))
    assert record["from_copies"]["2"] == {"rank": 3, "version": 2}
    with pytest.raises(ValueError, match="partition 0: its shard was lost and no survivor's copy holds it"):
        assemble(PARTS, 10, [], {1: bad_digest, 2: short_versions}, with_momentum=False)


def test_a_copy_never_pulled_under_on_arrival_pacing_does_not_fill_a_partition():
    never = _answer(_full(1.0), [None, None, None])
    params, _, record = assemble(PARTS, 10, [], {1: never, 2: _answer(_full(2.0), [0, 1, 3])}, with_momentum=False)
    np.testing.assert_array_equal(params, _full(2.0))
    assert {c["rank"] for c in record["from_copies"].values()} == {2}
    with pytest.raises(ValueError, match="partition 0"):
        assemble(PARTS, 10, [], {1: never}, with_momentum=False)
