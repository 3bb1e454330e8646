"""The sharded pace coordinator's reading of a worker's ``step_done`` (`wiiide.server.ps.paced.PacedHandout._check`):
the count of pulls the worker's copy served (``cached``, ssp_cache) is taken when it is an integer within the
plan's partitions, and a report that is not closes that worker's connection (ProtocolError)."""

from __future__ import annotations

import time
from collections import deque
from types import SimpleNamespace

import pytest

from wiiide.errors import ProtocolError
from wiiide.server.ps.paced import PacedHandout, _Task

PARTITIONS = 3


def _handout() -> PacedHandout:
    handout = PacedHandout.__new__(PacedHandout)  # the reading alone: no connections, no shard
    handout.tasks = {1: deque([_Task(step=4, samples=8, sent_at=time.perf_counter())])}
    handout.partitions, handout.adaptive = PARTITIONS, None
    return handout


def _step_done(**meta) -> SimpleNamespace:
    return SimpleNamespace(kind="step_done", meta={"step": 4, "loss": 0.5, "staleness": 1, **meta})


@pytest.mark.parametrize("cached", [0, 2, PARTITIONS])
def test_a_count_of_cached_pulls_within_the_plan_is_taken(cached):
    done = _handout()._check(SimpleNamespace(rank=1), _step_done(cached=cached))
    assert (done.rank, done.samples, done.staleness, done.cached) == (1, 8, 1, cached)


def test_a_worker_that_sends_no_count_had_every_pull_with_parameters():
    assert _handout()._check(SimpleNamespace(rank=1), _step_done()).cached == 0


@pytest.mark.parametrize("cached", [-1, PARTITIONS + 1, True, 1.0, "3", None])
def test_a_count_outside_the_plan_or_of_another_type_is_refused(cached):
    with pytest.raises(ProtocolError, match="'cached' must be an integer 0..3"):
        _handout()._check(SimpleNamespace(rank=1), _step_done(cached=cached))
