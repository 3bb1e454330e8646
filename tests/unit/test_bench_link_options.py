"""bench-link's options: losses that are not percentages in (0, 100) fail before anything starts."""

import argparse

import pytest

from harness.bench.link_loss import add_arguments, main_from_args
from harness.errors import SpecError


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("loss", ["0", "100", "1,x", "", "-1"])
def test_bad_losses_fail_before_any_container(loss):
    with pytest.raises(SpecError, match="bench-link"):
        main_from_args(args("--loss", loss), progress=lambda _: None)


def test_no_datagrams_fail():
    with pytest.raises(SpecError, match="--datagrams"):
        main_from_args(args("--datagrams", "0"), progress=lambda _: None)


def test_defaults_are_the_targets_losses():
    parsed = args()
    assert parsed.loss == "0.1,1,5" and parsed.datagrams == 100_000


@pytest.mark.parametrize("argv, needle", [
    (("--measure", "jitter"), "--measure"), (("--measure", ""), "--measure"),
    (("--measure", "delay", "--delay", "0"), "--delay"), (("--measure", "delay", "--delay", "10,x"), "--delay"),
    (("--measure", "capacity", "--capacity", "-25"), "--capacity"), (("--round-trips", "0"), "--round-trips"),
])
def test_bad_delay_options_fail_before_any_container(argv, needle):
    with pytest.raises(SpecError, match=needle):
        main_from_args(args(*argv), progress=lambda _: None)


def test_delay_defaults_are_the_targets_round_trips():
    parsed = args()
    # None: loss on the docker pair, loss,delay,rate with --netns or --vm
    assert parsed.measure is None and parsed.delay == "2,10,50,100" and parsed.capacity == "1,25"


def test_delay_targets_are_five_percent_or_a_third_of_a_millisecond():
    from harness.bench.link_delay import within_target
    assert within_target(2.25, 2.25, 2) == {"median_ok": True, "p99_ok": True}  # 0.3 ms at 2 ms
    assert within_target(105.2, 109, 100) == {"median_ok": False, "p99_ok": True}  # 5 % at 100 ms
    assert within_target(100.1, 111, 100)["p99_ok"] is False
