"""Every pair of choices composes: a pairwise covering array (allpairspy) over placement x pacing x model x
codec x tls x checkpoints x held-out evaluation, each row a short run on the local backend (2 workers, tiny
models). Each row trains (the held-out loss at the end is below the first step's training loss), reports
its held-out metric, writes checkpoints when asked and records evaluations and the target when asked. A
row the config rules refuse must be refused with one of the documented physical reasons (`REFUSALS`); the
embedding model takes sparse rows wherever the rules allow them and runs dense where they do not."""

from __future__ import annotations

import re

import pytest
from allpairspy import AllPairs

from tests.integration.local_run import run_local
from tests.integration.warm_nodes import WarmNodes
from wiiide.config import RunConfig
from wiiide.errors import ConfigError

PLACEMENTS = {"central": {"ps_shards": "1"}, "sharded": {"ps_shards": "all"}}
PACINGS = {
    "rounds": {}, "ssp-2": {"staleness_bound": 2}, "async": {"staleness_bound": "async"},
    "local-4-avg": {"local_steps": 4}, "local-4-nesterov": {"local_steps": 4, "outer_optimizer": "nesterov"},
    "adaptive": {"adaptive_batch": True}, "accum-2": {"grad_accum_steps": 2},
    "local-4-ssp-2": {"local_steps": 4, "staleness_bound": 2},
}
MODELS = {
    "mlp": {"model": "mlp", "hidden_sizes": [32]},
    "cnn": {"model": "cnn", "cnn_channels": 4},
    "transformer": {"model": "transformer", "transformer_layers": 1, "transformer_width": 16, "transformer_heads": 2,
                    "transformer_context": 16, "batch_size": 16},
    "embedding": {"model": "embedding", "embedding_rows": 2000, "embedding_dim": 4, "embedding_fields": 4,
                  "embedding_samples": 4000, "momentum": 0.0},
}
CODECS = {"none": "none", "zstd": "fixed:zstd-1", "fp16": "fixed:fp16", "int8": "fixed:int8", "topk": "fixed:topk-0.1"}
# What the rules may refuse in this array, each for a physical reason (docs/parameter-server.md#refusals-and-why).
REFUSALS = {
    "sparse_embedding.*outer_optimizer nesterov .the outer step's momentum buffer moves every row": "sparse rows "
                                                                                                  "under DiLoCo",
}
ROWS = [tuple(row) for row in AllPairs([list(PLACEMENTS), list(PACINGS), list(MODELS), list(CODECS),
                                        ["tls-off", "tls-on"], ["ckpt-off", "ckpt-on"], ["eval-off", "eval-on"]])]


def _knobs(row: tuple, folder) -> dict:
    placement, pacing, model, codec, tls, ckpt, evaluation = row
    knobs = {"dataset": "digits", "num_workers": 2, "log_tier": "silent", "duration_s": 30, "max_steps": 20,
             "connect_timeout_s": 60, "learning_rate": 0.1, "lossy_warmup_steps": 2, "partition_bytes": "8KiB",
             **PLACEMENTS[placement], **PACINGS[pacing], **MODELS[model], "compression": CODECS[codec],
             "tls": tls == "tls-on"}
    if ckpt == "ckpt-on":
        knobs.update(checkpoint_every_steps=5, checkpoint_dir=str(folder / "ckpt"))
    if evaluation == "eval-on":
        knobs.update(eval_every_s=0.5, **({"target_loss": 4.0} if model == "transformer" else {"target_accuracy": 0.3}))
    return knobs


def _config(row: tuple, folder, refused: list) -> RunConfig:
    """The row's RunConfig: the embedding with sparse rows where the rules take them (else dense, the
    refusal kept in `refused`). Raises ConfigError for a row the rules refuse outright."""
    knobs = _knobs(row, folder)
    if knobs["model"] == "embedding":
        try:
            return RunConfig(**knobs, sparse_embedding=True)
        except ConfigError as exc:
            refused.append((row, "sparse_embedding", str(exc)))
    return RunConfig(**knobs)


@pytest.fixture(scope="module")
def warm():
    """Nodes forked from one warm process (`tests.integration.warm_nodes`): 36 runs skip 108 imports of torch."""
    with WarmNodes() as nodes:
        yield nodes


def _physical(message: str) -> bool:
    return any(re.search(pattern, message) for pattern in REFUSALS)


@pytest.mark.parametrize("row", ROWS, ids=["-".join(row) for row in ROWS])
def test_every_pair_of_choices_trains_or_is_refused_for_a_physical_reason(tmp_path, row, warm):
    refused: list = []
    try:
        cfg = _config(row, tmp_path, refused)
    except ConfigError as exc:
        assert _physical(str(exc)), f"{row} refused for a reason not in REFUSALS: {exc}"
        return
    assert all(_physical(message) for _, _, message in refused), refused
    coord = run_local(cfg, tmp_path / "run", popen=warm.popen)["coordinator"]
    assert coord["steps"] >= 2
    held_out = coord["validation_loss"] if cfg.model == "transformer" else coord["test_loss"]
    assert held_out is not None and held_out < coord["loss_first"], (held_out, coord["loss_first"])
    if cfg.model != "transformer":
        assert coord["test_accuracy"] is not None
    if cfg.checkpoint_every_steps:
        assert coord["checkpoints"]["written"] >= 1
    if cfg.eval_every_s:
        record = coord["held_out"]
        assert record["evaluations"] >= 1 and record["target_reached"] is not None  # a target, reached or not


def test_the_covering_array_covers_every_pair():
    levels = [list(PLACEMENTS), list(PACINGS), list(MODELS), list(CODECS), ["tls-off", "tls-on"],
              ["ckpt-off", "ckpt-on"], ["eval-off", "eval-on"]]
    for i in range(len(levels)):
        for j in range(i + 1, len(levels)):
            seen = {(row[i], row[j]) for row in ROWS}
            assert seen == {(a, b) for a in levels[i] for b in levels[j]}, (i, j)
