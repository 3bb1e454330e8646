"""Sparse rows under the central pace server (wiiide.server.pace.rows, wiiide.server.sparse): local SGD on rows
gives dense local SGD's delta and leaves the worker's copy where it was, each pull carries exactly the rows
changed since that worker's copy (the copy then equals the server's to the bit), a round sums the rows per
id in rank order (weighted by samples with adaptive batches), and a bad push is refused."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from tests.unit.test_workloads import decode
from wiiide.errors import ProtocolError
from wiiide.server.pace.outer import local_delta
from wiiide.server.pace.rows import PaceRows, RowsUpdate
from wiiide.server.sparse import SET_KIND, SparseRows
from wiiide.training.model import FlatParams
from wiiide.training.models.embedding import build_embedding, make_zipf_data
from wiiide.wire.encode import encode_message
from wiiide.wire.messages import WireTensor

ROWS, DIM, FIELDS = 500, 8, 4


def _wire(frame) -> bytes:
    return b"".join(bytes(b) for b in frame.buffers)


def _setup(seed: int = 0):
    model = build_embedding(ROWS, DIM, FIELDS, seed=seed)
    return model, FlatParams(model)


def _ce(logits, y):
    return nn.functional.cross_entropy(logits, y)


def test_local_sgd_on_rows_gives_the_dense_delta_and_puts_the_copy_back():
    model, flat = _setup()
    dense_model = copy.deepcopy(model)
    dense_flat = FlatParams(dense_model)
    x, y = (torch.from_numpy(a) for a in make_zipf_data(64, ROWS, FIELDS, 1.1, 3))
    sparse = SparseRows(model, flat.numel)
    before = flat.params.clone()
    ids, delta_rows, delta_rest, loss = sparse.local_delta(model, flat, x, y, 4, 0.5, 1, _ce)
    assert torch.equal(flat.params, before)  # the copy is back at what the server sent
    dense, dense_loss = local_delta(dense_model, dense_flat, x, y, 4, 0.5, loss_fn=_ce)
    table = dense[:ROWS * DIM].view(ROWS, DIM)
    assert torch.equal(ids, torch.unique(x)) and loss == pytest.approx(dense_loss, rel=1e-6)
    torch.testing.assert_close(delta_rows, table[ids], rtol=1e-5, atol=1e-7)
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[ids] = False
    assert not table[untouched].any()  # rows no step touched do not move
    torch.testing.assert_close(delta_rest, dense[ROWS * DIM:], rtol=1e-5, atol=1e-7)


def _update(ids, rows, rest_numel, value=0.0):
    ids = torch.tensor(ids, dtype=torch.int64)
    return RowsUpdate(ids, torch.as_tensor(rows, dtype=torch.float32).reshape(len(ids), DIM),
                      torch.full((rest_numel,), value, dtype=torch.float32))


def test_each_pull_carries_the_rows_changed_since_that_workers_copy():
    model, flat = _setup()
    sparse = SparseRows(model, flat.numel)
    rows = PaceRows(sparse, local_sgd=False, weighted=False)
    full_calls = []

    def full():
        full_calls.append(1)
        return encode_message("params", {"step": 0}, [WireTensor("params", flat.params.numpy().copy())])

    copies = {}
    for rank in (1, 2):  # first tasks: the full parameters
        msg = decode(_wire(rows.frame_for(rank, 0, flat.params, full)))
        copies[rank] = torch.from_numpy(msg.tensor("params").copy())
    assert len(full_calls) == 2
    rest_numel = sparse.rest_numel
    rows.apply(flat.params, _update([3, 7], np.ones((2, DIM)), rest_numel, 0.5), lr=0.1)
    msg = decode(_wire(rows.frame_for(1, 1, flat.params, full)))
    assert msg.meta["update"] == SET_KIND and msg.tensor("set_ids").tolist() == [3, 7]
    sparse.set_rows(msg, copies[1])
    assert torch.equal(copies[1], flat.params)  # worker 1's copy is the server's, bit for bit
    rows.apply(flat.params, _update([7, 9], np.ones((2, DIM)), rest_numel, 0.25), lr=0.1)
    got = {rank: decode(_wire(rows.frame_for(rank, 2, flat.params, full))) for rank in (1, 2)}
    assert got[1].tensor("set_ids").tolist() == [7, 9]  # only what moved since its last pull
    assert got[2].tensor("set_ids").tolist() == [3, 7, 9]  # both updates since its full copy
    for rank in (1, 2):
        sparse.set_rows(got[rank], copies[rank])
        assert torch.equal(copies[rank], flat.params)
    assert len(full_calls) == 2 and rows.record() == {"pulls_full": 2, "pulls_rows": 3, "rows_per_pull": 7 / 3}
    rows.forget(1)  # a dropped worker holds no copy: its next task is in full
    rows.frame_for(1, 2, flat.params, full)
    assert len(full_calls) == 3


@pytest.mark.parametrize("weighted", [False, True])
def test_a_round_sums_the_rows_per_id_in_rank_order(weighted):
    model, flat = _setup()
    sparse = SparseRows(model, flat.numel)
    rows = PaceRows(sparse, local_sgd=True, weighted=weighted)
    n = sparse.rest_numel
    a = _update([1, 4], np.full((2, DIM), 2.0), n, 1.0)
    b = _update([4, 6], np.full((2, DIM), 6.0), n, 3.0)
    mean = rows.mean([(2, b, 96), (1, a, 32)])  # arrival order is not rank order
    assert mean.ids.tolist() == [1, 4, 6]
    wa, wb = (0.25, 0.75) if weighted else (0.5, 0.5)
    assert mean.rows[:, 0].tolist() == [2.0 * wa, 2.0 * wa + 6.0 * wb, 6.0 * wb]
    assert mean.rest[0].item() == 1.0 * wa + 3.0 * wb
    before = flat.params.clone()
    rows.apply(flat.params, mean, lr=0.1)  # local SGD's avg: rate 1, params -= mean delta
    table = flat.params[:ROWS * DIM].view(ROWS, DIM)
    assert torch.equal(table[1], before[:ROWS * DIM].view(ROWS, DIM)[1] - 2.0 * wa)
    assert torch.equal(table[0], before[:DIM])  # a row no push touched stays


def test_a_bad_row_push_is_refused_before_anything_is_applied():
    model, flat = _setup()
    sparse = SparseRows(model, flat.numel)
    rows = PaceRows(sparse, local_sgd=False, weighted=False)
    rest = np.zeros(sparse.rest_numel, dtype=np.float32)

    def push(ids, prefix="grad"):
        ids = np.asarray(ids, dtype=np.int32)
        return decode(_wire(encode_message("gradients", {"step": 0}, [
            WireTensor(f"{prefix}_ids", ids), WireTensor(f"{prefix}_rows", np.ones((len(ids), DIM), np.float32)),
            WireTensor(f"{prefix}_rest", rest)])))

    assert rows.check(push([2, 5])).ids.tolist() == [2, 5]
    for bad, match in (([5, 2], "increasing"), ([1, ROWS], "range"), ([-1, 3], "range")):
        with pytest.raises(ProtocolError, match=match):
            rows.check(push(bad))
    with pytest.raises(ProtocolError, match="grad_ids"):
        rows.check(push([1, 2], prefix="delta"))  # a delta where gradients are expected
