"""Tensor memory per rank: the bytes a training step's tensors take, from the tensors themselves.

A process's resident set size (`wiiide.metrics`) counts everything: the interpreter, torch's
libraries, the data set, the allocator's free lists. The figures here count the tensors a rank holds
for training, so that "FSDP holds less" shows in the tensors' bytes and not only in RSS:

- ``parameter_bytes``: the parameters between steps (FSDP: this rank's shards, the local part of each
  ``DTensor``); ``gradient_bytes``: their ``.grad``; ``optimizer_state_bytes``: every tensor in the
  optimizer's state (SGD: the momentum buffers). Each is the sum of ``nbytes()`` over the distinct
  storages the tensors view (a wiiide worker's parameters are views of one flat vector: counted once).
- ``activation_bytes``: what one forward and loss leave alive for the backward: every storage an aten
  operator created during the forward and the loss (seen by a `TorchDispatchMode`, held by a weak
  reference: `torch.multiprocessing.reductions.StorageWeakRef`) that is still alive when the loss is
  computed, minus the parameters' own storages. That is the tensors autograd saved (with activation
  checkpointing: the checkpointed blocks' inputs, which torch.utils.checkpoint keeps to recompute
  from, not their insides), the logits and the loss; with autocast also the low-precision copies of
  the weights it cached. Measured once, on the first forward of the run (the first micro-batch of
  step 0), since every step's graph is the same.

Units: bytes. CPU only (no allocator statistics are needed: storages report their own size).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

METHOD = ("parameters, gradients, optimizer state: nbytes of the distinct storages of the tensors (FSDP: "
          "local shards); activations: storages created by the first forward and loss and still alive when "
          "the loss is computed, parameters' storages excluded (TorchDispatchMode + StorageWeakRef)")

_HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (FSDP's shards), else `tensor`."""
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor


def _storage_key(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, nbytes) of a tensor's storage; None for one without a storage (sparse, meta, a
    wrapper subclass)."""
    try:
        storage = _local(tensor).untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return storage.data_ptr(), storage.nbytes()


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages `tensors` view (None entries skipped): a storage viewed by several
    tensors counts once, in full."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        key = _storage_key(t)
        if key is not None and key[1] > 0:
            seen[key[0]] = key[1]
    return sum(seen.values())


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of `module`'s parameters (`storage_bytes`; FSDP: this rank's shards)."""
    return storage_bytes(module.parameters())


def gradient_bytes(module: nn.Module) -> int:
    """Bytes of `module`'s parameters' ``.grad`` (0 before the first backward)."""
    return storage_bytes(p.grad for p in module.parameters())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of every tensor in `optimizer`'s ``state`` (SGD with momentum: one buffer per parameter; 0
    before its first step or for None). A wrapper with an ``optim`` (PostLocalSGDOptimizer) is unwrapped."""
    optimizer = getattr(optimizer, "optim", optimizer)
    if optimizer is None:
        return 0
    return storage_bytes(v for state in optimizer.state.values() for v in state.values()
                         if isinstance(v, torch.Tensor))


class ActivationMeter(TorchDispatchMode):
    """Records the storage of every tensor an operator outputs while active; `live_bytes` sums those
    still alive. See the module docstring.

    Its ``__torch_dispatch__`` is not wrapped in ``torch._disable_dynamo`` (`_should_skip_dynamo`), which
    `TorchDispatchMode` does to every subclass by default: that wrapper imports ``torch._dynamo`` (about
    800 modules with sympy and mpmath) at the first operator, 1.6-2.0 s of CPU inside the first forward
    of the run (torch 2.13, this project's machine, `timeit` of a fresh interpreter), 8-19 s of wall time
    with five nodes importing at once on two cores, and a 0.25-CPU container needs 4x its CPU seconds.
    On the sharded servers, where a step starts the clock as soon as the plan is in, that stalled whole
    20 s runs in their first step. The meter is never compiled, so there is nothing for Dynamo to skip.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: leave ``__torch_dispatch__`` unwrapped (see the class docstring)."""
        return False

    def __init__(self) -> None:
        super().__init__()
        self._refs: dict[int, StorageWeakRef] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                try:
                    storage = _local(t).untyped_storage()
                except (RuntimeError, NotImplementedError, TypeError):
                    continue
                ptr = storage.data_ptr()
                known = self._refs.get(ptr)
                # an address is reused once its storage is freed: the new storage replaces the dead one
                if ptr and (known is None or known.expired()):
                    self._refs[ptr] = StorageWeakRef(storage)
        return out

    def live_bytes(self, exclude: Iterable[torch.Tensor] = ()) -> int:
        """Bytes of the recorded storages still alive, less those of the tensors in `exclude`."""
        skip = {key[0] for key in map(_storage_key, exclude) if key is not None}
        total = 0
        for ptr, ref in self._refs.items():
            if ptr in skip or ref.expired():
                continue
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if storage is not None:
                total += storage.nbytes()
        return total


def autocast_dtype(mixed_precision: str) -> torch.dtype | None:
    """The CPU autocast dtype of a ``mixed_precision`` value (none: None).

    Raises:
        ValueError: an unknown value, or a dtype this torch's CPU autocast does not take (it would warn
            and run in float32, so the run would not be what was asked).
    """
    if mixed_precision == "none":
        return None
    if mixed_precision not in _HALF_DTYPES:
        raise ValueError(f"unknown mixed_precision {mixed_precision!r}; allowed: none | {' | '.join(_HALF_DTYPES)}")
    dtype = _HALF_DTYPES[mixed_precision]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns and disables autocast for a dtype it does not take
        with torch.autocast("cpu", dtype=dtype):
            taken = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == dtype
    if not taken:
        raise ValueError(f"mixed_precision {mixed_precision}: torch {torch.__version__}'s CPU autocast does not "
                         f"support {dtype} (it would run in float32)")
    return dtype


class ForwardScope:
    """What a forward and its loss run under on a training node: CPU autocast at `mixed_precision`
    (``none``: off; parameters and gradients stay float32), and on the first call the `ActivationMeter`,
    whose figure lands in `activation_bytes`.

    Use: ``with scope(model): loss = loss_fn(model(x), y)``; the backward runs after the block.

    Raises:
        ValueError: as `autocast_dtype`.
    """

    def __init__(self, mixed_precision: str = "none") -> None:
        self.dtype = autocast_dtype(mixed_precision)
        self.activation_bytes: int | None = None

    @contextlib.contextmanager
    def __call__(self, model: nn.Module | Callable[[], Iterable[torch.Tensor]]) -> Iterator[None]:
        """The scope for one forward and loss of `model` (its parameters are left out of the activations)."""
        autocast = torch.autocast("cpu", dtype=self.dtype) if self.dtype is not None else contextlib.nullcontext()
        if self.activation_bytes is not None:
            with autocast:
                yield
            return
        meter = ActivationMeter()
        with autocast, meter:
            yield
        params = model.parameters() if isinstance(model, nn.Module) else model()
        self.activation_bytes = meter.live_bytes(params)


def tensor_memory(module: nn.Module, optimizer: torch.optim.Optimizer | None, activation_bytes: int | None,
                  *, gradients: Iterable[torch.Tensor | None] | None = None,
                  optimizer_bytes: int | None = None) -> dict[str, Any]:
    """The ``tensor_memory`` record of a node's metrics: parameter, gradient, optimizer-state and
    activation bytes and their sum ``total_bytes`` (activations None: not measured, left out of the sum).

    `gradients`: the gradient tensors when they are not the parameters' ``.grad`` (a worker's flat
    vector); `optimizer_bytes`: the optimizer state's bytes when they are not in a torch optimizer."""
    parts = {
        "parameter_bytes": parameter_bytes(module),
        "gradient_bytes": gradient_bytes(module) if gradients is None else storage_bytes(gradients),
        "optimizer_state_bytes": optimizer_state_bytes(optimizer) if optimizer_bytes is None else optimizer_bytes,
        "activation_bytes": activation_bytes,
    }
    return {**parts, "total_bytes": sum(v for v in parts.values() if v is not None), "method": METHOD}
