"""The coordinator's side of paced shards' checkpoints (wiiide.server.ps.paced_checkpoints): under async and a
staleness bound the handout stops at each checkpoint step until every task is reported (the drain), a
time-triggered checkpoint announces the step after the tasks handed out, rounds are never held back, and
the SSP clocks saved at a cut are restored only when they account for every update of the step."""

from __future__ import annotations

from wiiide.config import RunConfig
from wiiide.server.ps.paced_checkpoints import PacedCheckpoints, handout_meta, restored_clocks


class _Client:
    def __init__(self) -> None:
        self.announced: list[int] = []

    def announce_checkpoint(self, step: int) -> None:
        self.announced.append(step)


def test_async_handout_is_held_at_every_multiple_until_the_cut_drained():
    cut = PacedCheckpoints(RunConfig(staleness_bound="async", checkpoint_every_steps=10), 0, True, None)
    assert cut.limit() == 10
    cut.held()
    cut.after_update(9, 10, 0)  # nine updates in, one task out: still held
    assert cut.limit() == 10 and cut.cuts == 0
    cut.after_update(10, 10, 0)  # every task handed out reported: the cut is done, the next one is 20
    assert cut.limit() == 20 and cut.cuts == 1
    assert cut.record()["cut"] == "drain" and cut.record()["drain_s"]["count"] == 1


def test_a_restored_run_holds_at_the_multiple_after_its_step():
    assert PacedCheckpoints(RunConfig(staleness_bound=2, checkpoint_every_steps=10), 30, True, None).limit() == 40


def test_the_time_trigger_announces_the_step_after_the_tasks_handed_out_and_drains_at_it():
    client = _Client()
    cut = PacedCheckpoints(RunConfig(staleness_bound=2, checkpoint_every_s=0.001), 0, True, client)
    cut.timer.last_s -= 1.0  # the interval has passed
    cut.after_update(3, 5, 0)
    assert client.announced == [6] and cut.limit() == 6
    cut.after_update(6, 6, 0)
    assert cut.limit() is None and cut.cuts == 1


def test_rounds_are_not_held_and_announce_the_round_after_the_last_one_handed_out():
    client = _Client()
    cut = PacedCheckpoints(RunConfig(adaptive_batch=True, checkpoint_every_s=0.001, checkpoint_every_steps=10), 0,
                           False, client)
    assert cut.limit() is None
    cut.timer.last_s -= 1.0
    cut.after_update(4, 99, 6)
    assert client.announced == [7] and cut.limit() is None and cut.record()["cut"] == "round"


def test_saved_clocks_are_restored_only_when_they_sum_to_the_restored_step():
    run = handout_meta(12, {1: 7, 2: 5})
    assert run["paced_handout"] == {"tasks_handed_out": 12, "ssp_clocks": {"1": 7, "2": 5}}
    assert restored_clocks(run, [1, 2], 12) == {1: 7, 2: 5}
    assert restored_clocks(run, [1, 2], 13) is None  # not this step's handout
    assert restored_clocks(run, [1, 2, 3], 12) is None  # a worker the cut did not have
    assert restored_clocks({}, [1, 2], 12) is None
    assert restored_clocks({"paced_handout": {"ssp_clocks": {"1": "7", "2": 5}}}, [1, 2], 12) is None
