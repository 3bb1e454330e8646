"""harness.present.round_model: the synchronous-round model of a sharded step, against a report's points."""

from __future__ import annotations

import pytest

from harness.present.round_model import ModelRow, model_rows, point_model, render, sharded_link_s
from wiiide.ps.partition import (
    egress_shard_weights,
    partition_flat,
    pipeline_shard_weights,
    shard_loads_bytes,
)

DIGITS_MLP_NUMEL = 64 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
RATE_BPS = 95.6e6


def _loads(workers: int, weights, order=None) -> list[int]:
    shards = workers + 1
    return shard_loads_bytes(partition_flat(DIGITS_MLP_NUMEL, shards, 64 * 1024, weights, order), shards)


@pytest.mark.parametrize("workers", [3, 4, 8])
def test_pipeline_shares_finish_every_node_together(workers):
    """With the pipeline shares and the coordinator's range pushed first, the coordinator (pushes in
    after s_0 / R, then N s_0 of pulls) is done when the workers are, to a partition's rounding; with
    the coordinator's pulls left out (a huge coordinator ratio) the step is the workers' alone."""
    loads = _loads(workers, pipeline_shard_weights(workers + 1, workers), [*range(1, workers + 1), 0])
    both = sharded_link_s(loads, workers, RATE_BPS, coordinator_pushed_first=True)
    workers_only = sharded_link_s(loads, workers, RATE_BPS, True, coordinator_ratio=1e9)
    assert both == pytest.approx(workers_only, rel=0.01)


def test_the_coordinator_pushed_last_sets_the_step():
    """The egress shares with the coordinator's range at the head (pushed last): its pulls wait for the
    whole push phase, and the step is longer than with the pipeline layout."""
    workers = 8
    egress = sharded_link_s(_loads(workers, egress_shard_weights(9, workers)), workers, RATE_BPS, False)
    pipeline = sharded_link_s(_loads(workers, pipeline_shard_weights(9, workers), [*range(1, 9), 0]), workers,
                              RATE_BPS, True)
    assert egress > 1.3 * pipeline
    model_bytes = DIGITS_MLP_NUMEL * 4
    assert 1.6 * model_bytes * 8 / RATE_BPS < pipeline < 1.65 * model_bytes * 8 / RATE_BPS  # 1.615 M / R


def test_compression_scales_the_link_time_and_bad_input_is_refused():
    loads = [200.0, 100.0, 100.0]
    assert sharded_link_s(loads, 2, 1e6, True, 2.0, 2.0) == pytest.approx(sharded_link_s(loads, 2, 1e6, True) / 2)
    for bad in (([], 2, 1e6), (loads, 0, 1e6), (loads, 2, 0.0)):
        with pytest.raises(ValueError):
            sharded_link_s(*bad, True)


def _point(engine: str = "wiiide", rate_bps: int | None = 100_000_000, status: str = "ok") -> dict:
    node = {"steps": 10, "compute_time_s": 0.05, "compression_ratio": 1.0}
    coordinator = {"ps": {"shard_loads_bytes": [200_000, 100_000, 100_000], "partition_balance": "pipeline"}}
    return {"params": {"engine": engine}, "config": {"num_workers": 2, "engine": engine},
            "cluster": {"link": {"profiles": {"all": {"rate_bps": rate_bps}}}},
            "repeats": [{"status": status, "totals": {"step_time_median_s": s},
                         "nodes": {"coordinator": coordinator, "worker-1": node, "worker-2": node}}
                        for s in (0.1, 0.3, 0.2)]}


def test_point_model_uses_the_ok_repeats_median_and_skips_what_it_cannot_model():
    row = point_model(_point())
    assert isinstance(row, ModelRow) and row.measured_step_s == 0.2
    assert row.model_step_s > 0.005  # compute (5 ms a step) plus the link
    assert point_model(_point(rate_bps=None)) is None  # unshaped: no link model
    assert point_model(_point(status="failed")) is None
    assert point_model(_point(engine="fsdp")) is None
    assert model_rows({"points": [_point(), _point(rate_bps=None)]}) == [row]
    assert "engine=wiiide" in render([row])
