"""wiiide.server.ps.membership's pieces: a shard's momentum rewound to the barrier's step, the worker's
step snapshots, and the digests of a copy by shard."""

from __future__ import annotations

import numpy as np
import torch

from wiiide.training.model import MomentumSGD
from wiiide.server.ps.membership import copy_digests, momentum_at, sha256_of
from wiiide.server.ps.survivor import StepSnapshots
from wiiide.server.ps.partition import Partition
from wiiide.server.recovery import momentum_to_flat


def test_a_partition_one_update_past_the_barrier_gives_back_the_momentum_of_the_barrier():
    rng = np.random.default_rng(3)
    param = torch.from_numpy(rng.standard_normal(64).astype(np.float32))
    param.grad = torch.zeros_like(param)
    opt = MomentumSGD([param], lr=0.1, momentum=0.9)
    at_barrier = None
    for step in range(3):
        if step == 2:
            at_barrier = momentum_to_flat(opt)
        param.grad.copy_(torch.from_numpy(rng.standard_normal(64).astype(np.float32)))
        opt.step()
    zeros = np.zeros(64, np.float32)
    states = [(0, 3, momentum_to_flat(opt), param.grad.numpy().copy(), zeros), (1, 2, at_barrier, zeros, zeros),
              (2, 5, at_barrier, zeros, zeros), (3, 2, None, zeros, zeros)]
    out = {index: values for index, step, values in momentum_at(states, 2, 0.9)}
    assert set(out) == {0, 1}  # two updates past it cannot be rewound; no buffer, nothing to keep
    np.testing.assert_allclose(out[0], at_barrier, rtol=0, atol=1e-6)
    assert np.array_equal(out[1], at_barrier)
    assert momentum_at(states, 2, 0.0) == []


def test_snapshots_keep_the_latest_steps_and_digests_split_by_shard():
    snaps = StepSnapshots(kept=2)
    params = torch.arange(6, dtype=torch.float32)
    for step in range(4):
        snaps.keep(step, params + step)
    assert snaps.latest == 3 and snaps.get(1) is None and np.array_equal(snaps.get(2), np.arange(6) + 2.0)
    parts = [Partition(0, 0, 2, 1), Partition(1, 2, 4, 0), Partition(2, 4, 6, 1)]
    values = np.arange(6, dtype=np.float32)
    digests = copy_digests(values, parts, 2)
    assert digests["sha256"] == sha256_of(values)
    assert digests["shards"] == [sha256_of(values[2:4]), sha256_of(np.concatenate([values[0:2], values[4:6]]))]
    other = values.copy()
    other[5] += 1
    assert copy_digests(other, parts, 2)["shards"][0] == digests["shards"][0] != copy_digests(other, parts, 2)["shards"][1]
