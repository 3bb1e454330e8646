"""Sparse embedding rows under the central pace server (``sparse_embedding`` on ``ps_shards: 1`` with a
staleness bound, async, local SGD or adaptive batches; `wiiide.server.pace.server`).

The table is the first ``rows x dim`` values of the flat vector (`wiiide.server.sparse`). Per task:

- push: with H = 1 the gradient of the batch's distinct rows (``grad_ids``, ``grad_rows``, ``grad_rest``,
  as to the synchronous server); with H > 1 local SGD's model delta of the rows the H steps touched
  (``delta_ids``, ``delta_rows``, ``delta_rest``: `wiiide.server.sparse.SparseRows.local_delta`, the steps'
  `sgd_rows` as on the sharded servers), after which the worker's copy is back at what it was sent.
- apply (`PaceRows.apply`): `wiiide.server.sparse.sgd_rows` on the pushed rows and the same SGD on the
  rest, at the schedule's rate for a gradient and at rate 1 for a delta (the outer ``avg``: ``params -=
  delta``), times the staleness scale on arrival. In rounds (``staleness_bound: 0``) the round's pushes
  are summed per id in rank order and divided by their number, or weighted by their samples with
  adaptive batches (`PaceRows.mean`), as a shard averages a row partition
  (`wiiide.server.ps.sparse_rows.apply_rows`), so both placements compute the same sums.
- pull (`PaceRows.frame_for`): the server keeps, per worker, a mask of the rows changed since the copy
  it last sent that worker (as a shard keeps one per partition). A task's parameters are the values of
  those rows and the rest (``set_ids``, ``set_rows``, ``params_rest``; meta ``update``
  `wiiide.server.sparse.SET_KIND`), which the worker copies in (`SparseRows.set_rows`): its copy is then
  the server's version to the bit, and no row that did not change crosses the link. A worker without a
  copy (new, rejoined, after a restore) gets the full parameters. A task the SSP cache sends without
  parameters leaves the mask as it is, so the next pull carries every row changed since.

Row frames skip the compression policy, as on the synchronous and the sharded servers (the rows are
already the bytes that changed, and the worker must hold exactly what the server holds). Momentum and
DiLoCo's Nesterov outer step would move every row at every update, so the config refuses them with
sparse rows (`wiiide.config_rules`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from wiiide.server.sparse import SET_KIND, SparseRows, mean_rows, sgd_rows
from wiiide.wire.encode import encode_message
from wiiide.wire.messages import Frame, Message, WireTensor
from wiiide.wire.tensors import to_wire


@dataclass
class RowsUpdate:
    """One push (or a round's mean) of sparse rows: ``ids`` int64 (u,) increasing and distinct, ``rows``
    float32 (u, dim) their gradient or delta, ``rest`` float32 (the values after the table,)."""

    ids: torch.Tensor
    rows: torch.Tensor
    rest: torch.Tensor

    def mul_(self, scale: float) -> "RowsUpdate":
        """Scale rows and rest in place (the staleness scale, local SGD's share); returns self."""
        self.rows.mul_(scale)
        self.rest.mul_(scale)
        return self


class PaceRows:
    """The pace server's side of the sparse rows: pushes checked, applied and averaged, pulls as rows.

    Args:
        sparse: the coordinator's `SparseRows` (the table's geometry and the frames' checks).
        local_sgd: pushes are model deltas (``local_steps`` > 1, applied at rate 1), else gradients.
        weighted: rounds weight the pushes by their samples (adaptive batches), else the plain mean.
    """

    def __init__(self, sparse: SparseRows, local_sgd: bool, weighted: bool) -> None:
        self.sparse, self.local_sgd, self.weighted = sparse, local_sgd, weighted
        self.prefix = "delta" if local_sgd else "grad"
        self._changed: dict[int, np.ndarray] = {}  # rank -> bool (rows,): rows changed since its copy was sent
        self.pulls_rows = self.pulls_full = 0  # tasks whose parameters went as changed rows / in full
        self.rows_sent = 0  # rows carried by the row pulls, summed

    def check(self, msg: Message) -> RowsUpdate:
        """The push of a ``gradients`` frame, checked and copied off the reader's buffer.

        Raises:
            ProtocolError: other tensors than ``{grad|delta}_ids``, ``_rows``, ``_rest``, or ones of another
                shape or dtype, or ids out of range or not strictly increasing (`SparseRows.checked`).
        """
        ids, rows, rest = self.sparse.checked(msg, self.prefix)
        return RowsUpdate(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(rows.copy()),
                          torch.from_numpy(rest.copy()))

    def mean(self, pushes: list[tuple[int, RowsUpdate, int]]) -> RowsUpdate:
        """A round's mean of `pushes` (rank, update, samples): the rows summed per id in rank order
        (`wiiide.server.sparse.mean_rows`) and the rest summed in rank order, then divided by the pushes,
        or each weighted by its share of the samples (``weighted``)."""
        ordered = sorted(pushes, key=lambda push: push[0])
        total = sum(samples for _, _, samples in ordered)
        weights = [samples / total for _, _, samples in ordered] if self.weighted else None
        ids, rows = mean_rows([(u.ids.numpy(), u.rows.numpy()) for _, u, _ in ordered], self.sparse.dim, weights)
        rest = torch.zeros(self.sparse.rest_numel, dtype=torch.float32)
        for i, (_, update, _) in enumerate(ordered):
            rest.add_(update.rest, alpha=weights[i] if weights else 1.0)
        if weights is None:
            rest.div_(len(ordered))
        return RowsUpdate(ids, rows, rest)

    def apply(self, params: torch.Tensor, update: RowsUpdate, lr: float) -> None:
        """One server update of the flat float32 `params` by `update` (scaled already): SGD at `lr` on the
        rows and the rest for gradients, at rate 1 for local SGD's deltas; every worker's copy is marked
        stale at the rows it moved."""
        rate = 1.0 if self.local_sgd else lr
        table = params[:self.sparse.table_numel].view(self.sparse.rows, self.sparse.dim)
        sgd_rows(table, update.ids, update.rows, rate)
        with torch.no_grad():
            params[self.sparse.table_numel:].add_(update.rest, alpha=-rate)
        ids = update.ids.numpy()
        for mask in self._changed.values():
            mask[ids] = True

    def frame_for(self, rank: int, step: int, params: torch.Tensor, full_frame: Callable[[], Frame]) -> Frame:
        """The parameters of `rank`'s next task (version `step`): the rows changed since its copy and the
        rest (a ``params`` frame, meta ``update`` `SET_KIND`), or `full_frame()` when it holds no copy.
        Records that `rank` now holds the current parameters."""
        mask = self._changed.get(rank)
        if mask is None:
            self._changed[rank] = np.zeros(self.sparse.rows, dtype=bool)
            self.pulls_full += 1
            return full_frame()
        changed = np.flatnonzero(mask)
        mask[changed] = False
        table = params[:self.sparse.table_numel].view(self.sparse.rows, self.sparse.dim)
        self.pulls_rows += 1
        self.rows_sent += len(changed)
        return encode_message("params", {"step": step, "update": SET_KIND}, [
            WireTensor("set_ids", changed.astype(self.sparse.id_dtype)),
            to_wire("set_rows", table.index_select(0, torch.from_numpy(changed))),
            to_wire("params_rest", params[self.sparse.table_numel:])])

    def forget(self, rank: int) -> None:
        """`rank` holds no copy any more (dropped, reconnected): its next task gets the full parameters."""
        self._changed.pop(rank, None)

    def record(self) -> dict[str, Any]:
        """The pace record's ``sparse_rows`` entry: tasks whose parameters went as rows and in full, and
        the rows the row pulls carried per pull on average."""
        return {"pulls_rows": self.pulls_rows, "pulls_full": self.pulls_full,
                "rows_per_pull": self.rows_sent / self.pulls_rows if self.pulls_rows else None}
