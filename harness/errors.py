"""Exceptions raised by the harness."""


class HarnessError(Exception):
    """Base class of every error the harness raises on purpose."""


class ClusterError(HarnessError):
    """The Docker engine, an image build or a container did not do what was asked."""


class SpecError(HarnessError):
    """An experiment or cluster specification is invalid."""


class LinkShapingError(HarnessError):
    """A link shape (rate, delay, jitter, loss) could not be applied."""
