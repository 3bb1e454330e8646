"""Checkpoints of the sharded parameter server (wiiide.server.ps.checkpoints, wiiide.server.checkpoint.load_newest_complete):
one file per shard and step, written once every partition of the shard reached the step; the restore
takes the newest step complete and verified on EVERY shard, and a corrupted or missing shard file falls
back to the previous complete step with the reason logged."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from wiiide.server.checkpoint import CheckpointStore, load_newest_complete
from wiiide.config import RunConfig
from wiiide.log import TieredLog
from wiiide.metrics import NodeMetrics
from wiiide.training.model import MomentumSGD
from wiiide.server.ps.checkpoints import ShardCheckpointer, restore_shards, shard_prefix
from wiiide.server.ps.link_probe import AUTO_RULES
from wiiide.server.ps.partition import partition_flat
from wiiide.server.ps.session import _restore
from wiiide.server.recovery import ServerRecovery

NUMEL = 1000
SHARDS = 3


class _Log(TieredLog):
    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg, "test")
        self.errors: list[str] = []

    def error(self, fmt: str, *args: object) -> None:
        self.errors.append(fmt % args)


def _cfg(tmp_path, **knobs) -> RunConfig:
    return RunConfig(**{"num_workers": 2, "log_tier": "silent", "momentum": 0.9, "learning_rate": 0.1,
                        "checkpoint_every_steps": 5, "checkpoint_dir": str(tmp_path / "ckpt"), **knobs})


def _train_shards(cfg: RunConfig, steps: int, log: TieredLog):
    """Partitions of a NUMEL vector over SHARDS shards, each partition with its own parameters and
    MomentumSGD stepped on seeded gradients as a shard does; returns the partitions, the full parameter
    and momentum vectors at every checkpoint step, and the checkpointers."""
    partitions = partition_flat(NUMEL, SHARDS, 400)  # 10 partitions of 100 floats, spread over 3 shards
    rng = np.random.default_rng(0)
    start = rng.standard_normal(NUMEL).astype(np.float32)
    params = {p.index: torch.from_numpy(start[p.start:p.stop].copy()) for p in partitions}
    optimizers = {i: MomentumSGD([t], lr=cfg.learning_rate, momentum=cfg.momentum) for i, t in params.items()}
    writers = [ShardCheckpointer(cfg, s, SHARDS, [p for p in partitions if p.shard == s], NodeMetrics("worker", f"s{s}"),
                                 {}, log) for s in range(SHARDS)]
    history = {}
    for step in range(1, steps + 1):
        for p in partitions:  # one update per partition per step, in an order that mixes the shards
            params[p.index].grad = torch.from_numpy(rng.standard_normal(p.numel).astype(np.float32))
            optimizers[p.index].step()
            ready = writers[p.shard].offer(p.index, step, params[p.index].numpy(), optimizers[p.index])
            if ready is not None:
                writers[p.shard].write(*ready)
        if step % cfg.checkpoint_every_steps == 0:
            full = np.concatenate([params[p.index].numpy() for p in partitions])
            mom = (np.concatenate([optimizers[p.index].momentum_buffers[0].numpy() for p in partitions])
                   if cfg.momentum else None)
            history[step] = (full.copy(), None if mom is None else mom.copy())
    return partitions, history, writers


def test_every_shard_writes_its_file_at_the_same_steps_and_the_newest_complete_step_is_restored(tmp_path):
    cfg = _cfg(tmp_path)
    log = _Log(cfg)
    partitions, history, writers = _train_shards(cfg, 12, log)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == [f"ps-shard-{s}-step{step:012d}.safetensors" for s in range(SHARDS) for step in (5, 10)]
    assert all(w.record["written"] == 2 and w.record["last_step"] == 10 for w in writers)
    # a shard file holds that shard's partitions only, in partition order
    shard1 = CheckpointStore(tmp_path / "ckpt", shard_prefix(1)).read(tmp_path / "ckpt" / names[3])
    owned = [p for p in partitions if p.shard == 1]
    assert shard1.tensors["params"].shape == (sum(p.numel for p in owned),)
    np.testing.assert_array_equal(shard1.tensors["params"][:owned[0].numel],
                                  history[10][0][owned[0].start:owned[0].stop])
    assert shard1.run["partitions"] == [[p.start, p.stop] for p in owned] and shard1.run["num_shards"] == SHARDS

    restored, refused = restore_shards(cfg, partitions, SHARDS, NUMEL, log)
    assert refused == [] and log.errors == []
    assert restored.step == 10 and len(restored.paths) == SHARDS
    np.testing.assert_array_equal(restored.params, history[10][0])
    np.testing.assert_array_equal(restored.momentum, history[10][1])


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_shard_file_that_fails_its_hash_makes_its_step_incomplete_and_the_previous_one_is_used(tmp_path):
    cfg = _cfg(tmp_path)
    log = _Log(cfg)
    partitions, history, _ = _train_shards(cfg, 10, log)
    bad = tmp_path / "ckpt" / f"ps-shard-2-step{10:012d}.safetensors"
    _flip_last_byte(bad)
    restored, refused = restore_shards(cfg, partitions, SHARDS, NUMEL, log)
    assert restored.step == 5  # every shard goes back to step 5, not only the one with the bad file
    np.testing.assert_array_equal(restored.params, history[5][0])
    np.testing.assert_array_equal(restored.momentum, history[5][1])
    assert [r["path"] for r in refused] == [str(bad)] and "SHA-256 mismatch" in refused[0]["cause"]
    assert len(log.errors) == 1 and "step 10 is incomplete" in log.errors[0] and str(bad) in log.errors[0]


def test_a_step_one_shard_never_wrote_is_incomplete(tmp_path):
    cfg = _cfg(tmp_path)
    log = _Log(cfg)
    partitions, history, _ = _train_shards(cfg, 10, log)
    (tmp_path / "ckpt" / f"ps-shard-0-step{10:012d}.safetensors").unlink()  # shard 0 died before writing it
    restored, _ = restore_shards(cfg, partitions, SHARDS, NUMEL, log)
    assert restored.step == 5
    np.testing.assert_array_equal(restored.params, history[5][0])


def test_files_of_another_plan_or_training_configuration_are_refused(tmp_path):
    cfg = _cfg(tmp_path)
    log = _Log(cfg)
    partitions, _, _ = _train_shards(cfg, 5, log)
    other_plan = partition_flat(NUMEL, SHARDS, 800)  # 5 partitions: other bounds per shard
    restored, refused = restore_shards(cfg, other_plan, SHARDS, NUMEL, log)
    assert restored is None and "another run configuration (partitions" in refused[0]["cause"]
    restored, refused = restore_shards(_cfg(tmp_path, learning_rate=0.2), partitions, SHARDS, NUMEL, _Log(cfg))
    assert restored is None and "another run configuration" in refused[0]["cause"]
    assert restore_shards(cfg, partitions, SHARDS + 1, NUMEL, log)[0] is None  # no ps-shard-3 files at all


def test_no_momentum_is_written_or_restored_with_momentum_zero(tmp_path):
    cfg = _cfg(tmp_path, momentum=0.0)
    log = _Log(cfg)
    partitions, _, _ = _train_shards(cfg, 5, log)  # MomentumSGD keeps no buffer
    restored, _ = restore_shards(cfg, partitions, SHARDS, NUMEL, log)
    assert restored.step == 5 and restored.momentum is None


@pytest.mark.parametrize("steps", [[3, 7], [7]])
def test_load_newest_complete_needs_the_step_in_every_store(tmp_path, steps):
    a, b = CheckpointStore(tmp_path, "a"), CheckpointStore(tmp_path, "b")
    for step in (3, 7):
        a.save(step, {"params": np.full(4, step, np.float32)})
    for step in steps:
        b.save(step, {"params": np.full(2, step, np.float32)})
    step, loaded = load_newest_complete([a, b], [{"params": (4,)}, {"params": (2,)}], [None, None])
    assert step == 7 and [c.tensors["params"][0] for c in loaded] == [7.0, 7.0]
    (tmp_path / f"b-step{7:012d}.safetensors").write_bytes(b"truncated")
    found = load_newest_complete([a, b], [None, None], [None, None])
    assert (found[0] if found else None) == (3 if 3 in steps else None)
    assert "unreadable" in b.refused[0]["cause"]


def _serve_steps(cfg, server, port, models, flats, parts, steps, first_step=0):
    """Two workers' clients push `steps` steps of seeded batches to `server` (from `first_step`); returns
    the workers' parameters after each step."""
    from tests.unit.test_ps import _worker_clients

    clients, after = [], {}
    try:
        _worker_clients(cfg, port, models, flats, parts, clients)
        for step in range(first_step, first_step + steps):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
            for i, (model, flat, client) in enumerate(zip(models, flats, clients)):
                flat.grads.zero_()
                client.begin_step(step)
                torch.nn.functional.cross_entropy(model(x[i * 3:(i + 1) * 3]), y[i * 3:(i + 1) * 3]).backward()
            for client in clients:
                client.finish_step(step)
            after[step + 1] = flats[0].params.clone()
    finally:
        for client in clients:
            client.close()
    return after


def test_a_shard_restored_from_its_checkpoint_goes_on_exactly_as_the_uninterrupted_shard(tmp_path):
    from tests.unit.test_ps import SECRET, _node
    from wiiide.training.model import FlatParams, build_mlp
    from wiiide.server.ps.shard import ShardServer

    cfg = _cfg(tmp_path, checkpoint_every_steps=2, io_timeout_s=5, connect_timeout_s=5)

    def shard(params, momentum=None, start_step=0):
        metrics, log = _node(cfg, "coordinator", "shard0")
        server = ShardServer(cfg, SECRET, metrics, log, 0)
        port = server.listen()
        server.configure(parts, params, lossy_pulls=False, momentum=momentum, start_step=start_step)
        return server.start(), port

    models = [build_mlp(8, [4], 3, seed=0) for _ in range(2)]
    flats = [FlatParams(m) for m in models]
    parts = partition_flat(flats[0].numel, 1, 64)  # several partitions on the one shard
    start = flats[0].params.numpy().copy()
    server, port = shard(start)
    try:
        uninterrupted = _serve_steps(cfg, server, port, models, flats, parts, 6)
    finally:
        server.close()
    assert server.stats["checkpoints"]["written"] == 3 and server.stats["checkpoints"]["last_step"] == 6
    restored, refused = restore_shards(cfg, parts, 1, flats[0].numel, _Log(cfg))
    assert restored.step == 6 and refused == []
    np.testing.assert_array_equal(restored.params, uninterrupted[6].numpy())

    # the step-4 checkpoint (the newest complete one once step 6's file is corrupted) resumes exactly
    _flip_last_byte(tmp_path / "ckpt" / f"ps-shard-0-step{6:012d}.safetensors")
    restored, _ = restore_shards(cfg, parts, 1, flats[0].numel, _Log(cfg))
    assert restored.step == 4 and restored.momentum is not None
    np.testing.assert_array_equal(restored.params, uninterrupted[4].numpy())
    for flat in flats:
        flat.load(torch.from_numpy(restored.params.copy()))
    server, port = shard(restored.params, restored.momentum, restored.step)
    try:
        resumed = _serve_steps(cfg, server, port, models, flats, parts, 2, first_step=4)
    finally:
        server.close()
    assert torch.equal(resumed[6], uninterrupted[6])  # momentum restored too: bit for bit


def test_a_step_the_coordinator_announces_is_written_and_one_a_partition_passed_is_missed(tmp_path):
    from wiiide.errors import ProtocolError
    from wiiide.server.ps.checkpoints import announce_step

    cfg = _cfg(tmp_path, checkpoint_every_steps=0, checkpoint_every_s=5.0)  # time trigger only
    log = _Log(cfg)
    partitions = partition_flat(NUMEL, 1, 400)
    metrics = NodeMetrics("coordinator", "s0")
    writer = ShardCheckpointer(cfg, 0, 1, partitions, metrics, {}, log)
    params = {p.index: torch.zeros(p.numel) for p in partitions}
    optimizers = {i: MomentumSGD([t], lr=0.1, momentum=0.9) for i, t in params.items()}
    # batches of steps 0 and 1 are out (handed_out 2): a partition can reach step 2, so 3 is announced
    assert announce_step(2) == 3 and writer.announce(3, reached=1)
    for step in range(1, 6):
        for p in partitions:
            params[p.index].grad = torch.full((p.numel,), float(step))
            optimizers[p.index].step()
            ready = writer.offer(p.index, step, params[p.index].numpy(), optimizers[p.index])
            if ready is not None:
                writer.write(*ready)
        if step == 4:
            assert not writer.announce(4, reached=4)  # overtaken: missed, logged, nothing written
    assert [int(p.name[-24:-12]) for p in (tmp_path / "ckpt").iterdir()] == [3]
    assert "checkpoint of step 4 announced when a partition of this shard had reached it" in log.errors[0]
    assert [e["step"] for e in metrics.events if e["event"] == "checkpoint_missed"] == [4]
    with pytest.raises(ProtocolError, match="integer"):
        writer.announce("7", reached=5)
    assert restore_shards(cfg, partitions, 1, NUMEL, log)[0].step == 3


def test_a_restarted_run_restores_with_the_plan_its_checkpoints_were_written_with(tmp_path):
    """``partitions_per_shard: auto`` may pick other pieces after a restart than before it (the link
    probe): the coordinator tries the other plan ``auto`` can pick when its own finds no checkpoint,
    and runs with the plan that restored; files refused under the plan not used are not reported."""
    cfg = _cfg(tmp_path)
    log = _Log(cfg)
    partitions, history, _ = _train_shards(cfg, 10, log)
    probed = partition_flat(NUMEL, SHARDS, 800)  # what the probe's piece count would cut now
    loaded: list[np.ndarray] = []
    flat = SimpleNamespace(numel=NUMEL, load=lambda t: loaded.append(t.numpy().copy()))
    coord = SimpleNamespace(cfg=cfg, log=log, recovery=ServerRecovery(cfg, NodeMetrics("coordinator", "c"), log))

    coarse, fine = AUTO_RULES[4], AUTO_RULES[0]
    plans = [(coarse, probed), (AUTO_RULES[2], probed), (fine, partitions)]  # a rule of the same pieces is tried once
    restored, rule, plan = _restore(coord, plans, SHARDS, flat)
    assert restored.step == 10 and rule == fine and plan == partitions
    np.testing.assert_array_equal(loaded[0], history[10][0])
    assert coord.recovery.recovery["restored_step"] == 10 and coord.recovery.recovery["refused"] == []

    alone = SimpleNamespace(cfg=cfg, log=log, recovery=ServerRecovery(cfg, NodeMetrics("coordinator", "c"), log))
    restored, rule, plan = _restore(alone, [(coarse, probed)], SHARDS, flat)  # an integer setting: one plan
    assert restored is None and rule == coarse and plan == probed
    assert "another run configuration (partitions" in alone.recovery.recovery["refused"][0]["cause"]


def test_sharded_local_sgd_files_hold_the_outer_steps_nesterov_buffer_and_restore_it_to_the_bit(tmp_path):
    """With local_steps > 1 a shard's optimizer is the outer step (`PartitionOuterStep`): its file holds the
    anchor (``params``) and its slice of the Nesterov buffer (``outer_momentum``); the restored shards step
    on exactly as the uninterrupted ones, and a run with another outer optimizer refuses the files."""
    from wiiide.server.pace.outer import PartitionOuterStep
    from wiiide.server.ps.local_sgd import load_optimizer_state

    cfg = _cfg(tmp_path, local_steps=4, outer_optimizer="nesterov", outer_learning_rate=0.7, outer_momentum=0.9)
    partitions = partition_flat(NUMEL, SHARDS, 400)
    rng = np.random.default_rng(1)
    start = rng.standard_normal(NUMEL).astype(np.float32)
    deltas = [rng.standard_normal(NUMEL).astype(np.float32) for _ in range(8)]

    def outer_steps(params, optimizers, steps, writers=None):
        for step in steps:
            for p in partitions:
                params[p.index].grad = torch.from_numpy(deltas[step][p.start:p.stop].copy())
                optimizers[p.index].step()
                ready = writers[p.shard].offer(p.index, step + 1, params[p.index].numpy(), optimizers[p.index]) if writers else None
                if ready is not None:
                    writers[p.shard].write(*ready)

    def fresh(values):
        params = {p.index: torch.from_numpy(values[p.start:p.stop].copy()) for p in partitions}
        return params, {i: PartitionOuterStep(t, "nesterov", 0.7, 0.9) for i, t in params.items()}

    params, optimizers = fresh(start)
    writers = [ShardCheckpointer(cfg, s, SHARDS, [p for p in partitions if p.shard == s], NodeMetrics("worker", f"s{s}"),
                                 {}, _Log(cfg)) for s in range(SHARDS)]
    outer_steps(params, optimizers, range(5), writers)  # checkpoint at step 5
    restored, refused = restore_shards(cfg, partitions, SHARDS, NUMEL, _Log(cfg))
    assert restored.step == 5 and refused == []
    buffer = np.concatenate([optimizers[p.index].outer.buffer.numpy() for p in partitions])
    np.testing.assert_array_equal(restored.momentum, buffer)  # the Nesterov buffer, not a MomentumSGD one
    outer_steps(params, optimizers, range(5, 8))
    again, again_optimizers = fresh(restored.params)
    for p in partitions:
        load_optimizer_state(again_optimizers[p.index], restored.momentum[p.start:p.stop])
    outer_steps(again, again_optimizers, range(5, 8))
    for p in partitions:
        assert torch.equal(again[p.index], params[p.index])
    other, refused = restore_shards(_cfg(tmp_path, local_steps=4, outer_optimizer="avg"), partitions, SHARDS, NUMEL,
                                    _Log(cfg))
    assert other is None and "another run configuration" in refused[0]["cause"]
