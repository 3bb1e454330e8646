"""Rules between RunConfig's fields: what each engine, placement and pacing can apply.

`wiiide.config.RunConfig` calls these after every field parsed on its own; each raises `ConfigError`
naming the field, the value and what is allowed (or what the option needs), so an option the chosen
engine cannot apply is an error before any socket opens, never ignored. Their argument ``c`` is a
RunConfig, typed `Any` here because wiiide.config imports this module.
"""

from __future__ import annotations

from typing import Any

from wiiide.errors import ConfigError


def _check(cond: bool, name: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"config field '{name}': bad value {value!r}; allowed: {allowed}")


def _validate_engine(c: Any) -> None:
    """The engine's options; an option the chosen engine cannot apply is an error, not ignored."""
    torch_engine = c.engine in ("ddp", "fsdp")
    default_compression = type(c).model_fields["compression"].default
    default_shards = type(c).model_fields["ps_shards"].default
    only = [("ddp_comm_hook", c.ddp_comm_hook != "none", c.engine == "ddp", "engine ddp"),
            ("ddp_find_unused_parameters", c.ddp_find_unused_parameters, c.engine == "ddp", "engine ddp"),
            ("powersgd_rank", c.powersgd_rank != 1, c.ddp_comm_hook == "powersgd", "ddp_comm_hook powersgd"),
            ("fsdp_reshard_after_forward", not c.fsdp_reshard_after_forward, c.engine == "fsdp", "engine fsdp"),
            ("staleness_bound", c.staleness_bound != 0, c.engine == "wiiide", "engine wiiide"),
            ("staleness_scaling", c.staleness_scaling != "none", c.staleness_bound != 0, "staleness_bound != 0"),
            ("ssp_cache", c.ssp_cache, c.staleness_bound not in (0, "async") and c.local_steps == 1,
             "staleness_bound s >= 1 and local_steps 1"),
            ("local_steps", c.local_steps != 1, c.engine == "wiiide" or c.ddp_comm_hook == "post_local_sgd",
             "engine wiiide or ddp_comm_hook post_local_sgd"),
            ("outer_optimizer", c.outer_optimizer != "avg", c.engine == "wiiide" and c.local_steps > 1,
             "engine wiiide and local_steps > 1"),
            ("adaptive_batch", c.adaptive_batch, c.engine == "wiiide", "engine wiiide"),
            ("debug_step_sleep_s", c.debug_step_sleep_s != 0, c.engine == "wiiide", "engine wiiide"),
            ("profile", c.profile, torch_engine, "engine ddp or fsdp"),
            ("compression", c.compression != default_compression, c.engine == "wiiide", "engine wiiide"),
            ("ps_shards", c.ps_shards != default_shards, c.engine == "wiiide", "engine wiiide"),
            ("tls", c.tls, c.engine == "wiiide", "engine wiiide (gloo's own sockets are not wrapped)"),
            *((name, getattr(c, name) != 0, c.engine == "wiiide", "engine wiiide (a torch.distributed process "
               "group has a fixed world: a lost rank ends every rank's collectives, so there is no live run to "
               "restore a checkpoint into; the wiiide engine saves, restores and readmits)")
              for name in ("checkpoint_every_steps", "checkpoint_every_s"))]
    for name, is_set, applies, needs in only:
        if is_set and not applies:
            raise ConfigError(f"config field '{name}': {getattr(c, name)!r} needs {needs} "
                              f"(engine is {c.engine!r}, ddp_comm_hook {c.ddp_comm_hook!r})")
    if c.engine == "wiiide":
        _check(c.batch_size >= c.grad_accum_steps, "grad_accum_steps", c.grad_accum_steps,
               f"at most batch_size = {c.batch_size} (every micro-batch needs a sample)")
    _check(not c.activation_checkpointing or c.model == "transformer", "activation_checkpointing",
           c.activation_checkpointing, f"False unless model is transformer (model {c.model!r} has no blocks to "
           "recompute)")
    if c.mixed_precision != "none":  # torch only when asked: the harness reads configs without it
        from wiiide.tensor_memory import autocast_dtype

        try:
            autocast_dtype(c.mixed_precision)
        except ValueError as exc:
            raise ConfigError(f"config field 'mixed_precision': {exc}") from None
    _check(c.transformer_width % c.transformer_heads == 0, "transformer_width", c.transformer_width,
           f"a multiple of transformer_heads={c.transformer_heads}")
    if c.sparse_embedding:
        _check(c.model == "embedding", "sparse_embedding", c.sparse_embedding, "False unless model is embedding")
        _check(c.engine != "fsdp", "sparse_embedding", c.sparse_embedding,
               "False with engine fsdp (FSDP shards dense parameters only; sparse gradients are not supported)")
        _check(c.engine != "wiiide" or c.local_steps == 1 or c.outer_optimizer == "avg", "sparse_embedding",
               c.sparse_embedding, "False with outer_optimizer nesterov (the outer step's momentum buffer moves "
               "every row every round, as momentum does every step; set outer_optimizer: avg)")
        _check(c.engine != "wiiide" or c.momentum == 0, "sparse_embedding", c.sparse_embedding,
               "False with engine wiiide and momentum > 0 (momentum moves every row every step, so the "
               "parameter server could not pull changed rows only; set momentum: 0)")
    if torch_engine:
        global_batch = c.num_workers * c.batch_size
        _check(global_batch >= (c.num_workers + 1) * c.grad_accum_steps, "grad_accum_steps", c.grad_accum_steps,
               f"at most num_workers x batch_size / world size = {global_batch // (c.num_workers + 1)} "
               "(every rank needs a sample per micro-batch)")


def _validate_lr_schedule(c: Any) -> None:
    """The learning-rate schedule's fields (`wiiide.lr_schedule`): every engine and pacing applies them; a
    decay needs a length, and a decay's knob without a decay would be ignored, so it is an error."""
    decaying = c.lr_schedule != "constant"
    _check(not decaying or c.lr_decay_steps > 0 or c.max_steps > c.lr_warmup_steps, "lr_schedule", c.lr_schedule,
           f"constant unless lr_decay_steps > 0 or max_steps > lr_warmup_steps = {c.lr_warmup_steps} (a decay needs "
           "a length in steps; a run bounded by duration_s alone has none)")
    for name in ("lr_decay_steps", "lr_min_ratio"):
        _check(decaying or getattr(c, name) == 0, name, getattr(c, name),
               "0 unless lr_schedule is linear or cosine (it shapes the decay)")
