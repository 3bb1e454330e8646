"""The watchdog on the local backend with DDP: a rank paused (SIGSTOP) leaves every other rank waiting
in gloo, and the point fails as a stalled collective; a rank killed fails it naming the rank and its
exit code. Both end by the watchdog's verdict, not by the harness's timeout (asserted on the messages,
never on times)."""

from __future__ import annotations

from harness.run.local import LocalBackend
from harness.run.loop import run_point
from harness.spec.faults import Fault
from wiiide.config import RunConfig

# a long run: without the watchdog, these points would end only at the harness's timeout
BASE = dict(engine="ddp", dataset="digits", num_workers=2, duration_s=600, max_steps=0, log_tier="normal",
            log_every_steps=100000, connect_timeout_s=30, io_timeout_s=600)
TIMEOUT_S = 900.0


def test_a_paused_rank_is_reported_as_a_stalled_collective(tmp_path):
    cfg = RunConfig(**BASE, stall_timeout_s=5)
    lines: list[str] = []
    result = run_point(LocalBackend(), cfg, tmp_path, timeout_s=TIMEOUT_S, progress=lines.append,
                       faults=[Fault(action="pause", target="worker-2", at_s=1, duration_s=3000)])
    assert result.status == "failed"
    assert result.error.startswith("no rank made progress for "), result.error
    assert "stall_timeout_s=5" in result.error and "collective stalled?" in result.error
    assert "timed out" not in result.error
    assert any("no rank made progress" in line for line in lines)


def test_a_killed_rank_is_named_with_its_exit_code(tmp_path):
    cfg = RunConfig(**BASE, stall_timeout_s=600)
    result = run_point(LocalBackend(), cfg, tmp_path, timeout_s=TIMEOUT_S, progress=lambda line: None,
                       faults=[Fault(action="kill", target="worker-2", at_s=1)])
    assert result.status == "failed"
    assert "(worker-2) exited with code -9 (a fault injection stopped it)" in result.error, result.error
    assert result.error.startswith("rank ") and "timed out" not in result.error
