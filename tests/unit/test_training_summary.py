"""The Training Summary block rank 0 prints at the end (wiiide.wire.node.run_node), read against the per-step records."""

from __future__ import annotations

import json

import pytest

from wiiide.config import RunConfig
from wiiide.log import TieredLog
from wiiide.metrics import NodeMetrics
from wiiide.wire.node import run_node


def _train(metrics: NodeMetrics) -> None:
    """Five steps of 32 samples: 2 warm-up steps (1.0 s, 0.8 s), then 0.1, 0.3, 0.2 s."""
    for seconds, loss in zip([1.0, 0.8, 0.1, 0.3, 0.2], [4.0, 3.0, 2.0, 1.5, 0.5]):
        metrics.record_step_time(seconds)
        metrics.losses.append(loss)
        metrics.steps += 1
        metrics.samples += 32


def _printed(text: str) -> dict[str, str]:
    lines = text.strip().splitlines()
    assert lines[:2] == ["Training Summary", "=" * 50]
    return dict(line.split(": ", 1) for line in lines[2:])


def test_rank0_prints_the_summary_of_its_steps(tmp_path, capsys):
    cfg = RunConfig(warmup_steps=2, metrics_dir=str(tmp_path))
    metrics = NodeMetrics("coordinator", "c")
    assert run_node(cfg, metrics, TieredLog(cfg, "test"), lambda: _train(metrics)) == 0
    block = _printed(capsys.readouterr().out)
    # hand-computed from the records above: the 3 timed steps 0.1, 0.3, 0.2 s; every step's loss
    assert (block["num_steps"], block["warmup_steps"], block["total_steps"]) == ("3", "2", "5")
    assert float(block["avg_step_time_s"]) == pytest.approx(0.2)
    assert (float(block["min_step_time_s"]), float(block["max_step_time_s"])) == (0.1, 0.3)
    assert float(block["throughput_samples_per_s"]) == pytest.approx(160.0)  # 32 samples / 0.2 s
    assert float(block["avg_loss"]) == pytest.approx(2.2) and float(block["final_loss"]) == 0.5
    assert int(block["peak_rss_bytes"]) > 0
    written = json.loads((tmp_path / "coordinator.json").read_text())["training_summary"]
    assert written["num_steps"] == 3 and written["avg_step_time_s"] == pytest.approx(0.2)  # in the report too


@pytest.mark.parametrize("role, tier", [("worker", "normal"), ("coordinator", "silent")])
def test_only_rank0_prints_and_not_when_silent(tmp_path, capsys, role, tier):
    cfg = RunConfig(warmup_steps=2, metrics_dir=str(tmp_path), log_tier=tier)
    metrics = NodeMetrics(role, "n")
    run_node(cfg, metrics, TieredLog(cfg, "test"), lambda: _train(metrics))
    assert "Training Summary" not in capsys.readouterr().out
