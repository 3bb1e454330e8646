"""Sparse embedding traffic of the parameter server: push touched rows, pull changed rows.

With ``model: embedding`` and ``sparse_embedding: true`` on ``engine: wiiide``:

- push: a worker sends its gradient as two tensors, ``grad_rows`` (the table's gradient, rows x dim)
  and ``grad_rest`` (the MLP's, flat), with the ``rows`` codec (`wiiide.codecs.rows`): only the rows
  its batch looked up travel, as ids plus values.
- pull: plain SGD (momentum 0, which `wiiide.config` enforces) changes only the rows that had a
  gradient. So after the first step the coordinator does not resend the table: it sends the step's
  averaged table gradient (``update_rows``, rows codec: only the touched rows) and the MLP's new
  parameters (``params_rest``); the worker applies ``table.add_(update_rows, alpha=-lr)``, the very
  operation the coordinator's SGD ran (torch's single-tensor SGD on CPU: ``param.add_(grad,
  alpha=-lr)``), so both copies stay bitwise equal. A worker that missed a step (new, rejoined) gets
  the full parameters. Momentum would move every row every step (the buffer decays), so it is refused.

The table is the model's first parameter (`wiiide.models.embedding.EmbeddingMLP`), so it is the first
``rows x dim`` values of the flat vectors (`wiiide.model.FlatParams`).
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import numpy as np
import torch
from torch import nn

from wiiide.codecs.rows import RowsCodec
from wiiide.errors import ProtocolError
from wiiide.protocol import Frame, Message, encode_message
from wiiide.tensors import to_wire

UPDATE_KIND = "rows"  # the ``update`` meta of a params frame that carries a sparse update


class SparseRows:
    """The split of a flat parameter/gradient vector into the table (rows x dim) and the rest, and the
    frames that carry them. One per node (coordinator or worker).

    Args:
        model: an embedding model whose first parameter is the (rows, dim) float32 table.
        numel: elements of the flat vector (`FlatParams.numel`).
    """

    def __init__(self, model: nn.Module, numel: int) -> None:
        table = next(model.parameters())
        if table.dim() != 2:
            raise ValueError(f"sparse rows need a (rows, dim) table as the first parameter, got {tuple(table.shape)}")
        self.rows, self.dim = int(table.shape[0]), int(table.shape[1])
        self.table_numel = self.rows * self.dim
        self.numel = int(numel)
        self.codec = RowsCodec()
        # coordinator: the parameter version each connection holds (weak: a dropped connection is forgotten)
        self._versions: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.version = 0
        self._update_frame: tuple[int, Frame] | None = None

    def _split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return flat[:self.table_numel].view(self.rows, self.dim), flat[self.table_numel:]

    # --- worker -----------------------------------------------------------------------------------
    def gradients_frame(self, meta: dict[str, Any], grads: torch.Tensor) -> Frame:
        """The ``gradients`` frame of a flat float32 gradient: ``grad_rows`` + ``grad_rest``, rows codec."""
        rows, rest = self._split(grads)
        return encode_message("gradients", meta, [to_wire("grad_rows", rows), to_wire("grad_rest", rest)], self.codec)

    def apply_update(self, msg: Message, params: torch.Tensor) -> None:
        """Apply a sparse ``params`` frame to the flat parameters: the table takes ``-lr x update_rows``,
        the rest is replaced by ``params_rest``.

        Raises:
            ProtocolError: missing or misshaped tensors, or a learning rate that is not a finite positive number.
        """
        lr = msg.meta.get("lr")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < float(lr) < float("inf"):
            raise ProtocolError(f"sparse params: 'lr' must be a positive number, got {lr!r:.40}")
        update = self._tensor(msg, "update_rows", (self.rows, self.dim))
        rest = self._tensor(msg, "params_rest", (self.numel - self.table_numel,))
        table, own_rest = self._split(params)
        with torch.no_grad():
            table.add_(torch.from_numpy(update), alpha=-float(lr))
            own_rest.copy_(torch.from_numpy(rest))

    # --- coordinator --------------------------------------------------------------------------------
    def add_gradients(self, msg: Message, grad_sum: torch.Tensor) -> None:
        """Add a worker's ``grad_rows`` + ``grad_rest`` into the flat float32 `grad_sum`.

        Raises:
            ProtocolError: missing tensors, or tensors of another shape or dtype than the model's.
        """
        rows = self._tensor(msg, "grad_rows", (self.rows, self.dim))
        rest = self._tensor(msg, "grad_rest", (self.numel - self.table_numel,))
        table_sum, rest_sum = self._split(grad_sum)
        table_sum += torch.from_numpy(rows)
        rest_sum += torch.from_numpy(rest)

    def needs_full(self, conns: Iterable[Any]) -> bool:
        """Whether any of these connections needs the full parameters (it does not hold the previous version)."""
        return any(self._versions.get(conn) != self.version - 1 for conn in conns)

    def params_frame(self, conn: Any, step: int, params: torch.Tensor, grads: torch.Tensor, lr: float,
                     full_frame: Frame | None) -> Frame:
        """The ``params`` frame for the worker on `conn`: the sparse update (the last step's averaged table
        gradient `grads` and the rest of `params`) if it holds the previous version, else `full_frame`
        (not None whenever `needs_full` said so). Records that `conn` now holds the current version."""
        held = self._versions.get(conn)
        self._versions[conn] = self.version
        if held is None or held != self.version - 1:
            if full_frame is None:
                raise RuntimeError("a worker needs the full parameters but no full frame was made (call needs_full)")
            return full_frame
        if self._update_frame is None or self._update_frame[0] != self.version:
            table_grad, _ = self._split(grads)
            _, rest = self._split(params)
            frame = encode_message("params", {"step": step, "update": UPDATE_KIND, "lr": lr},
                                   [to_wire("update_rows", table_grad), to_wire("params_rest", rest)], self.codec)
            self._update_frame = (self.version, frame)
        return self._update_frame[1]

    def stepped(self) -> None:
        """The optimizer stepped: the parameters are one version further."""
        self.version += 1

    @staticmethod
    def _tensor(msg: Message, name: str, shape: tuple[int, ...]) -> np.ndarray:
        try:
            array = msg.tensor(name)
        except (KeyError, ProtocolError):
            raise ProtocolError(f"{msg.kind}: no tensor {name!r}") from None
        if array.shape != shape or array.dtype != np.float32:
            raise ProtocolError(f"{msg.kind}: {name} of shape {array.shape} {array.dtype}, expected {shape} float32")
        return array


def expected_bytes_per_step(rows: int, dim: int, rest_numel: int, num_workers: int, batch_size: int, fields: int,
                            zipf_exponent: float) -> dict[str, float]:
    """Tensor bytes one step of the sparse parameter server moves, expected from the model and the data.

    A worker's batch looks up ``batch_size x fields`` Zipf ids; it pushes its distinct rows (id + dim
    float32 each, `wiiide.models.embedding.expected_distinct_rows`) and the rest dense; the update it
    pulls holds the distinct rows of all ``num_workers`` batches and the rest dense. int32 ids.

    Returns:
        ``push_bytes`` and ``pull_bytes`` per worker, ``total_bytes`` (both, all workers) and
        ``dense_total_bytes`` (what the dense parameter server moves: 2 x workers x parameters x 4).
    """
    from wiiide.models.embedding import expected_distinct_rows, zipf_probabilities

    p = zipf_probabilities(rows, zipf_exponent)
    row_bytes = 4 + 4 * dim
    push = expected_distinct_rows(p, batch_size * fields) * row_bytes + 4 * rest_numel
    pull = expected_distinct_rows(p, num_workers * batch_size * fields) * row_bytes + 4 * rest_numel
    return {"push_bytes": push, "pull_bytes": pull, "total_bytes": num_workers * (push + pull),
            "dense_total_bytes": 2.0 * num_workers * 4 * (rows * dim + rest_numel)}
