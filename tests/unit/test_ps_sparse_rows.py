"""Sparse rows on the sharded servers (wiiide.server.ps.sparse_rows, wiiide.server.ps.partition.align_to_rows): the
table's partitions are whole rows, a push of a row partition carries only the touched rows of its range
(bytes on the wire against the dense push), the shard's update and the worker's pull leave both copies
equal to a dense SGD step, and a bad frame is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests.unit.test_workloads import decode
from wiiide.errors import ProtocolError
from wiiide.training.model import FlatParams
from wiiide.training.models.embedding import build_embedding, make_zipf_data
from wiiide.server.ps.partition import Partition, align_to_rows, plan_partitions
from wiiide.server.ps.sparse_rows import ROWS_PUSH_KIND, RowTable, WorkerRows, apply_rows, rows_frame

ROWS, DIM, FIELDS = 100_000, 16, 8


def _wire(frame) -> bytes:
    return b"".join(bytes(b) for b in frame.buffers)


def _setup(batch: int = 32, seed: int = 0):
    model = build_embedding(ROWS, DIM, FIELDS, seed=seed)
    flat = FlatParams(model)
    parts = plan_partitions(flat.numel, 4, 3, 1 << 20, table=(ROWS, DIM))
    x, y = make_zipf_data(batch, ROWS, FIELDS, 1.1, seed)
    return model, flat, parts, torch.from_numpy(x), torch.from_numpy(y)


def test_the_plan_cuts_the_table_at_row_boundaries_and_keeps_every_shard():
    _, flat, parts, _, _ = _setup()
    table = RowTable(ROWS, DIM)
    assert [p.index for p in parts] == list(range(len(parts))) and parts[0].start == 0 and parts[-1].stop == flat.numel
    assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
    inside = [p for p in parts if table.owns(p)]
    assert inside and all(p.start % DIM == 0 and p.stop % DIM == 0 for p in inside)
    assert any(p.start == table.numel for p in parts)  # the MLP starts a partition of its own
    assert {p.shard for p in inside} == {0, 1, 2, 3}
    assert len(inside) == 4  # one row partition per shard: its pieces merged (a push is its touched rows)
    dealt = plan_partitions(flat.numel, 4, 3, 1 << 20, per_shard=8, placement="interleaved", table=(ROWS, DIM))
    assert len([p for p in dealt if table.owns(p)]) == 4  # in contiguous ranges whatever the placement
    # cuts move to the nearest row boundary; a shard's share under one row leaves it nothing: refused
    moved = align_to_rows([Partition(0, 0, 20, 0), Partition(1, 20, 40, 1), Partition(2, 40, 50, 2)], 32, 16)
    assert [(p.start, p.stop, p.shard) for p in moved] == [(0, 16, 0), (16, 32, 1), (32, 40, 1), (40, 50, 2)]
    with pytest.raises(ValueError, match="less than one"):
        align_to_rows([Partition(0, 0, 7, 0), Partition(1, 7, 40, 1)], 32, 16)


def test_a_push_of_a_row_partition_carries_only_its_touched_rows():
    model, flat, parts, x, y = _setup()
    table = RowTable(ROWS, DIM)
    rows = WorkerRows(table, model, flat.numel, parts)
    sent = []
    loss = rows.gradient(model, flat, x, y, 1, nn.functional.cross_entropy, 7, lambda p, f: sent.append((p, f)))
    assert loss > 0 and [p.index for p, _ in sent] == [p.index for p in parts if table.owns(p)]
    # the reference: the dense gradient of the same batch (nn.Embedding's backward)
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    dense_table_grad = model.table.weight.grad
    touched = torch.unique(x).numpy()
    wire_bytes = dense_bytes = 0
    for part, frame in sent:
        r0, r1 = table.row_range(part)
        msg = decode(_wire(frame))
        assert msg.kind == ROWS_PUSH_KIND and msg.meta == {"step": 7, "partition": part.index}
        ids, grads = table.check(msg, part)
        mine = touched[(touched >= r0) & (touched < r1)]
        np.testing.assert_array_equal(ids + r0, mine)  # exactly the touched rows of this range
        torch.testing.assert_close(torch.from_numpy(grads), dense_table_grad[mine], rtol=1e-6, atol=1e-7)
        assert frame.payload_nbytes == len(mine) * (4 + 4 * DIM)  # int32 id + dim float32 per row, no more
        wire_bytes += frame.wire_nbytes
        dense_bytes += part.nbytes
    assert len(touched) <= 32 * FIELDS and wire_bytes * 100 < dense_bytes  # 256 rows at most of 100,000


def test_the_shard_update_and_the_pull_equal_a_dense_sgd_step_on_both_copies():
    table = RowTable(ROWS, DIM)
    _, flat, parts, _, _ = _setup()
    part = next(p for p in parts if table.owns(p) and p.start > 0)
    r0, r1 = table.row_range(part)
    start = torch.randn(part.numel)
    shard_param, worker_params = start.clone(), flat.params.clone()
    worker_params[part.start:part.stop] = start
    rng = np.random.default_rng(1)
    pushes = {}
    dense = torch.zeros(r1 - r0, DIM)
    for rank in (2, 1, 3):
        ids = np.unique(rng.integers(0, r1 - r0, 20)).astype(np.int32)
        grads = rng.standard_normal((len(ids), DIM)).astype(np.float32)
        pushes[rank] = (ids, grads)
        dense[torch.from_numpy(ids.astype(np.int64))] += torch.from_numpy(grads)
    frame = apply_rows(table, part, shard_param, pushes, 0.1, {"step": 3, "partition": part.index})
    expected = start.view(-1, DIM) - 0.1 * dense / 3
    torch.testing.assert_close(shard_param.view(-1, DIM), expected, rtol=1e-6, atol=1e-6)
    worker = WorkerRows(table, build_embedding(ROWS, DIM, FIELDS, seed=0), flat.numel, parts)
    index, ids, rows, lr = worker.read(decode(_wire(frame)))
    assert index == part.index and lr == 0.1
    assert len(ids) == len(np.unique(np.concatenate([i for i, _ in pushes.values()])))  # the changed rows only
    worker.apply(worker_params, part, ids, rows, lr)
    assert torch.equal(worker_params[part.start:part.stop], shard_param)  # bit for bit
    assert torch.equal(worker_params[:part.start], flat.params[:part.start])  # nothing else moved


@pytest.mark.parametrize("ids, rows, match", [
    (np.array([3, 1], np.int32), np.zeros((2, DIM), np.float32), "strictly increasing"),
    (np.array([0, 10**6], np.int32), np.zeros((2, DIM), np.float32), "out of range"),
    (np.array([0, 1], np.int64), np.zeros((2, DIM), np.float32), "int32"),
    (np.array([0, 1], np.int32), np.zeros((2, DIM + 1), np.float32), "float32"),
])
def test_a_bad_rows_frame_is_refused_before_anything_is_indexed(ids, rows, match):
    table = RowTable(ROWS, DIM)
    _, _, parts, _, _ = _setup()
    part = next(p for p in parts if table.owns(p))
    frame = rows_frame(ROWS_PUSH_KIND, {"step": 0, "partition": part.index}, RowTable(2**31 if ids.dtype == np.int64
                                                                                      else ROWS, DIM),
                       ids, torch.from_numpy(rows))
    with pytest.raises(ProtocolError, match=match):
        table.check(decode(_wire(frame)), part)
