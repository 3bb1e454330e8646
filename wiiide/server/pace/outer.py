"""Local SGD on a worker and the server's outer step over the workers' model deltas.

Local SGD (Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019; Lin et al.,
"Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020): each worker takes H plain SGD steps on its
own batches from the parameters it was sent, then pushes its model delta
``delta = params_sent - params_after_H_steps`` (flat float32, the "pseudo-gradient" of DiLoCo). The
server's outer step applies the mean delta:

- ``avg``: ``params -= mean(delta)``, i.e. the workers' models averaged (PyTorch's
  ``PeriodicModelAverager`` does the same with an all-reduce);
- ``nesterov``: SGD with Nesterov momentum on the pseudo-gradient, ``b = m b + delta``,
  ``params -= lr_out (delta + m b)`` (DiLoCo: Douillard et al., "DiLoCo: Distributed Low-Communication
  Training of Language Models", 2023, outer lr 0.7, momentum 0.9), via torch's functional
  ``torch.optim.sgd.sgd`` as `wiiide.training.model.MomentumSGD` does.

With H = 1 and ``avg`` this is synchronous SGD: ``mean(lr g_i) = lr mean(g_i)``.
`gradient` is also the worker's one-step path, with `micro_batches` gradient accumulation.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Literal

import torch
from torch import nn

from wiiide.training.model import FlatParams

OuterKind = Literal["avg", "nesterov"]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (model output, y) -> mean loss


def gradient(model: nn.Module, flat: FlatParams, x: torch.Tensor, y: torch.Tensor, micro_batches: int = 1,
             loss_fn: LossFn = nn.functional.cross_entropy, scope: Any = None) -> float:
    """The mean loss's gradient over the batch into ``flat.grads``, in `micro_batches` pieces.

    Args:
        x: float32 (b, features); y: int64 (b,); micro_batches: >= 1 pieces (``torch.tensor_split``:
            sizes differ by at most one; more pieces than rows gives one row each), each with its own
            forward and backward, accumulated in place into the flat gradient (the same sum as one pass,
            to float rounding).
        loss_fn: (model output, y) -> the mean loss over the piece's samples (default: cross-entropy;
            a language model's `wiiide.training.models.loss_mean` averages over every next-byte prediction);
            each piece's mean is weighted by its rows.
        scope: a `wiiide.tensor_memory.ForwardScope` each piece's forward and loss run under (CPU
            autocast, the activation meter); None: plain float32.

    Returns:
        The mean loss over the batch (float).

    Raises:
        RuntimeError, IndexError: the batch does not fit the model (wrong feature count, label out of range).
    """
    rows = int(x.shape[0])
    flat.grads.zero_()
    loss_sum = 0.0
    for xs, ys in zip(torch.tensor_split(x, min(micro_batches, max(rows, 1))),
                      torch.tensor_split(y, min(micro_batches, max(rows, 1)))):
        with scope(model) if scope is not None else contextlib.nullcontext():
            loss = loss_fn(model(xs), ys) * int(xs.shape[0])  # the piece's sum over samples
        (loss / rows).backward()  # AccumulateGrad adds in place into the flat views
        loss_sum += loss.item()
    return loss_sum / max(rows, 1)


def local_delta(model: nn.Module, flat: FlatParams, x: torch.Tensor, y: torch.Tensor, local_steps: int, lr: float,
                micro_batches: int = 1, step_sleep_s: float = 0.0,
                loss_fn: LossFn = nn.functional.cross_entropy, scope: Any = None) -> tuple[torch.Tensor, float]:
    """H = `local_steps` plain SGD steps (learning rate `lr`) on the H near-equal pieces of (x, y), from
    the parameters in `flat`; returns (delta, mean loss) with ``delta = params_before - params_after``
    (float32, flat.numel) and the parameters in `flat` left at ``params_after``.

    `step_sleep_s`: seconds slept after every local step (a test's straggler; 0 in real runs);
    `loss_fn`, `scope`: as `gradient`.

    Raises:
        ValueError: local_steps < 1 or more steps than rows; RuntimeError/IndexError as `gradient`.
    """
    rows = int(x.shape[0])
    if local_steps < 1 or local_steps > rows:
        raise ValueError(f"local_steps must be 1..{rows} (the rows of the batch), got {local_steps}")
    before = flat.params.clone()
    losses = []
    for xs, ys in zip(torch.tensor_split(x, local_steps), torch.tensor_split(y, local_steps)):
        losses.append(gradient(model, flat, xs, ys, micro_batches, loss_fn, scope))
        flat.params.sub_(flat.grads, alpha=lr)
        if step_sleep_s > 0:
            time.sleep(step_sleep_s)
    return before - flat.params, sum(losses) / len(losses)


class OuterOptimizer:
    """The server's outer step over a mean model delta (see the module docstring for the formulas).

    Args:
        flat: the server's parameters (`FlatParams`), updated in place.
        kind: ``avg`` (params -= delta) or ``nesterov`` (Nesterov momentum SGD on the delta).
        lr: the outer learning rate (``nesterov`` only; ``avg`` is lr 1); momentum: in [0, 1).

    Raises:
        ValueError: an unknown kind, lr <= 0, momentum outside [0, 1).
    """

    def __init__(self, flat: FlatParams, kind: OuterKind = "avg", lr: float = 0.7, momentum: float = 0.9) -> None:
        if kind not in ("avg", "nesterov"):
            raise ValueError(f"unknown outer optimizer {kind!r}; allowed: avg | nesterov")
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(f"outer lr must be > 0 and momentum in [0, 1), got {lr}, {momentum}")
        self.flat, self.kind, self.lr, self.momentum = flat, kind, float(lr), float(momentum)
        self._buffer: torch.Tensor | None = None

    @property
    def buffer(self) -> torch.Tensor | None:
        """The Nesterov momentum buffer (float32, flat.numel), None before the first step and for ``avg``."""
        return self._buffer

    def load_buffer(self, buffer: torch.Tensor) -> None:
        """Set the Nesterov momentum buffer (a checkpoint's). Raises ValueError: not flat.numel float32."""
        if buffer.shape != (self.flat.numel,) or buffer.dtype != torch.float32:
            raise ValueError(f"outer buffer of shape {tuple(buffer.shape)} {buffer.dtype}, expected "
                             f"({self.flat.numel},) float32")
        self._buffer = buffer.clone()

    def step(self, delta: torch.Tensor) -> None:
        """Apply one outer step for `delta` (float32, flat.numel): the mean of the workers' deltas, or one
        worker's share of it (an asynchronous server passes delta / live workers).

        Raises:
            ValueError: `delta` is not flat.numel float32 values.
        """
        if delta.shape != (self.flat.numel,) or delta.dtype != torch.float32:
            raise ValueError(f"delta of shape {tuple(delta.shape)} {delta.dtype}, expected ({self.flat.numel},) float32")
        if self.kind == "avg":
            self.flat.params.sub_(delta)
            return
        from torch.optim.sgd import sgd

        buffers = [self._buffer]
        with torch.no_grad():
            sgd([self.flat.params], [delta], buffers, has_sparse_grad=False, foreach=None, fused=None,
                weight_decay=0.0, momentum=self.momentum, lr=self.lr, dampening=0.0, nesterov=True, maximize=False)
        self._buffer = buffers[0]


class _Slice:
    """What `OuterOptimizer` reads of a `FlatParams`: a flat float32 tensor and its length."""

    def __init__(self, params: torch.Tensor) -> None:
        self.params, self.numel = params, int(params.numel())


class PartitionOuterStep:
    """The outer step over one flat float32 slice of the parameters, with `wiiide.training.model.MomentumSGD`'s
    interface for a step (``params``, ``lr``, `step`), so that a sharded server's shard
    (`wiiide.server.ps.shard`) applies `OuterOptimizer` to each partition it owns: `step` takes the slice's mean
    model delta from ``param.grad``. The outer step's formulas are elementwise, so the slices of a
    vector stepped one by one move as the whole vector stepped at once.

    Args:
        param: the slice (float32, 1-D, with ``.grad`` of its shape), updated in place.
        kind, lr, momentum: as `OuterOptimizer` (``lr``: the outer rate; the attribute ``lr``, which a
            shard sets to the schedule's inner rate, does not change it).

    Raises:
        ValueError: as `OuterOptimizer`.
    """

    def __init__(self, param: torch.Tensor, kind: OuterKind, lr: float, momentum: float) -> None:
        self.params = [param]
        self.lr = lr
        self.outer = OuterOptimizer(_Slice(param), kind, lr, momentum)  # type: ignore[arg-type]

    def step(self) -> None:
        """One outer step with the mean delta in ``param.grad`` (float32, the slice's shape)."""
        self.outer.step(self.params[0].grad)
