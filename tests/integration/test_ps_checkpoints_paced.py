"""Checkpoints of sharded local SGD and of paced shards (``ps_shards: all``, local backend): a run writes
checkpoints and stops; a second run over the same checkpoint folder restores the newest step complete and
verified on every shard and goes on. The restored parameters are those the first run ended with (digest),
the loss keeps falling after the restore, local SGD's files carry the outer step's Nesterov buffer, a paced
run's coordinator file carries the SSP clocks of its cut, and a truncated or corrupted shard file is refused
with its cause (the restore falls back to the previous complete step)."""

from __future__ import annotations

import shutil

import pytest

from tests.integration.local_run import run_local
from tests.integration.warm_nodes import WarmNodes
from wiiide.server.checkpoint import CheckpointStore
from wiiide.config import RunConfig
from wiiide.log import TieredLog
from wiiide.server.ps.checkpoints import restore_shards, shard_prefix
from wiiide.server.ps.digest import params_digest
from wiiide.server.ps.paced_checkpoints import HANDOUT_KEY
from wiiide.server.ps.partition import Partition

SHARDS = 3  # the coordinator + 2 workers
PACINGS = {  # label -> (knobs, checkpoint_every_steps, steps of the first run)
    "local-sgd-nesterov": ({"local_steps": 4, "outer_optimizer": "nesterov", "outer_learning_rate": 0.7}, 5, 10),
    "async": ({"staleness_bound": "async"}, 20, 40),
    "ssp-2": ({"staleness_bound": 2}, 20, 40),
    "adaptive": ({"adaptive_batch": True}, 10, 20),
}


class _Log(TieredLog):
    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg, "test")
        self.errors: list[str] = []

    def error(self, fmt: str, *args: object) -> None:
        self.errors.append(fmt % args)


def _cfg(tmp_path, knobs: dict, every: int, steps: int) -> RunConfig:
    return RunConfig(dataset="digits", num_workers=2, ps_shards="all", log_tier="silent", duration_s=60,
                     connect_timeout_s=60, momentum=0.5, partition_bytes="4KiB", checkpoint_every_steps=every,
                     checkpoint_dir=str(tmp_path / "ckpt"), max_steps=steps, **knobs)


def _restore(cfg: RunConfig, folder, plan_step: int):
    """`restore_shards` over `folder` (what the restarted coordinator calls) with the plan the files of
    `plan_step` name (each shard's partitions' bounds, in the file's run metadata)."""
    bounds = []
    for s in range(SHARDS):
        store = CheckpointStore(folder, shard_prefix(s))
        bounds += [(a, b, s) for a, b in store.read(store.path_for(plan_step)).run["partitions"]]
    partitions = [Partition(i, a, b, s) for i, (a, b, s) in enumerate(sorted(bounds))]
    return restore_shards(cfg.replace(checkpoint_dir=str(folder)), partitions, SHARDS, partitions[-1].stop, _Log(cfg))


@pytest.fixture(scope="module")
def warm():
    """Nodes forked from one warm process (`tests.integration.warm_nodes`)."""
    with WarmNodes() as nodes:
        yield nodes


@pytest.mark.parametrize("label", list(PACINGS))
def test_a_sharded_run_checkpoints_stops_and_a_restart_restores_it_and_goes_on(tmp_path, label, warm):
    knobs, every, steps = PACINGS[label]
    first_cfg = _cfg(tmp_path, knobs, every, steps)
    first = run_local(first_cfg, tmp_path / "first", popen=warm.popen)["coordinator"]
    assert first["steps"] == steps and first["checkpoints"]["last_step"] == steps
    ckpt = tmp_path / "ckpt"
    newest = {s: CheckpointStore(ckpt, shard_prefix(s)).read(ckpt / f"ps-shard-{s}-step{steps:012d}.safetensors")
              for s in range(SHARDS)}
    if "local_steps" in knobs:  # the outer step's Nesterov buffer is in every shard's file, beside its anchor
        assert all(set(c.tensors) == {"params", "outer_momentum"} for c in newest.values())
    else:
        assert all(set(c.tensors) == {"params", "momentum"} for c in newest.values())
    if "staleness_bound" in knobs:  # the drained cut: every task reported, the clocks sum to the step
        handout = newest[0].run[HANDOUT_KEY]
        assert handout["tasks_handed_out"] == steps and sum(handout["ssp_clocks"].values()) == steps
        assert first["pace"]["checkpoint_cut"]["cut"] == "drain"
        assert first["pace"]["checkpoint_cut"]["cuts_drained"] == steps // every

    second = run_local(first_cfg.replace(max_steps=2 * steps), tmp_path / "second", popen=warm.popen)["coordinator"]
    rec = second["recovery"]
    assert rec["restored_step"] == steps and rec["restored_shards"] == SHARDS and rec["refused"] == []
    assert rec["restored_params_sha256"] == first["params_digest"]["sha256"]  # the parameters the first run ended with
    assert second["steps"] == 2 * steps and second["checkpoints"]["last_step"] == 2 * steps
    assert second["loss_avg"] < first["loss_avg"]  # it went on from the restored state, not from scratch
    assert second["test_loss"] < first["test_loss"]  # and the held-out loss fell further
    assert second["test_accuracy"] > 0.5

    # a truncated file and a corrupted one are refused with their cause; the previous complete step is used
    for damage, cause in (("truncate", "unreadable"), ("flip", "SHA-256 mismatch")):
        folder = tmp_path / f"ckpt-{damage}"
        shutil.copytree(ckpt, folder)
        target = folder / f"ps-shard-1-step{2 * steps:012d}.safetensors"
        data = bytearray(target.read_bytes())
        if damage == "truncate":
            del data[len(data) // 2:]
        else:
            data[-1] ^= 0x40
        target.write_bytes(bytes(data))
        restored, refused = _restore(first_cfg, folder, steps)
        assert restored is not None and restored.step == 2 * steps - every
        assert [r["path"] for r in refused] == [str(target)] and cause in refused[0]["cause"]
    intact, _ = _restore(first_cfg, ckpt, steps)
    assert intact.step == 2 * steps and params_digest(intact.params)["sha256"] == second["params_digest"]["sha256"]
