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
