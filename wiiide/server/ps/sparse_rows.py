"""Sparse embedding rows on the sharded servers (``sparse_embedding: true`` with ``ps_shards`` > 1).

The embedding table is the first ``rows x dim`` values of the flat vector (`wiiide.server.sparse`). Its
partitions are cut at row boundaries (`wiiide.server.ps.partition.align_to_rows`), so each shard owns whole
rows ``[r0, r1)`` of it (a *row partition*); the partitions after the table (the MLP) are dense as
ever. Per step, for a row partition:

- push (`WorkerRows.gradient`): a worker computes the table's gradient as its batch's distinct rows
  (`wiiide.server.sparse.SparseRows.gradient`: no dense ``rows x dim`` gradient exists) and sends each row
  partition's shard only the touched rows of that range: ``ids`` (partition-local row numbers, int32
  below 2^31 rows, strictly increasing) and ``rows`` (float32 ``u x dim``), raw, in a ``ps_rows``
  frame; a partition none of its rows touched gets an empty one (the shard counts every worker's push).
  The MLP's partitions are pushed by the backward hooks as before (`wiiide.server.ps.client`).
- local SGD (``local_steps`` H > 1, outer ``avg``): a worker's H steps update its rows by `sgd_rows`
  (`WorkerRows.local_delta`) and it pushes the model delta of the rows its steps touched; the shard's
  outer step is the same SGD at rate 1 on the mean delta.
- the shard (`apply_rows`): once every worker's push is in, the rows are summed per id in rank order
  (`wiiide.server.sparse.sum_rows`, as the central server sums them), divided by the workers, and plain SGD
  runs on those rows only (`wiiide.server.sparse.sgd_rows`; momentum is refused with sparse rows, as on the
  central server, since it would move every row every step).
- pull: the shard sends every worker the averaged rows and the step's learning rate (``ps_rows_update``);
  the worker runs the very `sgd_rows` the shard ran (`WorkerRows.apply`), so both copies stay bitwise
  equal and no row that did not change crosses the link.

Bytes per step on the table's side: a worker pushes (4 + 4 dim) bytes per distinct row of its batch
and pulls (4 + 4 dim) per distinct row of all the workers' batches, over its k shard links, instead of
the table's ``4 rows dim`` bytes each way. Row frames skip the compression policy (the rows are already
the few bytes that changed, and the worker must apply exactly what the shard applied); the MLP's
partitions use it as before.

Ids from the network are checked (`wiiide.codecs.rows.check_row_ids`: in the partition's rows,
strictly increasing) before anything is indexed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from wiiide.codecs.rows import check_row_ids
from wiiide.errors import ProtocolError
from wiiide.lr_schedule import wire_lr
from wiiide.server.pace.outer import gradient
from wiiide.server.ps.partition import Partition
from wiiide.server.sparse import SparseRows, mean_rows, sgd_rows
from wiiide.wire.tensors import to_wire
from wiiide.wire.encode import encode_message
from wiiide.wire.messages import Frame, Message, WireTensor

ROWS_PUSH_KIND = "ps_rows"  # worker -> shard: the touched rows of one row partition
ROWS_PULL_KIND = "ps_rows_update"  # shard -> worker: the averaged rows of one row partition and the rate


def table_shape(cfg: Any) -> tuple[int, int] | None:
    """(rows, dim) of the embedding table whose partitions are row partitions (`cfg`: a RunConfig with
    ``sparse_embedding``), else None (every partition dense)."""
    return (int(cfg.embedding_rows), int(cfg.embedding_dim)) if cfg.sparse_embedding else None


@dataclass(frozen=True)
class RowTable:
    """The table's geometry: `rows` x `dim` float32 values at the head of the flat vector."""

    rows: int
    dim: int

    @classmethod
    def from_config(cls, cfg: Any) -> "RowTable | None":
        """The run's table (`table_shape`), or None without sparse rows."""
        shape = table_shape(cfg)
        return cls(*shape) if shape is not None else None

    @property
    def numel(self) -> int:
        """The table's values in the flat vector (rows x dim)."""
        return self.rows * self.dim

    @property
    def id_dtype(self) -> type:
        """The ids' wire dtype: int32 below 2^31 rows, else int64 (as `wiiide.server.sparse`)."""
        return np.int32 if self.rows < 2**31 else np.int64

    def owns(self, part: Partition) -> bool:
        """Whether `part` is a row partition (inside the table; the plan cuts it at row boundaries)."""
        return part.stop <= self.numel

    def row_range(self, part: Partition) -> tuple[int, int]:
        """The rows ``[r0, r1)`` of row partition `part`.

        Raises:
            ValueError: `part` is not whole rows of the table (a plan not cut by `align_to_rows`).
        """
        if not self.owns(part) or part.start % self.dim or part.stop % self.dim:
            raise ValueError(f"partition {part.index} [{part.start}, {part.stop}) is not whole rows of the "
                             f"{self.rows} x {self.dim} table")
        return part.start // self.dim, part.stop // self.dim

    def check(self, msg: Message, part: Partition) -> tuple[np.ndarray, np.ndarray]:
        """The (ids, rows) of a ``ps_rows`` push or ``ps_rows_update`` pull of `part`, checked and copied
        (the reader reuses its buffer): ids `id_dtype` (u,) strictly increasing in 0..rows of `part`,
        rows float32 (u, dim).

        Raises:
            ProtocolError: other tensors, shapes or dtypes, or ids out of range or not increasing.
        """
        names = [t.name for t in msg.tensors]
        if names != ["ids", "rows"]:
            raise ProtocolError(f"{msg.kind} of partition {part.index}: tensors {names!r:.80}, expected ['ids', 'rows']")
        ids, rows = msg.tensor("ids"), msg.tensor("rows")
        if ids.ndim != 1 or ids.dtype != self.id_dtype:
            raise ProtocolError(f"{msg.kind} of partition {part.index}: ids of shape {ids.shape} {ids.dtype}, "
                                f"expected (u,) {np.dtype(self.id_dtype)}")
        if rows.shape != (ids.shape[0], self.dim) or rows.dtype != np.float32:
            raise ProtocolError(f"{msg.kind} of partition {part.index}: rows of shape {rows.shape} {rows.dtype}, "
                                f"expected ({ids.shape[0]}, {self.dim}) float32")
        r0, r1 = self.row_range(part)
        check_row_ids(ids, r1 - r0, f"{msg.kind} of partition {part.index}: ids")
        return ids.copy(), rows.copy()


def rows_frame(kind: str, meta: dict[str, Any], table: RowTable, ids: np.ndarray | torch.Tensor,
               rows: torch.Tensor) -> Frame:
    """A raw ``ps_rows`` / ``ps_rows_update`` frame: ``ids`` (partition-local, `table.id_dtype`) and
    ``rows`` (float32 (u, dim))."""
    ids = ids.numpy() if isinstance(ids, torch.Tensor) else ids
    return encode_message(kind, meta, [WireTensor("ids", np.ascontiguousarray(ids, dtype=table.id_dtype)),
                                       to_wire("rows", rows)])


def apply_rows(table: RowTable, part: Partition, param: torch.Tensor,
               pushes: dict[int, tuple[np.ndarray, np.ndarray]], lr: float, meta: dict[str, Any],
               samples: dict[int, int] | None = None) -> Frame:
    """A shard's step of row partition `part`: SGD at rate `lr` on `param` (its float32 values, flat)
    from the workers' `pushes` (rank -> (ids, rows) as `RowTable.check` returns them, summed per id in
    rank order, averaged over the pushes; with `samples`, rank -> its batch's samples (adaptive batches),
    weighted by them); returns the pull frame (``ps_rows_update`` with `meta` and the rate)."""
    ranks = sorted(pushes)
    total = sum(samples[r] for r in ranks) if samples is not None else 0
    ids, summed = mean_rows([pushes[r] for r in ranks], table.dim,
                            [samples[r] / total for r in ranks] if samples is not None else None)
    sgd_rows(param.view(-1, table.dim), ids, summed, lr)
    return rows_frame(ROWS_PULL_KIND, {**meta, "lr": lr}, table, ids, summed)


class WorkerRows:
    """A worker's side of the row partitions: the gradient as rows, the pushes, the pulls applied.

    Args:
        table: the run's `RowTable`; model: the embedding model (`wiiide.training.models.embedding.EmbeddingMLP`);
        numel: its flat vector's values; partitions: the run's plan (cut by `align_to_rows`).
    """

    def __init__(self, table: RowTable, model: nn.Module, numel: int, partitions: Sequence[Partition]) -> None:
        self.table = table
        self.sparse = SparseRows(model, numel)
        if (self.sparse.rows, self.sparse.dim) != (table.rows, table.dim):
            raise ValueError(f"the model's table is {self.sparse.rows} x {self.sparse.dim}, the run's "
                             f"{table.rows} x {table.dim}")
        self.parts = [p for p in partitions if table.owns(p)]
        self._by_index = {p.index: p for p in self.parts}
        self._starts = np.array([table.row_range(p)[0] for p in self.parts] + [table.rows], dtype=np.int64)

    def gradient(self, model: nn.Module, flat: Any, x: torch.Tensor, y: torch.Tensor, micro_batches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], step: int,
                 send: Callable[[Partition, Frame], None], scope: Any = None) -> float:
        """The batch's gradient (the MLP's in ``flat.grads``, where the backward hooks push it from) and
        one ``ps_rows`` push per row partition through `send` (its touched rows). Returns the mean loss.
        `scope`: as `wiiide.server.sparse.SparseRows.gradient`'s.

        Raises:
            IndexError: an id outside the table (`SparseRows.gradient`).
        """
        ids, rows_grad, loss = self.sparse.gradient(model, flat, x, y, micro_batches, loss_fn, scope)
        self.push(ids, rows_grad, step, send)
        return loss

    def push(self, ids: torch.Tensor, rows: torch.Tensor, step: int, send: Callable[[Partition, Frame], None]) -> None:
        """One ``ps_rows`` push per row partition through `send`: the rows of `ids` (int64 (u,) table rows,
        increasing; `rows` float32 (u, dim)) in its range, partition-local (none touched: an empty one)."""
        ids_np = ids.numpy()
        cuts = np.searchsorted(ids_np, self._starts)  # ids are sorted: each partition's are a slice
        for i, part in enumerate(self.parts):
            lo, hi = int(cuts[i]), int(cuts[i + 1])
            send(part, rows_frame(ROWS_PUSH_KIND, {"step": step, "partition": part.index}, self.table,
                                  ids_np[lo:hi] - self._starts[i], rows[lo:hi]))

    def local_delta(self, model: nn.Module, flat: Any, x: torch.Tensor, y: torch.Tensor, local_steps: int,
                    lr: float, micro_batches: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    scope: Any = None) -> tuple[torch.Tensor, float]:
        """Local SGD's H = `local_steps` plain SGD steps at rate `lr` on the H pieces of (x, y), the table's
        rows by `sgd_rows` and the MLP's values in place, from the parameters in ``flat``; returns (the
        table rows the steps touched, int64 (u,) increasing; the mean loss). ``flat.params`` is left
        after the steps (the caller takes the delta): `wiiide.server.sparse.SparseRows.local_steps`. Raises
        IndexError: an id outside the table; ValueError: more steps than rows."""
        return self.sparse.local_steps(model, flat, x, y, local_steps, lr, micro_batches, loss_fn, scope)

    def read(self, msg: Message) -> tuple[int, np.ndarray, np.ndarray, float]:
        """A received ``ps_rows_update`` pull, checked and copied off the reader's buffer: (partition
        index, ids, rows, rate). Raises ProtocolError: not a row partition's, a bad frame (`RowTable.check`)
        or rate (`wiiide.lr_schedule.wire_lr`)."""
        index = msg.meta.get("partition")
        part = self._by_index.get(index) if type(index) is int else None  # noqa: E721
        if part is None:
            raise ProtocolError(f"{ROWS_PULL_KIND} for partition {index!r:.40}, which is not a row partition")
        ids, rows = self.table.check(msg, part)
        return index, ids, rows, float(wire_lr(msg.meta.get("lr"), ROWS_PULL_KIND))

    def apply(self, params: torch.Tensor, part: Partition, ids: np.ndarray, rows: np.ndarray, lr: float,
              copy_in: bool = False) -> None:
        """Apply a pull of row partition `part` (`read`) to the flat float32 `params`: the shard's `sgd_rows`,
        or with `copy_in` (a pull of on-arrival pacing, meta ``set``) the rows' values copied in."""
        values = params[part.start:part.stop].view(-1, self.table.dim)
        index = torch.from_numpy(ids.astype(np.int64))
        if copy_in:
            with torch.no_grad():
                values.index_copy_(0, index, torch.from_numpy(rows))
            return
        sgd_rows(values, index, torch.from_numpy(rows), lr)


def step_gradient(rows: WorkerRows | None, model: nn.Module, flat: Any, x: torch.Tensor, y: torch.Tensor,
                  micro_batches: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], step: int,
                  send: Callable[[Partition, Frame], None], scope: Any = None) -> float:
    """A sharded worker's gradient of one batch (x, y) at `step`, in `micro_batches` pieces: dense
    (`wiiide.server.pace.outer.gradient`) without sparse rows, else `WorkerRows.gradient` (the table's rows
    pushed through `send`). The backward hooks of `wiiide.server.ps.client` push the dense partitions. Returns
    the mean loss. `scope`: the forward's `wiiide.tensor_memory.ForwardScope` (autocast, the meter).

    Raises:
        RuntimeError, IndexError: the batch does not fit the model.
    """
    if rows is None:
        return gradient(model, flat, x, y, micro_batches, loss_fn, scope)
    return rows.gradient(model, flat, x, y, micro_batches, loss_fn, step, send, scope)
