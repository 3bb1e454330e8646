"""Sparse embedding traffic of the parameter server: push touched rows, pull changed rows, and every
step's table work proportional to the rows a step touched (never a pass over the whole table).

With ``model: embedding`` and ``sparse_embedding: true`` on ``engine: wiiide``:

- push (`SparseRows.gradient`, `SparseRows.gradients_frame`): a worker looks up the distinct ids of its
  batch itself (``torch.unique``, sorted), as one small leaf tensor of ``u x dim`` rows, and runs the
  rest of the model on them (`wiiide.training.models.embedding.EmbeddingMLP.forward_looked_up`); the backward
  gives the table's gradient as those ``u`` rows (the duplicates of an id summed, as the embedding's
  backward sums them) and the MLP's gradient in the flat vector. The frame carries three raw tensors:
  ``grad_ids`` (int32 below 2^31 rows, else int64, strictly increasing), ``grad_rows`` (float32
  ``u x dim``) and ``grad_rest`` (the MLP's, flat). No dense ``rows x dim`` gradient exists anywhere:
  no zeroing of it, no scan for non-zero rows, no dense decode on the coordinator.
- the coordinator (`add_gradients`, `step`): the pushed rows are concatenated and summed per id
  (``torch.unique`` + ``index_add_``, in the workers' order, as the dense sum added them), divided by
  the contributors, and plain SGD runs on those rows only (`_sgd_rows`); the MLP takes the same SGD
  (``p.add_(g, alpha=-lr)``: torch's single-tensor SGD on CPU with momentum 0). Momentum would move
  every row every step (the buffer decays), so it is refused (`wiiide.config`).
- pull (`params_frame`, `apply_update`): after the first step the coordinator does not resend the
  table: it sends the step's averaged rows (``update_ids``, ``update_rows``) and the MLP's new
  parameters (``params_rest``); the worker runs the very `_sgd_rows` the coordinator ran, so both
  copies stay bitwise equal. A worker that missed a step (new, rejoined) gets the full parameters.

Ids from the network are checked (`wiiide.codecs.rows.check_row_ids`: in range, strictly increasing)
before anything is indexed, so a frame cannot write outside the table or twice into one row.

Why raw tensors and not the ``rows`` codec (`wiiide.codecs.rows`, still registered for any tensor whose
rows are mostly zero): a codec's decoder must return the dense tensor the header declares (``rows x
dim``: 64 MB for 1 M x 16), and a codec's encoder must scan a dense tensor for its non-zero rows; the
ids and rows as tensors of their own are the same bytes on the wire (4 + 4 x dim per row) without
either pass.

The table is the model's first parameter (`wiiide.training.models.embedding.EmbeddingMLP`), so it is the first
``rows x dim`` values of the flat vectors (`wiiide.training.model.FlatParams`).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterable

import numpy as np
import torch
from torch import nn

from wiiide.codecs.rows import check_row_ids
from wiiide.errors import ProtocolError
from wiiide.lr_schedule import wire_lr
from wiiide.wire.tensors import to_wire
from wiiide.wire.encode import encode_message
from wiiide.wire.messages import Frame, Message, WireTensor

UPDATE_KIND = "rows"  # the ``update`` meta of a params frame that carries a sparse update
SET_KIND = "rows_set"  # the ``update`` meta of a params frame that carries rows' values (`wiiide.server.pace.rows`)


def _sgd_rows(table: torch.Tensor, ids: torch.Tensor, rows_grad: torch.Tensor, lr: float) -> None:
    """Plain SGD on some rows of a (rows, dim) float32 table, in place: ``table[ids] -= lr x rows_grad``,
    computed as torch's SGD computes it (``row.add_(grad, alpha=-lr)``). `ids`: int64 (u,), distinct;
    `rows_grad`: float32 (u, dim). The one function both the coordinator and the worker run."""
    with torch.no_grad():
        rows = table.index_select(0, ids)
        rows.add_(rows_grad, alpha=-lr)
        table.index_copy_(0, ids, rows)


def sum_rows(pushed: list[tuple[np.ndarray, np.ndarray]], dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pushes' rows summed per id: (ids int64 (u,) increasing, sums float32 (u, dim)), each id's rows
    added in the pushes' order (``torch.unique`` + ``index_add_``, as a dense sum would add them).
    `pushed`: (ids, rows) per worker, ids int32/int64 (n,) distinct, rows float32 (n, dim)."""
    if not pushed:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dim, dtype=torch.float32)
    all_ids = torch.from_numpy(np.concatenate([i for i, _ in pushed]).astype(np.int64))
    all_rows = torch.from_numpy(np.concatenate([r for _, r in pushed]))
    ids, inverse = torch.unique(all_ids, sorted=True, return_inverse=True)
    return ids, torch.zeros(ids.numel(), dim, dtype=torch.float32).index_add_(0, inverse, all_rows)


def mean_rows(pushed: list[tuple[np.ndarray, np.ndarray]], dim: int, weights: list[float] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean of some pushes' rows (in the order given: rank order on every server): `sum_rows` then
    divided by the pushes, or with `weights` (one per push, e.g. its share of the samples) each push's
    rows times its float32 weight, summed. Returns (ids int64 (u,) increasing, float32 (u, dim))."""
    if weights is None:
        ids, summed = sum_rows(pushed, dim)
        return ids, summed.div_(len(pushed))
    return sum_rows([(ids, rows * np.float32(w)) for (ids, rows), w in zip(pushed, weights)], dim)


sgd_rows = _sgd_rows  # the public name (the sharded servers' row partitions run it too: wiiide.server.ps.sparse_rows)


class SparseRows:
    """The split of a flat parameter/gradient vector into the table (rows x dim) and the rest, and the
    sparse push, step and pull of the table. One per node (coordinator or worker).

    Args:
        model: an embedding model whose first parameter is the (rows, dim) float32 table.
        numel: elements of the flat vector (`FlatParams.numel`).

    Raises:
        ValueError: the model's first parameter is not 2-D.
    """

    def __init__(self, model: nn.Module, numel: int) -> None:
        table = next(model.parameters())
        if table.dim() != 2:
            raise ValueError(f"sparse rows need a (rows, dim) table as the first parameter, got {tuple(table.shape)}")
        self.rows, self.dim = int(table.shape[0]), int(table.shape[1])
        self.table_numel = self.rows * self.dim
        self.numel = int(numel)
        self.rest_numel = self.numel - self.table_numel
        self.id_dtype = np.int32 if self.rows < 2**31 else np.int64
        # coordinator: the parameter version each connection holds (weak: a dropped connection is forgotten)
        self._versions: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.version = 0
        self._update_frame: tuple[int, Frame] | None = None
        self._pushed: list[tuple[np.ndarray, np.ndarray]] = []  # this step's (ids, rows) per worker
        self._rest_sum = torch.zeros(self.rest_numel, dtype=torch.float32)
        self._update: tuple[torch.Tensor, torch.Tensor] | None = None  # the last step's (ids, averaged rows)

    def _split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return flat[:self.table_numel].view(self.rows, self.dim), flat[self.table_numel:]

    # --- worker -----------------------------------------------------------------------------------
    def _in_range(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` (int64 (u,), increasing) when all are table rows. Raises IndexError: one is not."""
        if ids.numel() and (int(ids[0]) < 0 or int(ids[-1]) >= self.rows):
            raise IndexError(f"embedding id out of range 0..{self.rows - 1} (got {int(ids[0])}..{int(ids[-1])})")
        return ids

    def gradient(self, model: nn.Module, flat: Any, x: torch.Tensor, y: torch.Tensor, micro_batches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], scope: Any = None
                 ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The mean loss's gradient over a batch, the table's as rows: (ids, rows, mean loss).

        Args:
            model: the `EmbeddingMLP` whose parameters `flat` (`wiiide.training.model.FlatParams`) holds.
            x: int64 (b, fields) ids; y: int64 (b,) labels.
            micro_batches: >= 1 pieces, each its own forward and backward (as `wiiide.server.pace.outer.gradient`).
            loss_fn: (logits, y) -> the mean loss of the piece.
            scope: as `wiiide.server.pace.outer.gradient`'s (CPU autocast, the activation meter).

        Returns:
            ids: int64 (u,) the batch's distinct ids, increasing; rows: float32 (u, dim) their gradient;
            the mean loss (float). The MLP's gradient is left in ``flat.grads`` (after the table); the
            table's part of ``flat.grads`` is not touched.

        Raises:
            IndexError: an id outside 0..rows-1 (the caller turns it into a `ProtocolError`).
        """
        table, _ = self._split(flat.params)
        ids, inverse = torch.unique(x, sorted=True, return_inverse=True)
        self._in_range(ids)
        looked_up = table.detach().index_select(0, ids).requires_grad_()
        flat.grads[self.table_numel:].zero_()
        n = int(x.shape[0])
        pieces = min(micro_batches, max(n, 1))
        loss_sum = 0.0
        for inv, ys in zip(torch.tensor_split(inverse, pieces), torch.tensor_split(y, pieces)):
            with scope(model) if scope is not None else contextlib.nullcontext():
                loss = loss_fn(model.forward_looked_up(looked_up[inv]), ys) * int(ys.shape[0])
            (loss / n).backward()  # the MLP's gradients accumulate into the flat views, the rows into looked_up.grad
            loss_sum += loss.item()
        rows_grad = looked_up.grad if looked_up.grad is not None else torch.zeros_like(looked_up)
        return ids, rows_grad, loss_sum / max(n, 1)

    def gradients_frame(self, meta: dict[str, Any], ids: torch.Tensor, rows_grad: torch.Tensor,
                        grads: torch.Tensor) -> Frame:
        """The ``gradients`` frame: ``grad_ids`` (int32/int64 (u,)), ``grad_rows`` (float32 (u, dim)) from
        `gradient`, and ``grad_rest`` (the MLP's part of the flat float32 `grads`), raw."""
        return self.push_frame(meta, "grad", ids, rows_grad, self._split(grads)[1])

    def push_frame(self, meta: dict[str, Any], prefix: str, ids: torch.Tensor, rows: torch.Tensor,
                   rest: torch.Tensor) -> Frame:
        """A raw ``gradients`` frame of rows: ``{prefix}_ids`` (int32/int64 (u,)), ``{prefix}_rows`` (float32
        (u, dim)) and ``{prefix}_rest`` (float32, the values after the table); `prefix` ``grad`` for a
        gradient, ``delta`` for local SGD's model delta (`local_delta`)."""
        return encode_message("gradients", meta, [WireTensor(f"{prefix}_ids", ids.numpy().astype(self.id_dtype)),
                                                  to_wire(f"{prefix}_rows", rows), to_wire(f"{prefix}_rest", rest)])

    def local_steps(self, model: nn.Module, flat: Any, x: torch.Tensor, y: torch.Tensor, local_steps: int, lr: float,
                    micro_batches: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    scope: Any = None) -> tuple[torch.Tensor, float]:
        """Local SGD's H = `local_steps` plain SGD steps at rate `lr` on the H near-equal pieces of (x, y):
        the table's rows by `sgd_rows`, the rest in place, from the parameters in ``flat``, which are left
        after the steps. Returns (the table rows the steps touched: int64 (u,) increasing; the mean loss).

        Raises:
            IndexError: an id outside the table; ValueError: more steps than rows.
        """
        if not 1 <= local_steps <= int(x.shape[0]):
            raise ValueError(f"local_steps must be 1..{int(x.shape[0])} (the rows of the batch), got {local_steps}")
        table, rest = self._split(flat.params)
        touched, losses = [], []
        for xs, ys in zip(torch.tensor_split(x, local_steps), torch.tensor_split(y, local_steps)):
            ids, rows_grad, loss = self.gradient(model, flat, xs, ys, micro_batches, loss_fn, scope)
            with torch.no_grad():
                rest.sub_(flat.grads[self.table_numel:], alpha=lr)
            _sgd_rows(table, ids, rows_grad, lr)
            touched.append(ids)
            losses.append(loss)
        return torch.unique(torch.cat(touched), sorted=True), sum(losses) / len(losses)

    def local_delta(self, model: nn.Module, flat: Any, x: torch.Tensor, y: torch.Tensor, local_steps: int, lr: float,
                    micro_batches: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    scope: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        """`local_steps`, then the model delta ``before - after`` of the rows they touched and of the rest,
        and ``flat.params`` put back at ``before`` (the copy the server sent, which its row pulls update).
        Table work is proportional to the touched rows: only they are saved and restored.

        Returns:
            ids: int64 (u,) increasing; delta_rows: float32 (u, dim); delta_rest: float32 (numel - rows x
            dim,); the mean loss.

        Raises:
            IndexError: an id outside the table; ValueError: more steps than rows.
        """
        ids = self._in_range(torch.unique(x, sorted=True))
        table, rest = self._split(flat.params)
        rows_before, rest_before = table.index_select(0, ids), rest.clone()
        _, loss = self.local_steps(model, flat, x, y, local_steps, lr, micro_batches, loss_fn, scope)
        with torch.no_grad():
            delta_rows = rows_before - table.index_select(0, ids)
            delta_rest = rest_before - rest
            table.index_copy_(0, ids, rows_before)
            rest.copy_(rest_before)
        return ids, delta_rows, delta_rest, loss

    def set_rows(self, msg: Message, params: torch.Tensor) -> None:
        """Apply a ``params`` frame of row values (meta ``update`` `SET_KIND`, `wiiide.server.pace.rows`) to
        the flat float32 `params`: ``set_rows`` copied into the rows ``set_ids``, the rest replaced by
        ``params_rest``.

        Raises:
            ProtocolError: missing or misshaped tensors, ids out of range or not strictly increasing.
        """
        ids, rows, rest = self.checked(msg, "set", "params_rest")
        table, own_rest = self._split(params)
        with torch.no_grad():
            table.index_copy_(0, torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(rows.copy()))
        own_rest.numpy()[:] = rest

    def checked(self, msg: Message, prefix: str, rest_name: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The checked tensors of a frame of rows: ``{prefix}_ids`` (int32/int64 (u,), strictly increasing,
        in range), ``{prefix}_rows`` (float32 (u, dim)) and `rest_name` (default ``{prefix}_rest``: float32,
        the values after the table), as read-only views of the frame's buffer.

        Raises:
            ProtocolError: a tensor missing, of another shape or dtype, or ids out of range or not increasing.
        """
        ids, rows = self._rows(msg, f"{prefix}_ids", f"{prefix}_rows")
        return ids, rows, self._tensor(msg, rest_name or f"{prefix}_rest", (self.rest_numel,))

    def apply_update(self, msg: Message, params: torch.Tensor) -> None:
        """Apply a sparse ``params`` frame to the flat parameters: `_sgd_rows` with ``update_ids``,
        ``update_rows`` and the frame's ``lr``; the rest is replaced by ``params_rest``.

        Raises:
            ProtocolError: missing or misshaped tensors, ids out of range or not strictly increasing, or
                a learning rate that is not a number 0..100 (`wiiide.lr_schedule.wire_lr`).
        """
        lr = wire_lr(msg.meta.get("lr"), "sparse params")
        ids, rows = self._rows(msg, "update_ids", "update_rows")
        rest = self._tensor(msg, "params_rest", (self.rest_numel,))
        table, own_rest = self._split(params)
        _sgd_rows(table, torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(rows.copy()), float(lr))
        own_rest.numpy()[:] = rest  # a copy (the frame's arrays are read-only views of its buffer)

    # --- coordinator --------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Forget the pushes of the last step (call before the first `add_gradients` of a step)."""
        self._pushed.clear()
        self._rest_sum.zero_()

    def add_gradients(self, msg: Message) -> None:
        """Take a worker's push (``grad_ids``, ``grad_rows``, ``grad_rest``) into this step's sums; every
        tensor is checked before anything is added, so a bad push harms nothing.

        Raises:
            ProtocolError: missing tensors, tensors of another shape or dtype than the model's, ids out
                of range or not strictly increasing.
        """
        ids, rows, rest = self.checked(msg, "grad")
        self._pushed.append((ids, rows))
        np.add(self._rest_sum.numpy(), rest, out=self._rest_sum.numpy())

    def step(self, params: torch.Tensor, grads: torch.Tensor, contributors: int, lr: float) -> None:
        """One plain SGD step of the flat float32 `params` on this step's pushes, averaged over
        `contributors`: the table's touched rows (`_sgd_rows`) and the rest; the rest's averaged gradient
        is left in the flat `grads`. Keeps the averaged rows for the next pulls and advances the version.

        Raises:
            ValueError: contributors < 1.
        """
        if contributors < 1:
            raise ValueError(f"a step needs at least one contributor, got {contributors}")
        table, rest = self._split(params)
        _, rest_grad = self._split(grads)
        ids, summed = sum_rows(self._pushed, self.dim)
        summed.div_(contributors)
        _sgd_rows(table, ids, summed, lr)
        rest_grad.copy_(self._rest_sum).div_(contributors)
        with torch.no_grad():
            rest.add_(rest_grad, alpha=-lr)
        self._update = (ids, summed)
        self.stepped()

    def needs_full(self, conns: Iterable[Any]) -> bool:
        """Whether any of these connections needs the full parameters (it does not hold the previous version)."""
        return any(self._versions.get(conn) != self.version - 1 for conn in conns)

    def params_frame(self, conn: Any, step: int, params: torch.Tensor, lr: float, full_frame: Frame | None) -> Frame:
        """The ``params`` frame for the worker on `conn`: the sparse update (the last step's averaged
        rows and the rest of `params`) if it holds the previous version, else `full_frame` (not None
        whenever `needs_full` said so). Records that `conn` now holds the current version.

        Raises:
            RuntimeError: a full frame is needed but `full_frame` is None.
        """
        held = self._versions.get(conn)
        self._versions[conn] = self.version
        if held is None or held != self.version - 1 or self._update is None:
            if full_frame is None:
                raise RuntimeError("a worker needs the full parameters but no full frame was made (call needs_full)")
            return full_frame
        if self._update_frame is None or self._update_frame[0] != self.version:
            ids, rows = self._update
            _, rest = self._split(params)
            frame = encode_message("params", {"step": step, "update": UPDATE_KIND, "lr": lr},
                                   [WireTensor("update_ids", ids.numpy().astype(self.id_dtype)),
                                    to_wire("update_rows", rows), to_wire("params_rest", rest)])
            self._update_frame = (self.version, frame)
        return self._update_frame[1]

    def stepped(self) -> None:
        """The parameters are one version further (`step` calls it)."""
        self.version += 1

    def _rows(self, msg: Message, ids_name: str, rows_name: str) -> tuple[np.ndarray, np.ndarray]:
        """The checked (ids, rows) pair of a frame: ids int32/int64 (u,) strictly increasing in range,
        rows float32 (u, dim)."""
        try:
            ids, rows = msg.tensor(ids_name), msg.tensor(rows_name)
        except ProtocolError:
            raise ProtocolError(f"{msg.kind}: no tensors {ids_name!r} and {rows_name!r}") from None
        if ids.ndim != 1 or ids.dtype != self.id_dtype:
            raise ProtocolError(f"{msg.kind}: {ids_name} of shape {ids.shape} {ids.dtype}, expected (u,) "
                                f"{np.dtype(self.id_dtype)}")
        if rows.shape != (ids.shape[0], self.dim) or rows.dtype != np.float32:
            raise ProtocolError(f"{msg.kind}: {rows_name} of shape {rows.shape} {rows.dtype}, expected "
                                f"({ids.shape[0]}, {self.dim}) float32")
        check_row_ids(ids, self.rows, f"{msg.kind}: {ids_name}")
        return ids, rows

    @staticmethod
    def _tensor(msg: Message, name: str, shape: tuple[int, ...]) -> np.ndarray:
        try:
            array = msg.tensor(name)
        except ProtocolError:
            raise ProtocolError(f"{msg.kind}: no tensor {name!r}") from None
        if array.shape != shape or array.dtype != np.float32:
            raise ProtocolError(f"{msg.kind}: {name} of shape {array.shape} {array.dtype}, expected {shape} float32")
        return array


def expected_bytes_per_step(rows: int, dim: int, rest_numel: int, num_workers: int, batch_size: int, fields: int,
                            zipf_exponent: float, local_steps: int = 1, rounds: bool = True) -> dict[str, float]:
    """Tensor bytes one update of the sparse parameter server moves, expected from the model and the data.

    A push covers ``local_steps x batch_size x fields`` Zipf ids (one batch; H with local SGD); it carries
    their distinct rows (id + dim float32 each, `wiiide.training.models.embedding.expected_distinct_rows`)
    and the rest dense. The pull holds the rows of ``num_workers`` pushes and the rest dense: in `rounds`
    the round's, at a pace of their own (a staleness bound, async) the rows changed since the worker's
    copy, which in a steady state is one push of every worker (`wiiide.server.pace.rows`; an SSP cache that
    skips pulls moves less). int32 ids. An update is a round (every worker's push and pull) in `rounds`,
    else one push and its pull.

    Returns:
        ``push_bytes`` and ``pull_bytes`` per worker, ``total_bytes`` (an update's pushes and pulls) and
        ``dense_total_bytes`` (what the dense parameter server moves for as many pushes and pulls).
    """
    from wiiide.training.models.embedding import expected_distinct_rows, zipf_probabilities

    p = zipf_probabilities(rows, zipf_exponent)
    row_bytes, draws = 4 + 4 * dim, local_steps * batch_size * fields
    push = expected_distinct_rows(p, draws) * row_bytes + 4 * rest_numel
    pull = expected_distinct_rows(p, num_workers * draws) * row_bytes + 4 * rest_numel
    pushers = num_workers if rounds else 1
    return {"push_bytes": push, "pull_bytes": pull, "total_bytes": pushers * (push + pull),
            "dense_total_bytes": 2.0 * pushers * 4 * (rows * dim + rest_numel)}
