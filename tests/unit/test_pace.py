"""wiiide.server.pace: the SSP rule, delta averaging and the outer step, gradient accumulation, adaptive batch sizes."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

from wiiide.config import ConfigError, RunConfig
from wiiide.training.model import FlatParams, MomentumSGD, build_mlp
from wiiide.server.pace.adaptive import AdaptiveBatch, split_exact
from wiiide.server.pace.outer import OuterOptimizer, PartitionOuterStep, gradient, local_delta
from wiiide.server.pace.server import uses_pace
from wiiide.server.pace.staleness import SSPClock, staleness_scale


# --- the staleness rule --------------------------------------------------------------------------
@pytest.mark.parametrize("bound", [0, 1, 2, 5])
def test_a_worker_blocks_exactly_when_more_than_s_ahead(bound):
    clock = SSPClock(bound)
    for rank in (1, 2, 3):
        clock.join(rank)
    for pushes in range(bound + 3):
        assert clock.ahead(1) == pushes
        assert clock.may_proceed(1) is (pushes <= bound), pushes
        clock.tick(1)
    assert clock.may_proceed(2) and clock.may_proceed(3)  # the slow ones never block
    clock.tick(2)
    assert not clock.may_proceed(1)  # worker 3 is still the slowest
    clock.tick(3)
    assert clock.ahead(1) == bound + 2 and clock.may_proceed(1) is (bound + 2 <= bound)


def test_async_never_blocks_and_the_gap_is_measured():
    clock = SSPClock("async")
    clock.join(1)
    clock.join(2)
    for _ in range(100):
        clock.tick(1)
    assert clock.may_proceed(1) and clock.gap() == 100 and clock.slowest() == 0 and clock.fastest() == 100


def test_leaving_unblocks_and_joining_starts_at_the_slowest():
    clock = SSPClock(1)
    for rank in (1, 2, 3):
        clock.join(rank)
    for _ in range(3):
        clock.tick(1)
    clock.tick(3)
    assert not clock.may_proceed(1)  # 3 ahead of worker 2
    clock.leave(2)  # the slowest is lost: worker 3 (clock 1) is now the slowest
    assert clock.slowest() == 1 and not clock.may_proceed(1)
    clock.tick(3)
    assert clock.may_proceed(1)
    assert clock.join(2) == 2  # back at the slowest live clock, not at its old 0
    assert clock.may_proceed(2) and clock.gap() == 1
    clock.join(4)  # a new worker: also at the slowest
    assert clock.clocks[4] == 2
    with pytest.raises(ValueError, match="never joined"):
        clock.tick(9)
    with pytest.raises(ValueError):
        SSPClock(-1)


def test_a_cached_copy_serves_until_it_lacks_pushes_the_bound_requires():
    clock = SSPClock(2)
    for rank in (1, 2):
        clock.join(rank)
    slowest_when_read = clock.slowest()  # worker 1 reads the parameters at clocks (0, 0)
    for pushes in range(1, 4):  # worker 1 pushes; worker 2 is still at clock 0
        clock.tick(1)
        # at clock c worker 1 must see every worker's first c - 2 pushes: the copy read at 0 holds none
        assert clock.copy_is_fresh(1, slowest_when_read) is (pushes <= 2), pushes
    clock.tick(2)  # worker 2's first push: parameters read now hold one push of everyone
    assert clock.copy_is_fresh(1, clock.slowest())
    free = SSPClock("async")
    free.join(1)
    assert not free.copy_is_fresh(1, 0)  # no bound: nothing to measure a copy by, always fresh parameters
    with pytest.raises(ValueError, match="never joined"):
        clock.copy_is_fresh(7, 0)


def test_staleness_scaling():
    assert [staleness_scale(k, "none") for k in (0, 3)] == [1.0, 1.0]
    assert [staleness_scale(k, "inverse") for k in (0, 1, 3)] == [1.0, 0.5, 0.25]
    with pytest.raises(ValueError):
        staleness_scale(-1, "inverse")


# --- local SGD and the outer step ----------------------------------------------------------------
def _batches(n: int, rows: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 8, generator=g), torch.randint(0, 3, (rows,), generator=g)) for _ in range(n)]


def _model() -> tuple[nn.Module, FlatParams]:
    model = build_mlp(8, (16,), 3, seed=1)
    return model, FlatParams(model)


def test_h1_plain_averaging_equals_synchronous_sgd():
    lr, batches = 0.1, _batches(4, 10)
    sync_model, sync_flat = _model()
    optimizer = MomentumSGD(sync_model.parameters(), lr=lr)
    server_model, server_flat = _model()
    worker_model, worker_flat = _model()
    outer = OuterOptimizer(server_flat, "avg")
    for _ in range(3):  # three rounds of four workers
        grads = []
        for x, y in batches:
            gradient(sync_model, sync_flat, x, y)
            grads.append(sync_flat.grads.clone())
        sync_flat.grads.copy_(torch.stack(grads).mean(0))
        optimizer.step()
        deltas = []
        for x, y in batches:
            worker_flat.load(server_flat.params)
            delta, _ = local_delta(worker_model, worker_flat, x, y, local_steps=1, lr=lr)
            deltas.append(delta)
        outer.step(torch.stack(deltas).mean(0))
    torch.testing.assert_close(server_flat.params, sync_flat.params, rtol=1e-5, atol=1e-6)
    assert not torch.equal(server_flat.params, _model()[1].params)  # it did move


def test_local_steps_match_torch_sgd_on_the_pieces():
    model, flat = _model()
    reference = copy.deepcopy(model)
    x, y = _batches(1, 12)[0]
    delta, loss = local_delta(model, flat, x, y, local_steps=3, lr=0.05)
    opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    start = torch.cat([p.detach().flatten() for p in reference.parameters()])
    for xs, ys in zip(x.split(4), y.split(4)):
        opt.zero_grad()
        nn.functional.cross_entropy(reference(xs), ys).backward()
        opt.step()
    after = torch.cat([p.detach().flatten() for p in reference.parameters()])
    torch.testing.assert_close(flat.params, after, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(delta, start - after, rtol=1e-5, atol=1e-6)
    assert 0 < loss < 5
    with pytest.raises(ValueError, match="local_steps"):
        local_delta(model, flat, x, y, local_steps=13, lr=0.05)


def test_nesterov_outer_step_is_torch_sgd_nesterov_on_the_pseudo_gradient():
    _, flat = _model()
    start = flat.params.clone()
    outer = OuterOptimizer(flat, "nesterov", lr=0.7, momentum=0.9)
    param = nn.Parameter(start.clone())
    ref = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        delta = torch.randn(flat.numel, generator=g) * 0.01
        outer.step(delta)
        param.grad = delta.clone()
        ref.step()
    torch.testing.assert_close(flat.params, param.detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        outer.step(torch.zeros(3))
    with pytest.raises(ValueError):
        OuterOptimizer(flat, "adam")  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["avg", "nesterov"])
def test_partition_outer_steps_move_the_slices_as_the_whole_vector_moves(kind):
    """A sharded server's shards step their slices one by one (odd sizes, off any vector alignment): the
    same float32 values as the central server's outer step over the whole vector."""
    _, flat = _model()
    start = flat.params.clone()
    whole = OuterOptimizer(flat, kind, lr=0.7, momentum=0.9)
    bounds = [0, 7, 1000, 1001, flat.numel]
    slices = [start[a:b].clone() for a, b in zip(bounds, bounds[1:])]
    steps = []
    for values in slices:
        values.grad = torch.zeros_like(values)
        steps.append(PartitionOuterStep(values, kind, 0.7, 0.9))
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        delta = torch.randn(flat.numel, generator=g) * 0.01
        whole.step(delta)
        for (a, b), values, step in zip(zip(bounds, bounds[1:]), slices, steps):
            values.grad.copy_(delta[a:b])
            step.lr = 0.05  # a shard sets the inner rate: the outer step keeps its own
            step.step()
    assert torch.equal(torch.cat(slices), flat.params)
    assert not torch.equal(flat.params, start)


def test_micro_batches_give_the_full_batch_gradient():
    model, flat = _model()
    x, y = _batches(1, 10)[0]
    loss_full = gradient(model, flat, x, y, micro_batches=1)
    full = flat.grads.clone()
    loss_micro = gradient(model, flat, x, y, micro_batches=3)  # 4 + 3 + 3 rows
    torch.testing.assert_close(flat.grads, full, rtol=1e-5, atol=1e-7)
    assert loss_micro == pytest.approx(loss_full, rel=1e-6)
    assert [p.grad.data_ptr() for p in model.parameters()][0] == flat.grads.data_ptr()  # still the flat views


# --- adaptive batch sizes ------------------------------------------------------------------------
def test_split_exact_keeps_the_sum_and_the_proportions():
    assert split_exact(128, {1: 4.0, 2: 2.0, 3: 1.0, 4: 1.0}) == {1: 64, 2: 32, 3: 16, 4: 16}
    assert split_exact(10, {1: 1.0, 2: 1.0, 3: 1.0}) == {1: 4, 2: 3, 3: 3}  # largest remainder, ties to the lower rank
    assert split_exact(4, {1: 1000.0, 2: 1.0, 3: 0.0, 4: float("nan")}) == {1: 1, 2: 1, 3: 1, 4: 1}  # minimum 1 each
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 9)
        total = rng.randint(n, 5000)
        weights = {r: rng.uniform(0.01, 100.0) for r in range(1, n + 1)}
        sizes = split_exact(total, weights)
        assert sum(sizes.values()) == total and min(sizes.values()) >= 1
        for r, size in sizes.items():  # within one sample of the exact share (or at the minimum, 1)
            share = total * weights[r] / sum(weights.values())
            assert abs(size - share) < 1 or (size == 1 and share < 1), (size, share)
    with pytest.raises(ValueError):
        split_exact(2, {1: 1.0, 2: 1.0, 3: 1.0})
    with pytest.raises(ValueError):
        split_exact(2, {})


def test_adaptive_sizes_follow_the_measured_rates():
    adaptive = AdaptiveBatch(global_batch=128, smoothing=1.0)
    assert adaptive.sizes([1, 2, 3, 4]) == {1: 32, 2: 32, 3: 32, 4: 32}  # nothing measured: even
    for rank, seconds in ((1, 0.01), (2, 0.01), (3, 0.01), (4, 0.04)):  # worker 4 is 4x slower
        adaptive.observe(rank, 32, seconds)
    sizes = adaptive.sizes([1, 2, 3, 4])
    assert sizes == {1: 40, 2: 39, 3: 39, 4: 10}  # 128 x 4/13 = 39.4 (largest remainder to rank 1), 128/13 = 9.8
    assert sum(adaptive.sizes([1, 2, 3]).values()) == 128  # a worker lost: the global batch stays
    adaptive.observe(5, 10, 0.0)  # ignored: no time measured
    assert 5 not in adaptive.rates_samples_per_s
    smooth = AdaptiveBatch(global_batch=64, smoothing=0.5)
    smooth.observe(1, 100, 1.0)
    smooth.observe(1, 300, 1.0)
    assert smooth.rates_samples_per_s[1] == pytest.approx(200.0)


def test_adaptive_rate_is_time_weighted_for_a_throttled_worker():
    # A worker at a CPU quota: three fast tasks, then one stalled until the next period, over and over.
    # Its real rate is 1,024 samples per 99 ms; the mean of its per-task rates would be 3x that.
    adaptive = AdaptiveBatch(global_batch=1024, smoothing=1.0 / 8)
    for _ in range(40):
        for seconds in (0.006, 0.006, 0.006, 0.081):
            adaptive.observe(4, 256, seconds)
        for rank in (1, 2, 3):
            for _ in range(4):
                adaptive.observe(rank, 256, 0.099 / 4 / 2)  # twice worker 4's real rate
    rates = adaptive.rates_samples_per_s
    assert rates[4] == pytest.approx(1024 / 0.099, rel=0.25)
    assert rates[1] / rates[4] == pytest.approx(2.0, rel=0.25)
    sizes = adaptive.sizes([1, 2, 3, 4])
    assert 110 <= sizes[4] <= 180  # 1024 x 1/7 = 146; the mean of per-task rates gives it about 280


def test_adaptive_sizes_pull_a_worker_behind_on_the_clocks_back_level():
    adaptive = AdaptiveBatch(global_batch=1024, smoothing=1.0)
    for rank in (1, 2, 3, 4):
        adaptive.observe(rank, 256, 0.01)  # equal rates
    level = adaptive.sizes([1, 2, 3, 4], {1: 10, 2: 10, 3: 10, 4: 10})
    assert level == {1: 256, 2: 256, 3: 256, 4: 256}
    sizes = adaptive.sizes([1, 2, 3, 4], {1: 11, 2: 11, 3: 11, 4: 9})  # worker 4 two clocks behind
    assert sum(sizes.values()) == 1024
    assert sizes[4] < 256 < sizes[1] == sizes[2] == sizes[3]  # it gets less work and catches up
    far = adaptive.sizes([1, 2, 3, 4], {1: 100, 2: 100, 3: 100, 4: 0})  # the factor is clamped to 0.5..2
    assert far[4] == pytest.approx(far[1] / 4, abs=1)
    assert AdaptiveBatch(1024, 1.0, clock_gain=0).sizes([1, 2], {1: 5, 2: 0}) == {1: 512, 2: 512}
    with pytest.raises(ValueError):
        AdaptiveBatch(1024, clock_gain=-0.1)


def test_clock_feedback_keeps_a_bounded_run_off_its_bound():
    # Four workers under staleness bound 2, one at 0.45 of the others' speed, every task's time noisy
    # (lognormal, sigma 0.3): with rates alone the clock gap drifts to the bound and the fast workers
    # wait; the clock feedback keeps the gap small, so they wait less and do more samples.
    import heapq
    import random

    from wiiide.server.pace.staleness import SSPClock

    def simulate(clock_gain: float, seed: int) -> tuple[float, float]:
        rng, speeds = random.Random(seed), {1: 1000.0, 2: 1000.0, 3: 1000.0, 4: 450.0}  # samples/s
        clock, adaptive = SSPClock(2), AdaptiveBatch(1024, smoothing=0.1, clock_gain=clock_gain)
        for rank in speeds:
            clock.join(rank)
        events, busy, samples, gaps = [], set(), 0, []

        def dispatch(now: float) -> None:
            ready = [r for r in speeds if r not in busy and clock.may_proceed(r)]
            sizes = adaptive.sizes(list(speeds), clock.clocks) if ready else {}
            for r in ready:
                seconds = sizes[r] / speeds[r] * rng.lognormvariate(0.0, 0.3)
                busy.add(r)
                heapq.heappush(events, (now + seconds, r, sizes[r], seconds))

        dispatch(0.0)
        while events[0][0] < 60.0:
            now, rank, n, seconds = heapq.heappop(events)
            busy.discard(rank)
            clock.tick(rank)
            adaptive.observe(rank, n, seconds)
            samples += n
            gaps.append(clock.gap())
            dispatch(now)
        return samples / 60.0, sum(gaps) / len(gaps)

    for seed in range(3):
        (rate_off, gap_off), (rate_on, gap_on) = simulate(0.0, seed), simulate(0.25, seed)
        assert gap_on < gap_off
        assert rate_on > rate_off


def test_a_pushs_compute_seconds_are_checked_before_they_size_batches():
    from wiiide.errors import ProtocolError
    from wiiide.server.pace.reading import compute_seconds as _compute_seconds

    assert _compute_seconds({"step": 3}) is None  # an older worker: the server times the round trip
    assert _compute_seconds({"compute_s": 0.025}) == 0.025 and _compute_seconds({"compute_s": 0}) == 0.0
    for bad in ("0.02", float("nan"), float("inf"), -1.0, True, [1], {"s": 1}):
        with pytest.raises(ProtocolError, match="compute_s"):
            _compute_seconds({"compute_s": bad})


# --- the knobs -----------------------------------------------------------------------------------
def test_pace_knobs():
    assert not uses_pace(RunConfig())
    assert uses_pace(RunConfig(staleness_bound="async")) and uses_pace(RunConfig(staleness_bound="2"))
    assert uses_pace(RunConfig(local_steps=4)) and uses_pace(RunConfig(adaptive_batch=True))
    assert not uses_pace(RunConfig(grad_accum_steps=4))  # micro-batches alone: the synchronous loop
    assert RunConfig.from_env(RunConfig(staleness_bound="async").to_env()).staleness_bound == "async"
    RunConfig(engine="ddp", ddp_comm_hook="post_local_sgd", local_steps=8)
    for bad in (dict(staleness_bound=-1), dict(staleness_bound="sometimes"), dict(staleness_bound=True),
                dict(engine="ddp", staleness_bound=2), dict(engine="ddp", local_steps=4),
                dict(outer_optimizer="nesterov"), dict(staleness_scaling="inverse"),
                dict(batch_size=4, grad_accum_steps=8), dict(engine="ddp", adaptive_batch=True)):
        with pytest.raises(ConfigError):
            RunConfig(**bad)


def test_post_local_sgd_moves_a_parameter_all_reduce_every_h_steps():
    from wiiide.engines.comm import estimate

    shapes = [(16, 8), (16,), (3, 16), (3,)]
    every_step = estimate("ddp", shapes, 3, ddp_comm_hook="none")
    local = estimate("ddp", shapes, 3, ddp_comm_hook="post_local_sgd", local_steps=8)
    assert local.total_bytes == pytest.approx(every_step.total_bytes / 8)
    assert local.scheme == "post-local-sgd-8"
