"""The models every engine trains, behind one registry keyed by ``RunConfig.model``.

=============  ================  ====================================================================
model          task              input -> output
=============  ================  ====================================================================
mlp            classification    float32 (b, features) -> (b, classes)        `wiiide.training.models.mlp`
cnn            classification    float32 (b, s*s) as 1 x s x s -> (b, classes) `wiiide.training.models.cnn`
transformer    language_model    int64 (b, T) bytes -> (b, T, 256)              `wiiide.training.models.transformer`
embedding      classification    int64 (b, fields) Zipf ids -> (b, 2)          `wiiide.training.models.embedding`
=============  ================  ====================================================================

`build_model` builds the configured model (seeded: equal configs build equal models on every node),
`model_spec` describes it in JSON for a worker and `model_from_spec` rebuilds it from that description
(checking every size, since it comes from the network). `loss_sum` is the loss every engine trains on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from wiiide.training.models.cnn import build_cnn
from wiiide.training.models.embedding import build_embedding
from wiiide.training.models.mlp import build_mlp
from wiiide.training.models.transformer import build_transformer

MODELS = ("mlp", "cnn", "transformer", "embedding")
TASKS = {"mlp": "classification", "cnn": "classification", "transformer": "language_model",
         "embedding": "classification"}
# (key, lowest, highest) of every integer in a description, per model type: a description comes from the network.
_SPEC_FIELDS: dict[str, tuple[tuple[str, int, int], ...]] = {
    "mlp": (("num_features", 1, 1_000_000), ("num_classes", 1, 100_000)),
    "cnn": (("num_features", 4, 1_000_000), ("channels", 1, 512), ("num_classes", 1, 100_000)),
    "transformer": (("layers", 1, 48), ("width", 8, 4096), ("heads", 1, 64), ("context", 1, 8192)),
    "embedding": (("rows", 1, 100_000_000), ("dim", 1, 1024), ("fields", 1, 256)),
}


def model_spec(cfg: Any, num_features: int, num_classes: int) -> dict[str, Any]:
    """The JSON description of ``cfg.model`` (a `wiiide.config.RunConfig`) that `model_from_spec` reads.

    `num_features` / `num_classes` come from the data set (used by mlp and cnn)."""
    kind = cfg.model
    if kind == "mlp":
        return {"type": "mlp", "num_features": num_features, "hidden_sizes": list(cfg.hidden_sizes),
                "num_classes": num_classes}
    if kind == "cnn":
        return {"type": "cnn", "num_features": num_features, "channels": cfg.cnn_channels, "num_classes": num_classes}
    if kind == "transformer":
        return {"type": "transformer", "layers": cfg.transformer_layers, "width": cfg.transformer_width,
                "heads": cfg.transformer_heads, "context": cfg.transformer_context}
    return {"type": "embedding", "rows": cfg.embedding_rows, "dim": cfg.embedding_dim, "fields": cfg.embedding_fields}


def build_from_spec(spec: dict[str, Any], seed: int, sparse: bool = False) -> nn.Module:
    """The model a description names, with initial weights from `seed`.

    `sparse`: embedding only, ``nn.Embedding(sparse=True)`` (DDP's sparse all-reduce).

    Raises:
        ValueError: a malformed description (unknown type, missing keys, non-integers) or sizes out of
            range (`_SPEC_FIELDS`; mlp: 1..16 hidden layers of 1..65,536).
    """
    def whole(value: Any) -> int:
        # JSON integers only: no bools, floats (1e400 is inf), strings or lists of digits
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"expected an integer, got {type(value).__name__}")
        return value

    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind not in _SPEC_FIELDS:
        raise ValueError(f"unknown model type {kind!r}; known: {', '.join(MODELS)}")
    try:
        values = {key: whole(spec[key]) for key, _, _ in _SPEC_FIELDS[kind]}
        hidden: list[int] = []
        if kind == "mlp":
            if not isinstance(spec["hidden_sizes"], list):
                raise TypeError("hidden_sizes must be a list")
            hidden = [whole(h) for h in spec["hidden_sizes"]]
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed model description: {exc}") from None
    for key, low, high in _SPEC_FIELDS[kind]:
        if not low <= values[key] <= high:
            raise ValueError(f"model description out of range: {kind} {key}={values[key]} (allowed {low}..{high})")
    if kind == "mlp":
        if not (0 < len(hidden) <= 16 and all(0 < h <= 65536 for h in hidden)):
            raise ValueError("model description out of range: mlp hidden_sizes (1..16 widths of 1..65536)")
        return build_mlp(values["num_features"], hidden, values["num_classes"], seed)
    if kind == "cnn":
        return build_cnn(values["num_features"], values["channels"], values["num_classes"], seed)
    if kind == "transformer":
        return build_transformer(values["layers"], values["width"], values["heads"], values["context"], seed)
    return build_embedding(values["rows"], values["dim"], values["fields"], seed, sparse=sparse)


def build_model(cfg: Any, num_features: int, num_classes: int, sparse: bool = False) -> nn.Module:
    """``cfg.model`` built from `cfg` with ``cfg.seed``; see `model_spec` and `build_from_spec`.

    Raises:
        ValueError: sizes the model cannot take (cnn on non-square images, width % heads != 0).
    """
    model = build_from_spec(model_spec(cfg, num_features, num_classes), cfg.seed, sparse=sparse)
    set_activation_checkpointing(model, getattr(cfg, "activation_checkpointing", False))
    return model


def set_activation_checkpointing(model: nn.Module, on: bool) -> None:
    """Turn the transformer's activation checkpointing on or off (`wiiide.training.models.transformer`).

    Raises:
        ValueError: `on` for a model other than the transformer (the others have no blocks to recompute).
    """
    if hasattr(model, "activation_checkpointing"):
        model.activation_checkpointing = bool(on)
    elif on:
        raise ValueError(f"activation checkpointing applies to the transformer only, not {type(model).__name__}")


def model_from_spec(spec: dict[str, Any]) -> nn.Module:
    """`build_from_spec` with seed 0 (the coordinator sends its parameters right after, so the seed
    does not matter). Raises ValueError as `build_from_spec` does."""
    return build_from_spec(spec, seed=0)


def task_of(kind: str) -> str:
    """``classification`` or ``language_model`` for a model type. Raises KeyError for an unknown one."""
    return TASKS[kind]


def check_batch(kind: str, x: torch.Tensor, y: torch.Tensor) -> None:
    """Check a batch from the network has the model's dtypes and shapes.

    mlp/cnn: x float32 (b, f), y int64 (b,); embedding: x int64 (b, fields), y int64 (b,);
    transformer: x and y int64 (b, T).

    Raises:
        ValueError: anything else (the caller turns it into a `ProtocolError`).
    """
    if x.dim() != 2:
        raise ValueError(f"batch x must be 2-D, got shape {tuple(x.shape)}")
    want_x = torch.float32 if kind in ("mlp", "cnn") else torch.int64
    want_y_shape = tuple(x.shape) if TASKS[kind] == "language_model" else (x.shape[0],)
    if x.dtype != want_x or y.dtype != torch.int64 or tuple(y.shape) != want_y_shape:
        raise ValueError(f"model {kind}: batch must hold x {tuple(x.shape)} {str(want_x).removeprefix('torch.')} "
                         f"and y {want_y_shape} int64, got x {x.dtype} and y {tuple(y.shape)} {y.dtype}")


def loss_sum(kind: str, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The sum over the batch of each sample's cross-entropy (nats): for the language model a sample's
    loss is the mean over its T next-byte predictions, so dividing by the batch gives the mean per byte.

    output: (b, classes) or (b, T, 256) float logits; y: int64 (b,) or (b, T).
    """
    if output.dim() == 3:
        per_token = nn.functional.cross_entropy(output.float().reshape(-1, output.shape[-1]), y.reshape(-1),
                                                reduction="sum")
        return per_token / y.shape[1]
    return nn.functional.cross_entropy(output.float(), y, reduction="sum")


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The submodules FSDP shards one by one (each is all-gathered for its forward and freed after):
    the Linear layers of an MLP, the blocks and embeddings of the transformer, the layers of the others."""
    if isinstance(model, nn.Sequential):
        return [m for m in model if isinstance(m, nn.Linear)]
    units: list[nn.Module] = []
    for child in model.children():
        units.extend(child if isinstance(child, nn.ModuleList) else [child])
    return [u for u in units if any(True for _ in u.parameters())]


__all__ = ["MODELS", "TASKS", "build_model", "build_from_spec", "model_spec", "model_from_spec", "task_of",
           "check_batch", "loss_sum", "loss_mean", "shard_units", "build_mlp", "set_activation_checkpointing"]


def loss_mean(kind: str, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy (nats) a worker trains on: over the samples (classification, as
    ``nn.functional.cross_entropy`` gives it) or over every next-byte prediction (language model)."""
    output = output.float()  # autocast's bf16/fp16 logits: the loss in float32 (a no-op for float32)
    if output.dim() == 3:
        return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), y.reshape(-1))
    return nn.functional.cross_entropy(output, y)
