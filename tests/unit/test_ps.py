"""Sharded parameter servers (wiiide/server/ps/): partitioning, error feedback both ways, delta pulls."""

from __future__ import annotations

import time

import numpy as np
import pytest

from wiiide.codecs.policy import CompressionPolicy, fixed_lossy_ratio
from wiiide.config import RunConfig
from wiiide.errors import ConfigError
from wiiide.training.model import FlatParams, build_mlp
from wiiide.server.ps.digest import params_digest
from wiiide.server.pace.feedback import ErrorFeedback, PullReplica, decoded_values, pulls_as_deltas, received_values
from wiiide.server.ps.partition import (
    egress_shard_weights,
    finest_raw_bytes,
    pipeline_shard_weights,
    partition_flat,
    PER_SHARD_FINEST_BYTES,
    plan_partitions,
    resolve_shards,
    shard_loads_bytes,
)
from wiiide.server.ps.session import _seconds, partition_finest_bytes, policy_may_be_lossy
from wiiide.units import MIB
from wiiide.wire.messages import WireTensor

DIGITS_MLP_NUMEL = 64 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10  # 301,066: 1.2 MB


@pytest.mark.parametrize("numel, shards, partition_bytes", [
    (DIGITS_MLP_NUMEL, 5, 4 * MIB), (DIGITS_MLP_NUMEL, 9, 4 * MIB), (6_500_000, 5, 4 * MIB),
    (6_500_000, 9, 1 * MIB), (10, 9, 4 * MIB), (7, 3, 4), (1000, 1, 64)])
def test_partitions_tile_the_vector_and_balance_the_shards(numel, shards, partition_bytes):
    parts = partition_flat(numel, shards, partition_bytes)
    covered = np.zeros(numel, dtype=np.int64)
    for p in parts:
        covered[p.start:p.stop] += 1
        assert 0 < p.nbytes <= partition_bytes
    assert covered.min() == covered.max() == 1  # every element in exactly one partition
    assert [p.index for p in parts] == list(range(len(parts)))
    loads = shard_loads_bytes(parts, shards)
    assert sum(loads) == numel * 4
    if len(parts) >= shards:
        assert min(loads) > 0  # a small model spreads over every shard too
    assert max(loads) - min(loads) <= max(p.nbytes for p in parts)  # within one partition's size


@pytest.mark.parametrize("numel, workers, partition_bytes", [
    (DIGITS_MLP_NUMEL, 4, 64 * 1024), (DIGITS_MLP_NUMEL, 8, 64 * 1024), (DIGITS_MLP_NUMEL, 8, 4 * MIB),
    (6_500_000, 4, 4 * MIB), (9, 8, 4), (12, 3, 4)])
def test_egress_weighted_partitions_tile_and_follow_the_weights(numel, workers, partition_bytes):
    shards = workers + 1
    weights = egress_shard_weights(shards, workers)
    assert weights[0] == 2.0 and weights[1:] == [1.0] * workers  # the coordinator pushes nothing: twice a share
    parts = partition_flat(numel, shards, partition_bytes, weights)
    covered = np.zeros(numel, dtype=np.int64)
    for p in parts:
        covered[p.start:p.stop] += 1
        assert 0 < p.nbytes <= partition_bytes
    assert covered.min() == covered.max() == 1
    assert [p.index for p in parts] == list(range(len(parts)))
    loads = [n // 4 for n in shard_loads_bytes(parts, shards)]
    assert min(loads) >= 1
    for load, w in zip(loads, weights):
        assert abs(load - numel * w / sum(weights)) <= 1 or numel < 2 * shards


@pytest.mark.parametrize("workers", [3, 4, 8])  # at 2 a worker sends M whatever its share
def test_egress_weights_lower_the_busiest_link(workers):
    """Bytes each node sends per step (pushes to other shards, pulls to other workers; loopback free):
    with the weights the busiest node sends less than with equal bytes, and every node about the same."""
    shards, model_bytes = workers + 1, DIGITS_MLP_NUMEL * 4

    def egress(parts):
        loads = shard_loads_bytes(parts, shards)
        per_worker = [model_bytes - loads[s] + (workers - 1) * loads[s] for s in range(1, shards)]
        return [workers * loads[0]] + per_worker
    equal = egress(partition_flat(DIGITS_MLP_NUMEL, shards, 64 * 1024))
    weighted = egress(partition_flat(DIGITS_MLP_NUMEL, shards, 64 * 1024, egress_shard_weights(shards, workers)))
    assert max(weighted) < max(equal)
    assert max(weighted) - min(weighted) <= 4 * workers  # level to a few elements' rounding


@pytest.mark.parametrize("numel, workers, partition_bytes", [
    (DIGITS_MLP_NUMEL, 4, 64 * 1024), (DIGITS_MLP_NUMEL, 8, 64 * 1024), (6_500_000, 8, 4 * MIB), (12, 3, 4)])
def test_pipeline_partitions_put_the_coordinators_range_at_the_tail(numel, workers, partition_bytes):
    """partition_balance pipeline: every element once, each worker's shard a contiguous range in shard
    order, then the coordinator's (shard 0) last, at its fair-share weight (with partitions -> 0 the
    egress shares; `tests/unit/test_round_model.py` checks the weights against the simulated links)."""
    shards = workers + 1
    assert pipeline_shard_weights(shards, workers) == egress_shard_weights(shards, workers)
    weights = pipeline_shard_weights(shards, workers, numel * 4, partition_bytes)
    assert weights[0] > 0 and weights[1:] == [1.0] * workers
    parts = partition_flat(numel, shards, partition_bytes, weights, [*range(1, shards), 0])
    covered = np.zeros(numel, dtype=np.int64)
    for p in parts:
        covered[p.start:p.stop] += 1
    assert covered.min() == covered.max() == 1 and [p.index for p in parts] == list(range(len(parts)))
    runs = [p.shard for i, p in enumerate(parts) if i == 0 or parts[i - 1].shard != p.shard]
    assert runs == [*range(1, shards), 0]  # one contiguous range per shard, shard 0's at the tail
    assert parts[-1].stop == numel and parts[-1].shard == 0
    loads = [n // 4 for n in shard_loads_bytes(parts, shards)]
    for load, w in zip(loads, weights):
        assert abs(load - numel * w / sum(weights)) <= 1 or numel < 2 * shards
    with pytest.raises(ValueError, match="permutation"):
        partition_flat(numel, shards, partition_bytes, weights, [0] * shards)


@pytest.mark.parametrize("balance", ["pipeline", "egress", "bytes"])
@pytest.mark.parametrize("numel, workers, partition_bytes, per_shard", [
    (DIGITS_MLP_NUMEL, 4, 4 * MIB, 4), (DIGITS_MLP_NUMEL, 8, 4 * MIB, 4), (6_500_000, 4, 4 * MIB, 4),
    (6_500_000, 8, 1 * MIB, 2), (40, 3, 4 * MIB, 8), (12, 3, 4, 1)])
def test_interleaved_placement_deals_the_same_pieces_to_the_shards_in_turns(numel, workers, partition_bytes,
                                                                            per_shard, balance):
    """``partition_placement: interleaved``: every element once, each shard the same load and the same
    piece sizes as in contiguous ranges, and no two pieces next to each other on one shard while every
    shard still has one to deal (with pipeline, the shards in the same order: shard 0 last in each turn)."""
    shards = workers + 1
    contiguous = plan_partitions(numel, shards, workers, partition_bytes, balance, per_shard)
    parts = plan_partitions(numel, shards, workers, partition_bytes, balance, per_shard, "interleaved")
    covered = np.zeros(numel, dtype=np.int64)
    for p in parts:
        covered[p.start:p.stop] += 1
    assert covered.min() == covered.max() == 1 and [p.index for p in parts] == list(range(len(parts)))
    assert parts[0].start == 0 and all(a.stop == b.start for a, b in zip(parts, parts[1:]))
    loads = shard_loads_bytes(parts, shards)
    if balance != "bytes":
        assert loads == shard_loads_bytes(contiguous, shards)
        for shard in range(shards):
            assert ([p.numel for p in parts if p.shard == shard]
                    == [p.numel for p in contiguous if p.shard == shard])
    else:  # the same near-equal pieces, partition i on shard i mod k instead of by LPT
        assert [p.numel for p in parts] == [p.numel for p in contiguous]
        assert max(loads) - min(loads) <= max(p.nbytes for p in parts) + 4 * shards  # pieces differ by an element
    fewest = min(sum(1 for p in parts if p.shard == s) for s in range(shards))
    first_turns = [p.shard for p in parts[:fewest * shards]]
    assert sorted(first_turns) == sorted(list(range(shards)) * fewest)  # every shard once per turn
    assert all(a != b for a, b in zip(first_turns, first_turns[1:]))
    if balance == "pipeline" and fewest:
        assert first_turns[:shards] == [*range(1, shards), 0]
    with pytest.raises(ValueError, match="placement"):
        plan_partitions(numel, shards, workers, partition_bytes, balance, per_shard, "striped")


@pytest.mark.parametrize("finest", [PER_SHARD_FINEST_BYTES, 15 * PER_SHARD_FINEST_BYTES])
@pytest.mark.parametrize("balance", ["pipeline", "egress", "bytes"])
@pytest.mark.parametrize("numel, workers, partition_bytes, per_shard", [
    (DIGITS_MLP_NUMEL, 4, 4 * MIB, 4), (DIGITS_MLP_NUMEL, 8, 4 * MIB, 4), (DIGITS_MLP_NUMEL, 8, 64 * 1024, 3),
    (6_500_000, 4, 4 * MIB, 4), (6_500_000, 8, 1 * MIB, 2), (40, 3, 4 * MIB, 8), (4_000_000, 3, 4 * MIB, 64)])
def test_partitions_per_shard_cuts_every_shards_range_into_that_many(numel, workers, partition_bytes, per_shard,
                                                                     balance, finest):
    """``partitions_per_shard``: every shard owns at least that many partitions while they stay about
    `finest` bytes or more (64 KiB; 15x that under lloyd2), none larger than `partition_bytes`, every
    element in exactly one, the shards' loads as with one partition per shard (pipeline, egress: the same
    shares; bytes: within one partition)."""
    shards = workers + 1
    parts = plan_partitions(numel, shards, workers, partition_bytes, balance, per_shard, finest_bytes=finest)
    covered = np.zeros(numel, dtype=np.int64)
    for p in parts:
        covered[p.start:p.stop] += 1
        assert 0 < p.nbytes <= partition_bytes
    assert covered.min() == covered.max() == 1 and [p.index for p in parts] == list(range(len(parts)))
    loads = shard_loads_bytes(parts, shards)
    for shard in range(shards):
        owned = sum(1 for p in parts if p.shard == shard)
        assert owned >= min(per_shard, -(-loads[shard] // finest), loads[shard] // 4)
        if balance != "bytes" and owned > -(-loads[shard] // partition_bytes):  # cut finer for per_shard only
            assert owned <= -(-loads[shard] // finest)
    one = shard_loads_bytes(plan_partitions(numel, shards, workers, partition_bytes, balance,
                                            finest_bytes=finest), shards)
    if balance == "egress":
        assert loads == one
    elif balance == "bytes":
        assert max(loads) - min(loads) <= max(p.nbytes for p in parts) + 4 * shards  # pieces differ by an element
    else:  # the coordinator's range gets more pieces, so its pushes are in sooner: its share grows
        assert loads[0] >= one[0] - 4 * shards
    with pytest.raises(ValueError, match="per_shard"):
        plan_partitions(numel, shards, workers, partition_bytes, balance, 0)


def test_fixed_lossy_ratio_is_the_codecs_own_size_and_none_without_a_fixed_lossy_codec():
    """`fixed_lossy_ratio`: what the codec's payload takes (lloyd2 2 bits a value + a float32 scale per
    256: about 15x; int3 and lloyd3 3 bits: 10.24x; int3z, int3's codes entropy-coded, on the standard normal
    values the ratio is measured on: about 14x; int8 about 3.9x; top-k 1 % an index and a value per kept
    entry: about 50x); None where the bytes on the wire are not known ahead (lossless, seed,
    network-aware) or the name is bad."""
    assert 14.5 < fixed_lossy_ratio("fixed:lloyd2", 65536) < 15.5
    assert 3.8 < fixed_lossy_ratio("fixed:int8", 65536) < 4.0
    assert fixed_lossy_ratio("fixed:int3", 65536) == fixed_lossy_ratio("fixed:lloyd3", 65536) == 32 / (3 + 32 / 256)
    assert 13 < fixed_lossy_ratio("fixed:int3z", 65536) < 15  # entropy-coded: about 2.2 bits a Gaussian value
    assert 45 < fixed_lossy_ratio("fixed:topk-0.01", 65536) < 55
    for name in ("none", "fixed:zstd-1", "seed", "network-aware", "fixed:nope"):
        assert fixed_lossy_ratio(name, 65536) is None, name
    assert fixed_lossy_ratio("fixed:lloyd2", 0) is None


def test_finest_piece_is_64_kib_on_the_wire():
    """`finest_raw_bytes`: 64 KiB x a lossy codec's ratio, never below 64 KiB (no codec, or one that grows)."""
    assert finest_raw_bytes(None) == finest_raw_bytes(1.0) == finest_raw_bytes(0.5) == PER_SHARD_FINEST_BYTES
    assert finest_raw_bytes(15.0) == 15 * PER_SHARD_FINEST_BYTES


@pytest.mark.parametrize("workers", [4, 8])
def test_a_fixed_lossy_codec_cuts_the_shards_ranges_into_fewer_pieces(workers):
    """The coordinator's plan (`partition_finest_bytes` of the run's config): uncompressed, the digits
    model's 0.13-0.35 MB ranges are cut into 64 KiB pieces (2-8 per shard); under fixed:lloyd2 (about 15x,
    so a 16-23 KB piece on the wire) and fixed:int8 (3.9x) each shard keeps its range whole; the 26 MB
    model under lloyd2 still gets several pieces per shard (its ranges are 2.9-6.4 MB, 0.2-0.4 MB sent),
    fewer than uncompressed. network-aware may or may not compress: 64 KiB, as uncompressed."""
    shards = workers + 1

    def plan(numel, compression):
        cfg = RunConfig(num_workers=workers, ps_shards="all", compression=compression, partitions_per_shard=8)
        return plan_partitions(numel, shards, workers, cfg.partition_bytes, cfg.partition_balance,
                               cfg.partitions_per_shard, cfg.partition_placement, partition_finest_bytes(cfg))

    dense = plan(DIGITS_MLP_NUMEL, "none")
    assert len(plan(DIGITS_MLP_NUMEL, "network-aware")) == len(dense) >= 2 * shards
    for compression in ("fixed:lloyd2", "fixed:int8", "fixed:topk-0.01"):
        assert sorted(p.shard for p in plan(DIGITS_MLP_NUMEL, compression)) == list(range(shards)), compression
    big_dense, big_lloyd2 = plan(6_500_000, "none"), plan(6_500_000, "fixed:lloyd2")
    assert 2 * shards <= len(big_lloyd2) < len(big_dense)


def test_egress_weights_edge_cases():
    assert egress_shard_weights(2, 1) == [1.0, 1.0]  # one worker: every split sends the same
    assert len(egress_shard_weights(1, 4)) == 1  # one shard: its weight means nothing
    assert egress_shard_weights(3, 4) == [4 / 3, 1.0, 1.0]  # ps_shards 3 of 5 nodes
    with pytest.raises(ValueError):
        egress_shard_weights(0, 4)


def test_the_digits_model_spreads_over_every_shard():
    parts = partition_flat(DIGITS_MLP_NUMEL, 5, 4 * MIB)  # 1.2 MB < 4 MiB: still one partition per shard
    assert len(parts) == 5 and sorted(p.shard for p in parts) == [0, 1, 2, 3, 4]
    big = partition_flat(6_500_000, 5, 4 * MIB)  # 26 MB: big tensors split into 4 MiB pieces
    assert len(big) == 7 and all(p.nbytes <= 4 * MIB for p in big)


def test_resolve_shards():
    assert resolve_shards("all", 5) == 5 and resolve_shards("1", 5) == 1 and resolve_shards(3, 5) == 3
    for bad in ("0", "6", "many", True):
        with pytest.raises(ConfigError, match="ps_shards"):
            resolve_shards(bad, 5)


@pytest.mark.parametrize("codec", ["fixed:int8", "fixed:int4", "fixed:int3", "fixed:int3z", "fixed:int2",
                                   "fixed:lloyd2", "fixed:lloyd3", "fixed:topk-0.05", "fixed:fp16", "fixed:bf16",
                                   "fixed:none", "fixed:zstd-1"])
def test_error_feedback_sent_plus_residual_is_the_sum_of_inputs(codec):
    rng = np.random.default_rng(1)
    policy = CompressionPolicy(codec)
    feedback = ErrorFeedback("push")
    inputs_sum = np.zeros(5000, dtype=np.float64)
    sent_sum = np.zeros(5000, dtype=np.float64)
    for step in range(12):
        g = rng.standard_normal(5000).astype(np.float32) * (1 + step)
        inputs_sum += g
        frame, sent = feedback.encode(policy, {"step": step}, "p0", g, dense=step < 2)
        assert np.array_equal(decoded_values(frame, "p0", 5000), sent)  # what the receiver decodes
        sent_sum += sent
    residual = feedback.residual("p0")
    total = sent_sum + (residual if residual is not None else 0)
    assert np.allclose(total, inputs_sum, rtol=0, atol=1e-3)
    if codec in ("fixed:none", "fixed:zstd-1"):
        assert residual is None
    else:
        assert residual is not None and np.abs(residual).max() > 0


def test_topk_error_feedback_is_counted_once():
    """Top-k keeps its own residual in the codec; with the feedback's it would send the error twice."""
    policy = CompressionPolicy("fixed:topk-0.1")
    feedback = ErrorFeedback("push")
    g = np.arange(100, dtype=np.float32)
    sent_total = np.zeros(100)
    for step in range(30):
        _, sent = feedback.encode(policy, {}, "p0", g if step == 0 else np.zeros(100, np.float32), dense=False)
        sent_total += sent
    assert np.allclose(sent_total, g)  # all of g arrived, once, and nothing more
    assert feedback.residual("p0") is None or not np.any(feedback.residual("p0"))


@pytest.mark.parametrize("codec", ["fixed:int8", "fixed:topk-0.01", "fixed:fp16"])
def test_delta_pulls_keep_the_workers_copy_on_the_shards_parameters(codec):
    """A worker applying every pull (absolute or delta) holds the replica exactly; the gap to the
    shard's parameters is what the lossy codec still owes, and it does not grow over the steps."""
    rng = np.random.default_rng(2)
    params = rng.standard_normal(20_000).astype(np.float32)
    replica = PullReplica(params)
    policy = CompressionPolicy(codec)
    worker = params.copy()
    gaps = []
    for step in range(40):
        params = params - 0.01 * rng.standard_normal(params.size).astype(np.float32)
        frame = replica.frame_for(policy, {"step": step}, "p0", params, dense=step < 3)
        values = decoded_values(frame, "p0", params.size)
        delta = frame.buffers[0].find(b'"delta":true') >= 0
        worker = worker + values if delta else values.copy()
        assert np.array_equal(worker, replica.replica)
        gaps.append(replica.max_abs_gap(params))
    assert gaps[2] == 0.0  # dense steps are exact
    assert max(gaps[20:]) < 5 * max(gaps[3:20]) + 1e-6  # bounded: the error is fed back, not accumulated


@pytest.mark.parametrize("codec", ["fixed:shuffle-zstd", "fixed:zstd-1"])
def test_lossless_delta_pulls_are_exact_and_smaller_than_the_parameters(codec):
    """With a lossless codec the pulls go as deltas from the first step: the worker's copy is the
    replica bit for bit and within float rounding of the shard's parameters, and an SGD step's delta
    (parameters of the digits MLP's scale, lr 0.1) takes fewer bytes than the parameters themselves."""
    rng = np.random.default_rng(3)
    params = (rng.standard_normal(20_000) * 0.05).astype(np.float32)
    replica = PullReplica(params)
    policy = CompressionPolicy(codec)
    worker = params.copy()
    for step in range(20):
        params = params - (0.1 * 0.01 * rng.standard_normal(params.size)).astype(np.float32)
        frame = replica.frame_for(policy, {"step": step}, "p0", params, dense=False)
        assert frame.buffers[0].find(b'"delta":true') >= 0
        worker = worker + decoded_values(frame, "p0", params.size)
        assert np.array_equal(worker, replica.replica)
        np.testing.assert_allclose(worker, params, rtol=1e-6, atol=1e-9)
        absolute = policy.encode("ps_dense", {"step": step}, [WireTensor("p0", params.copy())])
        assert frame.payload_nbytes < absolute.payload_nbytes


def test_pulls_are_deltas_whenever_the_policy_compresses():
    assert not pulls_as_deltas(RunConfig(compression="fixed:none"))
    assert pulls_as_deltas(RunConfig(compression="fixed:shuffle-zstd"))
    assert pulls_as_deltas(RunConfig(compression="network-aware"))
    assert pulls_as_deltas(RunConfig(compression="fixed:int8"))


def test_policy_may_be_lossy():
    assert policy_may_be_lossy(RunConfig(compression="fixed:int8"))
    assert not policy_may_be_lossy(RunConfig(compression="fixed:zstd-1"))
    assert not policy_may_be_lossy(RunConfig(compression="network-aware"))
    assert policy_may_be_lossy(RunConfig(compression="network-aware+lossy"))


def test_params_digest_tells_close_from_different():
    flat = FlatParams(build_mlp(64, [32], 10, seed=0)).params.numpy().copy()
    a, b = params_digest(flat), params_digest(flat + 1e-7)
    c = params_digest(flat * 1.01)
    assert a["sha256"] != b["sha256"] and np.allclose(a["projections"], b["projections"], atol=1e-3)
    assert not np.allclose(a["projections"], c["projections"], atol=1e-3)


# --- a shard and its clients in this process, on loopback -------------------------------------------
SECRET = b"ps-unit-tests-secret-0123456789abcdef"


def _node(cfg: RunConfig, role: str, name: str):
    from wiiide.log import TieredLog
    from wiiide.metrics import NodeMetrics

    return NodeMetrics(role, name), TieredLog(cfg, name)


def _worker_clients(cfg: RunConfig, port: int, models, flats, parts, clients: list) -> list:
    """Connect one worker client per model (ranks 1..) to the shard at 127.0.0.1:port, hooks attached;
    each is appended to `clients` as it is made (so the caller closes those made before a failure)."""
    from wiiide.server.ps.client import ShardClient
    from wiiide.server.ps.shard import ROLE_WORKER

    for rank, (model, flat) in enumerate(zip(models, flats), start=1):
        m, lg = _node(cfg, "worker", f"w{rank}")
        client = ShardClient(cfg, SECRET, m, lg, [("127.0.0.1", port, "")], ROLE_WORKER, rank, f"w{rank}")
        client.attach(model, flat, parts, lossy=False)
        clients.append(client)
    return clients


@pytest.mark.parametrize("push_schedule", ["concurrent", "ordered"])
def test_a_shard_averages_pushes_steps_its_optimizer_slice_and_answers_every_worker(push_schedule):
    import torch

    from wiiide.training.model import MomentumSGD
    from wiiide.server.ps.shard import ShardServer

    cfg = RunConfig(num_workers=2, log_tier="silent", learning_rate=0.1, momentum=0.9, io_timeout_s=5,
                    connect_timeout_s=5, push_schedule=push_schedule)
    metrics, log = _node(cfg, "coordinator", "shard0")
    models = [build_mlp(8, [4], 3, seed=0) for _ in range(2)]
    flats = [FlatParams(m) for m in models]
    parts = partition_flat(flats[0].numel, 1, 64)  # several partitions, all on shard 0
    assert len(parts) > 2
    server = ShardServer(cfg, SECRET, metrics, log, 0)
    port = server.listen()
    server.configure(parts, flats[0].params.numpy().copy(), lossy_pulls=False)
    server.start()
    reference = build_mlp(8, [4], 3, seed=0)
    ref_flat = FlatParams(reference)
    ref_opt = MomentumSGD(reference.parameters(), lr=0.1, momentum=0.9)
    clients = []
    try:
        _worker_clients(cfg, port, models, flats, parts, clients)
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(5))
        y = torch.tensor([0, 1, 2, 0, 1, 2])
        for step in range(3):
            grads = []
            for i, (model, flat, client) in enumerate(zip(models, flats, clients)):
                flat.grads.zero_()
                client.begin_step(step)
                torch.nn.functional.cross_entropy(model(x[i * 3:(i + 1) * 3]), y[i * 3:(i + 1) * 3]).backward()
                grads.append(flat.grads.clone())
            for client in clients:
                client.finish_step(step)
            ref_flat.grads.copy_(grads[0] + grads[1]).div_(2)  # the central server's average and step
            ref_opt.step()
            for flat in flats:
                assert torch.equal(flat.params, ref_flat.params)
        assert server.updates == 3 * len(parts) and server.failure is None
    finally:
        for client in clients:
            client.close()
        server.close()


@pytest.mark.parametrize("codec", ["none", "zstd-1", "int8", "int2", "lloyd2", "fp16", "topk-0.5"])
def test_received_values_outlive_the_readers_buffer_and_lossy_ones_are_not_copied_again(codec):
    from wiiide.codecs.registry import codec_from_name
    from wiiide.wire.decode import decode_payload, parse_header
    from wiiide.wire.encode import encode_message

    g = np.linspace(-1, 1, 1000, dtype=np.float32)
    frame = encode_message("gradients", {"step": 0}, [WireTensor("p0", g)], codec_from_name(codec))
    wire = bytearray(b"".join(bytes(memoryview(b)) for b in frame.buffers))  # the reader's reused buffer
    head = int.from_bytes(wire[4:8], "big")
    msg = decode_payload(parse_header(bytes(wire[16:16 + head]), 1 << 20), memoryview(wire)[16 + head:])
    values = received_values(msg)
    assert values.shape == (1000,) and values.dtype == np.float32 and values.flags.writeable
    before = values.copy()
    wire[16 + head:] = bytes(len(wire) - 16 - head)  # the next frame lands in the same buffer
    assert np.array_equal(values, before)
    lossy = codec not in ("none", "zstd-1")
    assert np.shares_memory(values, msg.tensors[0].array) == lossy


def test_ordered_pushes_are_encoded_while_an_earlier_push_is_still_being_sent():
    """push_schedule ordered: the encoder runs ahead of the sender, so the link does not wait for the next
    push's error feedback and codec once a send returns. With the first push's send held, every later push
    of the step is encoded and waiting; released, the step completes with the same parameters."""
    import threading

    import torch

    from wiiide.server.ps.shard import ShardServer

    cfg = RunConfig(num_workers=1, log_tier="silent", learning_rate=0.1, io_timeout_s=5, connect_timeout_s=5,
                    push_schedule="ordered", compression="fixed:int8", lossy_warmup_steps=0)
    metrics, log = _node(cfg, "coordinator", "shard0")
    model = build_mlp(8, [16], 3, seed=0)
    flat = FlatParams(model)
    parts = partition_flat(flat.numel, 1, 64)
    assert len(parts) > 3
    server = ShardServer(cfg, SECRET, metrics, log, 0)
    port = server.listen()
    server.configure(parts, flat.params.numpy().copy(), lossy_pulls=True)
    server.start()
    clients = []
    try:
        _worker_clients(cfg, port, [model], [flat], parts, clients)
        client = clients[0]
        client._lossy = True
        conn = client.links[0].conn
        held, release, sent = threading.Event(), threading.Event(), []
        real_send = conn.send

        def held_send(frames):
            if not sent:
                held.set()
                assert release.wait(10)
            sent.append(frames[0].codec)
            return real_send(frames)

        conn.send = held_send
        client.begin_step(0)
        x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 0])
        torch.nn.functional.cross_entropy(model(x), y).backward()
        assert held.wait(10)
        deadline = time.monotonic() + 10
        while client._encoded.qsize() < len(parts) - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client._encoded.qsize() == len(parts) - 1 and sent == []  # all encoded, none sent yet
        release.set()
        client.finish_step(0)
        assert sent == ["int8"] * len(parts) and server.updates == len(parts) and server.failure is None
    finally:
        for client in clients:
            client.close()
        server.close()


class _Arrived:
    """What `CompressionPolicy.observe_received` reads of a received message: `nbytes` at `rate_bps`."""

    def __init__(self, nbytes: int, rate_bps: float) -> None:
        self.payload_nbytes, self.payload_recv_s, self.payload_queued_nbytes = nbytes, 8 * nbytes / rate_bps, 0
        self.meta = {}


def test_a_push_reports_the_rate_its_shards_pulls_arrived_at_with_network_aware_only():
    from wiiide.codecs.policy import FEEDBACK_META_KEY
    from wiiide.server.ps.client import push_meta

    base = dict(ps_shards="all", partition_bytes=64 * 1024)
    aware = CompressionPolicy.from_config(RunConfig(compression="network-aware", **base))
    fixed = CompressionPolicy.from_config(RunConfig(compression="fixed:shuffle-zstd", **base))
    configured = CompressionPolicy.from_config(RunConfig(compression="network-aware", link_bandwidth_bps=1e8, **base))
    try:
        assert push_meta(aware, 4, 7) == {"step": 4, "partition": 7}  # nothing arrived yet
        for policy in (aware, fixed, configured):
            for _ in range(3):  # pulls of a 64 KiB partition at 100 Mbit/s
                policy.observe_received(_Arrived(64 * 1024, 100e6))
        assert push_meta(aware, 4, 7) == {"step": 4, "partition": 7, FEEDBACK_META_KEY: pytest.approx(100e6, rel=1e-6)}
        assert push_meta(fixed, 4, 7) == push_meta(configured, 4, 7) == {"step": 4, "partition": 7}
    finally:
        for policy in (aware, fixed, configured):
            policy.close()


def test_a_shards_pull_tells_each_worker_the_rate_of_its_own_pushes():
    """The shard encodes a pull once for every worker; with network-aware each worker's copy carries the
    rate that worker's pushes arrived at (its uplink to this shard), and the payload is shared."""
    from wiiide.codecs.policy import FEEDBACK_META_KEY
    from wiiide.server.ps.shard import ShardServer

    cfg = RunConfig(num_workers=3, log_tier="silent", compression="network-aware", ps_shards="all",
                    partition_bytes=64 * 1024)
    metrics, log = _node(cfg, "coordinator", "shard0")
    server = ShardServer(cfg, SECRET, metrics, log, 0)
    try:
        for rank, rate in ((1, 50e6), (2, 400e6)):
            for _ in range(3):
                server.policy.observe_received(_Arrived(64 * 1024, rate), ("worker", rank))
        frame = server.policy.encode("ps_dense", {"step": 0, "partition": 0},
                                     [WireTensor("p0", np.ones(16384, dtype=np.float32))])
        to = {rank: server._to_worker(frame, rank) for rank in (1, 2, 3)}
        assert to[1].header["meta"][FEEDBACK_META_KEY] == pytest.approx(50e6, rel=1e-6)
        assert to[2].header["meta"][FEEDBACK_META_KEY] == pytest.approx(400e6, rel=1e-6)
        assert to[3] is frame  # nothing measured from worker 3 yet: nothing to tell it
        assert to[1].buffers[1] is frame.buffers[1]
        server.policy.observe_received(_Arrived(64 * 1024, 1e6), ("worker", 3))
        server.policy.mode = "fixed"  # a fixed codec never reads the reports: the pull goes as encoded
        assert server._to_worker(frame, 3) is frame
    finally:
        server.close()


def test_a_shard_refuses_a_peer_without_the_secret():
    from wiiide.server.ps.client import ShardFailed, connect_shard
    from wiiide.server.ps.shard import ROLE_WORKER, ShardServer

    cfg = RunConfig(num_workers=1, log_tier="silent", handshake_timeout_s=2, connect_timeout_s=2)
    metrics, log = _node(cfg, "worker", "shard1")
    server = ShardServer(cfg, SECRET, metrics, log, 1)
    port = server.listen()
    server.configure(partition_flat(100, 2, 64), np.zeros(100, np.float32), lossy_pulls=False)
    server.start()
    try:
        m, lg = _node(cfg, "worker", "intruder")
        with pytest.raises(ShardFailed, match="handshake with shard 1"):
            connect_shard(cfg, b"not-the-secret", m, lg, "127.0.0.1", port, 1, ROLE_WORKER, 1, "intruder")
        deadline = time.monotonic() + 5  # the shard tells the peer (a ``refused`` frame), then records the event
        while metrics.event_counts.get("shard_connection_refused") != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert metrics.event_counts.get("shard_connection_refused") == 1
        with pytest.raises(ShardFailed, match="shard 2's welcome|handshake"):  # a shard must prove its id too
            connect_shard(cfg, SECRET, m, lg, "127.0.0.1", port, 2, ROLE_WORKER, 1, "w1")
    finally:
        server.close()


def test_a_worker_keeps_its_first_shard_connections_alive_while_a_later_shard_comes_up():
    """The coordinator sends the plans one after the other, and a shard starts answering only once its
    node has its plan: a worker connecting to every shard in turn may wait on one for longer than
    io_timeout_s. The connections made before it get heartbeats meanwhile, so their shards do not
    count the worker as lost (at 8 workers with the 26 MB model they did, 16 s into the plans)."""
    import threading

    from wiiide.server.ps.client import ShardClient
    from wiiide.server.ps.shard import ROLE_WORKER, ShardServer

    cfg = RunConfig(num_workers=1, log_tier="silent", io_timeout_s=0.5, heartbeat_interval_s=0.1,
                    connect_timeout_s=10, handshake_timeout_s=0.5)
    model = build_mlp(8, [4], 3, seed=0)
    flat = FlatParams(model)
    parts = partition_flat(flat.numel, 2, 64)
    servers = [ShardServer(cfg, SECRET, *_node(cfg, "coordinator" if s == 0 else "worker", f"s{s}"), s)
               for s in range(2)]
    ports = [server.listen() for server in servers]
    for server in servers:
        server.configure(parts, flat.params.numpy().copy(), lossy_pulls=False)
    servers[0].start()
    late = threading.Timer(2.0, servers[1].start)  # four io_timeout_s after the first connection
    late.start()
    client = None
    try:
        m, lg = _node(cfg, "worker", "w1")
        client = ShardClient(cfg, SECRET, m, lg, [("127.0.0.1", p, "") for p in ports], ROLE_WORKER, 1, "w1")
        assert len(client.links) == 2
        assert servers[0].failure is None and servers[1].failure is None, (servers[0].failure, servers[1].failure)
    finally:
        late.join()
        if client is not None:
            client.close()
        for server in servers:
            server.close()


def test_a_workers_reported_compute_seconds_are_kept_only_when_finite_and_not_negative():
    """``step_done``'s ``compute_s`` comes from the network: anything but a finite number >= 0 (a bool, a
    string, NaN, inf, a negative) is left out of ``compute_max_s`` instead of failing the step."""
    assert _seconds(0.25) == 0.25 and _seconds(0) == 0.0
    for bad in (None, True, "0.2", float("nan"), float("inf"), -0.1, [0.2]):
        assert _seconds(bad) is None


class _RecordingConn:
    """A connection that keeps what it is sent and fails on the frame it is told to."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.sent: list = []
        self.fail_on = fail_on

    def send(self, frames) -> None:
        if frames[0].kind == self.fail_on:
            raise OSError("link down")
        self.sent.extend(frames)


def test_drain_outbox_reports_each_sent_frame_and_its_send_cpu_by_step():
    import queue

    from wiiide.server.pace.feedback import DENSE_KIND
    from wiiide.server.ps.outbox import drain_outbox, frame_step
    from wiiide.wire.encode import encode_message

    push = encode_message(DENSE_KIND, {"step": 7, "partition": 2}, [WireTensor("p2", np.ones(4, np.float32))])
    bye = encode_message("bye", {"step": 9})
    outbox = queue.Queue()
    for item in (push, bye, None):
        outbox.put(item)
    conn, sent, errors = _RecordingConn(), [], []
    drain_outbox(outbox, conn, lambda frame: frame, errors.append, lambda frame, cpu_s: sent.append((frame, cpu_s)))
    assert conn.sent == [push, bye] and errors == []
    assert [frame for frame, _ in sent] == [push, bye] and all(cpu_s >= 0.0 for _, cpu_s in sent)
    assert [frame_step(frame) for frame, _ in sent] == [7, None]  # only a push or pull carries a step's stage

    outbox = queue.Queue()
    for item in (push, push, None):
        outbox.put(item)
    sent.clear()
    drain_outbox(outbox, _RecordingConn(fail_on=DENSE_KIND), lambda frame: frame, errors.append,
                 lambda frame, cpu_s: sent.append(frame))
    assert sent == [] and len(errors) == 1 and "link down" in str(errors[0])  # the first error ends the loop
