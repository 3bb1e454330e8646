"""The learning-rate schedules (wiiide.lr_schedule) step by step against torch's own schedulers."""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LambdaLR, LinearLR, SequentialLR

from wiiide.config import RunConfig
from wiiide.errors import ConfigError, ProtocolError
from wiiide.lr_schedule import LrRecord, LrSchedule, wire_lr
from wiiide.training.model import MomentumSGD

BASE_LR = 0.2
# torch's LinearLR needs a start factor > 0: this one is 0 to within 1e-12 of the base rate
ALMOST_ZERO = 1e-12


def _torch_rates(make_scheduler, steps: int) -> list[float]:
    """The rate of each of `steps` optimizer steps under a torch scheduler built on a dummy SGD."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE_LR)
    scheduler = make_scheduler(opt)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return rates


def _ours(schedule: LrSchedule, steps: int) -> list[float]:
    return [schedule.lr(t) for t in range(steps)]


def test_constant_is_torch_constant_rate():
    ours = _ours(LrSchedule(BASE_LR), 20)
    theirs = _torch_rates(lambda o: ConstantLR(o, factor=1.0, total_iters=0), 20)
    assert ours == pytest.approx(theirs, abs=1e-15)


@pytest.mark.parametrize("warmup, decay, min_ratio", [(5, 10, 0.0), (3, 7, 0.25), (0, 12, 0.1)])
def test_linear_warmup_then_linear_decay_is_torch_linear_lr(warmup, decay, min_ratio):
    ours = _ours(LrSchedule(BASE_LR, "linear", warmup, decay, min_ratio), warmup + decay + 1)

    def torch_schedule(opt):
        down = LinearLR(opt, start_factor=1.0, end_factor=max(min_ratio, ALMOST_ZERO), total_iters=decay)
        if warmup == 0:
            return down
        up = LinearLR(opt, start_factor=ALMOST_ZERO, end_factor=1.0, total_iters=warmup)
        return SequentialLR(opt, [up, down], milestones=[warmup])

    assert ours == pytest.approx(_torch_rates(torch_schedule, warmup + decay + 1), abs=1e-9)


@pytest.mark.parametrize("warmup, decay, min_ratio", [(4, 6, 0.1), (10, 25, 0.0), (0, 9, 0.5)])
def test_linear_warmup_then_cosine_decay_is_torch_cosine_annealing(warmup, decay, min_ratio):
    ours = _ours(LrSchedule(BASE_LR, "cosine", warmup, decay, min_ratio), warmup + decay + 1)

    def torch_schedule(opt):
        down = CosineAnnealingLR(opt, T_max=decay, eta_min=min_ratio * BASE_LR)
        if warmup == 0:
            return down
        up = LinearLR(opt, start_factor=ALMOST_ZERO, end_factor=1.0, total_iters=warmup)
        return SequentialLR(opt, [up, down], milestones=[warmup])

    assert ours == pytest.approx(_torch_rates(torch_schedule, warmup + decay + 1), abs=1e-9)


def test_factor_drives_torch_lambda_lr_as_the_ddp_fsdp_ranks_use_it():
    schedule = LrSchedule(BASE_LR, "cosine", 3, 8, 0.2)
    rates = _torch_rates(lambda o: LambdaLR(o, schedule.factor), 15)
    assert rates == pytest.approx(_ours(schedule, 15), abs=1e-15)
    # hand-checked points: warm-up from 0, the peak after it, half-way down the cosine, the floor
    assert rates[0] == 0.0
    assert rates[3] == pytest.approx(BASE_LR)
    assert rates[7] == pytest.approx(BASE_LR * (0.2 + 0.8 * 0.5))
    assert rates[11] == pytest.approx(0.2 * BASE_LR)


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_the_rate_stays_at_its_floor_after_the_decay(kind):
    schedule = LrSchedule(BASE_LR, kind, 2, 5, 0.3)
    assert [schedule.lr(t) for t in range(7, 40)] == pytest.approx([0.3 * BASE_LR] * 33)


def test_constant_with_warmup_holds_the_peak_after_it():
    schedule = LrSchedule(BASE_LR, "constant", 4)
    assert _ours(schedule, 8) == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2, 0.2, 0.2, 0.2])
    assert not schedule.is_constant and LrSchedule(BASE_LR).is_constant


def test_momentum_sgd_with_the_schedule_follows_torch_sgd_with_lambda_lr():
    """The servers' MomentumSGD, its lr set from the schedule before each step, moves the parameters
    as torch.optim.SGD under LambdaLR does (the ddp/fsdp ranks' optimizer)."""
    schedule = LrSchedule(0.5, "linear", 2, 5, 0.1)
    ours, theirs = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    mine = MomentumSGD([ours], lr=0.5, momentum=0.9)
    sgd = torch.optim.SGD([theirs], lr=0.5, momentum=0.9)
    scheduler = LambdaLR(sgd, schedule.factor)
    for t in range(9):
        grad = torch.arange(4, dtype=torch.float32) + t
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        mine.lr = schedule.lr(t)
        mine.step()
        sgd.step()
        scheduler.step()
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert not torch.equal(ours.detach(), torch.ones(4))


def test_from_config_decays_over_max_steps_after_the_warmup():
    cfg = RunConfig(lr_schedule="cosine", lr_warmup_steps=10, max_steps=110, lr_min_ratio=0.1, learning_rate=0.3)
    schedule = LrSchedule.from_config(cfg)
    assert (schedule.kind, schedule.warmup_steps, schedule.decay_steps, schedule.min_ratio) == ("cosine", 10, 100, 0.1)
    assert schedule.lr(60) == pytest.approx(0.3 * (0.1 + 0.9 * 0.5))
    explicit = LrSchedule.from_config(cfg.replace(lr_decay_steps=40))
    assert explicit.decay_steps == 40 and explicit.lr(50) == pytest.approx(0.03)


@pytest.mark.parametrize("values, field", [
    ({"lr_schedule": "cosine"}, "lr_schedule"),  # no length: duration_s alone
    ({"lr_schedule": "linear", "max_steps": 5, "lr_warmup_steps": 5}, "lr_schedule"),
    ({"lr_min_ratio": 0.1}, "lr_min_ratio"),  # a decay's knob without a decay
    ({"lr_decay_steps": 10}, "lr_decay_steps"),
    ({"lr_schedule": "step"}, "lr_schedule"),
    ({"lr_min_ratio": 1.5, "lr_schedule": "linear", "max_steps": 10}, "lr_min_ratio"),
])
def test_config_refuses_a_schedule_it_could_not_apply(values, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        RunConfig(**values)


@pytest.mark.parametrize("engine", ["wiiide", "ddp", "fsdp"])
def test_every_engine_takes_a_schedule(engine):
    cfg = RunConfig(engine=engine, lr_schedule="linear", lr_warmup_steps=3, max_steps=20)
    assert LrSchedule.from_config(cfg).decay_steps == 17


def test_schedule_refuses_bad_arguments():
    with pytest.raises(ValueError, match="decay length"):
        LrSchedule(0.1, "cosine", 5, 0)
    with pytest.raises(ValueError, match="out of range"):
        LrSchedule(0.1, "linear", -1, 5)


def test_record_keeps_the_first_rate_of_each_step_in_order():
    record = LrRecord(LrSchedule(1.0, "linear", 0, 4), start_step=2)
    for step, lr in [(2, 0.5), (2, 0.9), (3, 0.25), (5, 0.1), (4, 0.0)]:
        record.applied(step, lr)
    assert record.to_dict()["lr_per_step"] == [0.5, 0.25, 0.0]
    assert record.to_dict()["lr_schedule"]["start_step"] == 2


@pytest.mark.parametrize("bad", [True, "0.1", -0.1, math.nan, math.inf, 101.0, None])
def test_wire_lr_refuses_what_is_not_a_rate(bad):
    with pytest.raises(ProtocolError, match="'lr'"):
        wire_lr(bad, "batch")


def test_wire_lr_takes_zero_the_first_warmup_step():
    assert wire_lr(0, "batch") == 0.0 and wire_lr(0.25, "batch") == 0.25
