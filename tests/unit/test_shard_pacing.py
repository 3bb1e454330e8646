"""A shard's pacing on loopback (`wiiide.server.ps.shard`): pushes applied as they arrive under a staleness
bound or async (scaled by staleness, answered to the pushing worker only), and pushes weighted by
their samples in rounds of adaptive batches."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_ps import SECRET, _node, _worker_clients
from wiiide.config import RunConfig
from wiiide.training.model import FlatParams, build_mlp
from wiiide.server.ps.partition import partition_flat
from wiiide.server.ps.shard import ShardServer

LR = 0.1


def _shard(cfg, flat):
    parts = partition_flat(flat.numel, 1, 64)  # several partitions, all on shard 0
    server = ShardServer(cfg, SECRET, *_node(cfg, "coordinator", "shard0"), 0)
    port = server.listen()
    server.configure(parts, flat.params.numpy().copy(), lossy_pulls=False)
    server.start()
    return server, port, parts


def _grad(model, flat, x, y):
    flat.grads.zero_()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return flat.grads.clone()


BATCH_X = torch.randn(6, 8, generator=torch.Generator().manual_seed(5))
BATCH_Y = torch.tensor([0, 1, 2, 0, 1, 2])


@pytest.mark.parametrize("bound", [2, "async"])
def test_a_paced_shard_applies_each_push_on_arrival_scaled_by_its_staleness(bound):
    cfg = RunConfig(num_workers=2, log_tier="silent", learning_rate=LR, momentum=0.0, io_timeout_s=5,
                    connect_timeout_s=5, staleness_bound=bound, staleness_scaling="inverse")
    models = [build_mlp(8, [4], 3, seed=0) for _ in range(2)]
    flats = [FlatParams(m) for m in models]
    start = flats[0].params.clone()
    server, port, parts = _shard(cfg, flats[0])
    clients: list = []
    try:
        _worker_clients(cfg, port, models, flats, parts, clients)
        # worker 1 pushes and gets its pull back without worker 2 having pushed at all
        clients[0].begin_step(0)
        g1 = _grad(models[0], flats[0], BATCH_X[:3], BATCH_Y[:3])
        clients[0].finish_step(0)
        after_1 = start - LR * g1
        assert torch.allclose(flats[0].params, after_1, atol=1e-7) and clients[0].staleness == 0
        # worker 2 computed on the start: one update stale, so its push counts 1 / (1 + 1)
        clients[1].begin_step(0)
        g2 = _grad(models[1], flats[1], BATCH_X[3:], BATCH_Y[3:])
        clients[1].finish_step(0)
        assert clients[1].staleness == 1
        assert torch.allclose(flats[1].params, after_1 - LR * 0.5 * g2, atol=1e-7)
        assert torch.allclose(flats[0].params, after_1, atol=1e-7)  # worker 1 was not sent worker 2's update
        assert server.updates == 2 * len(parts) and server.failure is None
    finally:
        for client in clients:
            client.close()
        server.close()


def test_a_shard_in_rounds_of_adaptive_batches_weights_the_pushes_by_samples():
    cfg = RunConfig(num_workers=2, log_tier="silent", learning_rate=LR, momentum=0.0, io_timeout_s=5,
                    connect_timeout_s=5, adaptive_batch=True)
    models = [build_mlp(8, [4], 3, seed=0) for _ in range(2)]
    flats = [FlatParams(m) for m in models]
    start = flats[0].params.clone()
    server, port, parts = _shard(cfg, flats[0])
    clients: list = []
    try:
        _worker_clients(cfg, port, models, flats, parts, clients)
        grads = []
        for (model, flat, client), (lo, hi) in zip(zip(models, flats, clients), [(0, 1), (1, 6)]):
            client.begin_step(0, samples=hi - lo)  # batches of 1 and 5 samples
            grads.append(_grad(model, flat, BATCH_X[lo:hi], BATCH_Y[lo:hi]))
        for client in clients:
            client.finish_step(0)
        expected = start - LR * (1 * grads[0] + 5 * grads[1]) / 6  # the gradient of the 6 samples together
        for flat in flats:
            assert torch.allclose(flat.params, expected, atol=1e-7)
        assert not torch.allclose(expected, start - LR * (grads[0] + grads[1]) / 2, atol=1e-5)
    finally:
        for client in clients:
            client.close()
        server.close()
