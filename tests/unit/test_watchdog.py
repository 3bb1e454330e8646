"""The run's watchdog (harness.run.watchdog) and the ranks' progress files (wiiide.engines.progress):
a dead rank and a stalled collective are named at once; no timing, the clock is passed in."""

from __future__ import annotations

import pytest

from harness.run.watchdog import RankWatchdog, node_key
from wiiide.wire.node import EXIT_PEER_LOST
from wiiide.engines.progress import ProgressBeat, progress_path

RUNNING = {"coordinator": "running", "worker-1": "running", "worker-2": "running"}


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _beats(tmp_path, clock):
    beats = {}
    for rank, (name, role) in enumerate([("coordinator", "coordinator"), ("worker-1", "worker"),
                                         ("worker-2", "worker")]):
        beat = ProgressBeat(tmp_path, f"local-{name}", role, interval_s=1.0, clock=clock)
        beat.rank = rank
        beats[name] = beat
    return beats


def test_progress_file_is_written_at_most_once_a_second_unless_the_phase_changes(tmp_path):
    clock = Clock()
    beat = ProgressBeat(tmp_path, "host/with odd:chars", "worker", clock=clock)
    assert beat.path == progress_path(tmp_path, "host/with odd:chars") == tmp_path / "progress" / "host_with_odd_chars.json"
    assert beat.beat(0, "setup") is True
    assert beat.beat(1) is True  # a new phase
    assert beat.beat(2) is False  # same phase, same second
    clock.now_s = 1.5
    assert beat.beat(3) is True
    assert '"step": 3' in beat.path.read_text() and '"phase": "train"' in beat.path.read_text()
    with pytest.raises(ValueError, match="one of"):
        beat.beat(4, "dancing")
    assert ProgressBeat("", "n", "worker").beat(1) is False  # no metrics folder: no file


def test_a_stall_is_declared_when_no_rank_wrote_for_stall_timeout_s(tmp_path):
    clock = Clock()
    beats = _beats(tmp_path, clock)
    dog = RankWatchdog("ddp", tmp_path, stall_timeout_s=30)
    assert dog.check(RUNNING, 0.0) is None  # no progress file yet: the other timeouts apply
    for step in range(1, 6):
        clock.now_s = float(step)
        for beat in beats.values():
            beat.beat(step)
        assert dog.check(RUNNING, clock.now_s) is None
    assert dog.check(RUNNING, 5.0 + 29.0) is None
    verdict = dog.check(RUNNING, 5.0 + 31.0)
    assert verdict is not None and verdict.startswith("no rank made progress for 31 s")
    assert "collective stalled" in verdict and "rank 2 train step 5" in verdict


def test_one_rank_still_moving_is_progress_and_finished_ranks_do_not_count(tmp_path):
    clock = Clock()
    beats = _beats(tmp_path, clock)
    dog = RankWatchdog("fsdp", tmp_path, stall_timeout_s=10)
    for beat in beats.values():
        beat.beat(1)
    dog.check(RUNNING, 0.0)
    clock.now_s = 9.0
    beats["worker-1"].beat(2)
    assert dog.check(RUNNING, 15.0) is None  # worker-1 moved at 15 s by the harness's clock
    for beat in beats.values():
        clock.now_s += 2
        beat.beat(50, "finish")  # evaluation after the last step may be long: not a stall
    assert dog.check(RUNNING, 16.0) is None
    assert dog.check(RUNNING, 1000.0) is None


def test_a_rank_that_exits_with_an_error_fails_the_run_at_once_naming_it(tmp_path):
    clock = Clock()
    beats = _beats(tmp_path, clock)
    for beat in beats.values():
        beat.beat(3)
    codes = {"worker-1": EXIT_PEER_LOST, "worker-2": -9}
    dog = RankWatchdog("ddp", tmp_path, stall_timeout_s=60, exit_code=codes.get)
    states = {"coordinator": "running", "worker-1": "exited", "worker-2": "exited"}
    verdict = dog.check(states, 1.0)
    assert verdict.startswith("rank 2 (worker-2) exited with code -9 while 1 other node(s) still ran")
    # every rank gone within one poll: the cause is still the one that did not exit for a lost peer
    gone = {"coordinator": "exited", "worker-1": "exited", "worker-2": "exited"}
    assert dog.check(gone, 1.0).startswith("rank 2 (worker-2) exited with code -9: a DDP/FSDP run needs every rank")
    assert f"rank 1 (worker-1) exited with code {EXIT_PEER_LOST}" in verdict
    # a clean exit of one rank (the others still finishing) is no failure
    assert RankWatchdog("ddp", tmp_path, 60, exit_code={"worker-2": 0}.get).check(
        {**RUNNING, "worker-2": "exited"}, 1.0) is None
    # the fault's own target is named as such
    faulted = RankWatchdog("ddp", tmp_path, 60, exit_code={"worker-2": -9}.get,
                           expected_dead=lambda: frozenset({"worker-2"}))
    assert "(a fault injection stopped it)" in faulted.check({**RUNNING, "worker-2": "exited"}, 1.0)


def test_the_wiiide_engine_and_finished_runs_are_left_alone(tmp_path):
    clock = Clock()
    for beat in _beats(tmp_path, clock).values():
        beat.beat(1)
    assert RankWatchdog("wiiide", tmp_path, 1, exit_code={"worker-2": -9}.get).check(
        {**RUNNING, "worker-2": "exited"}, 1000.0) is None
    done = {n: "exited" for n in RUNNING}
    assert RankWatchdog("ddp", tmp_path, 1, exit_code={n: 0 for n in RUNNING}.get).check(done, 1000.0) is None
    assert RankWatchdog("ddp", tmp_path, 0).check(RUNNING, 1e6) is None  # 0: the stall rule is off


@pytest.mark.parametrize("name, key", [("wiiide_worker_2", "worker-2"), ("wiiide-worker-12", "worker-12"),
                                       ("local-worker-3", "worker-3"), ("proj-coordinator-1", "coordinator"),
                                       ("other", "other")])
def test_node_key(name, key):
    assert node_key(name) == key
