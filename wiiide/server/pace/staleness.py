"""The stale synchronous parallel (SSP) clock and the staleness of an applied update.

SSP (Ho et al., "More Effective Distributed ML via a Stale Synchronous Parallel Parameter Server",
NIPS 2013): every worker has a clock, the number of updates it has pushed. A worker at clock ``c`` may
start its next piece of work only while the slowest live worker is at ``c - s`` or later, so the
fastest and the slowest are never more than ``s`` clocks apart. ``s = 0`` is bulk synchronous
rounds; no bound (``async``) is asynchronous SGD (Hogwild-style, Recht et al. 2011; Downpour, Dean et
al. 2012).

Staleness of an update: the number of server versions (updates applied) between the parameters the
worker computed on and the parameters the update is applied to, ``k = version_now - version_read``.
"""

from __future__ import annotations

from typing import Literal

StalenessBound = int | Literal["async"]


class SSPClock:
    """The clocks of the live workers and the SSP rule over them.

    Args:
        bound: ``s`` (an int >= 0: at most s clocks between fastest and slowest) or ``"async"`` (none).

    Workers leave (`leave`: lost) and join (`join`: new or back); a worker that joins starts at the
    slowest live worker's clock (or keeps its own when that is higher), so it neither blocks the others
    nor is blocked by its own past. Ranks are ints; clocks are ints >= 0.

    Raises:
        ValueError: a negative bound or an unknown rank (`tick`, `leave`, `may_proceed` of a worker that
            never joined).
    """

    def __init__(self, bound: StalenessBound) -> None:
        if bound != "async" and (not isinstance(bound, int) or isinstance(bound, bool) or bound < 0):
            raise ValueError(f"staleness bound must be an int >= 0 or 'async', got {bound!r}")
        self.bound: int | None = None if bound == "async" else int(bound)
        self.clocks: dict[int, int] = {}
        self.live: set[int] = set()

    def join(self, rank: int) -> int:
        """Make `rank` live at max(its old clock, the slowest live clock); returns its clock."""
        start = self.slowest() if self.live else 0
        self.clocks[rank] = max(self.clocks.get(rank, 0), start)
        self.live.add(rank)
        return self.clocks[rank]

    def leave(self, rank: int) -> None:
        """`rank` is no longer live: it stops holding the others back. Raises ValueError if unknown."""
        self._known(rank)
        self.live.discard(rank)

    def tick(self, rank: int) -> int:
        """`rank` pushed one update: its clock advances by one; returns the new clock."""
        self._known(rank)
        self.clocks[rank] += 1
        return self.clocks[rank]

    def slowest(self) -> int:
        """The lowest clock among live workers (0 when none is live)."""
        return min((self.clocks[r] for r in self.live), default=0)

    def fastest(self) -> int:
        """The highest clock among live workers (0 when none is live)."""
        return max((self.clocks[r] for r in self.live), default=0)

    def gap(self) -> int:
        """Clocks between the fastest and the slowest live worker."""
        return self.fastest() - self.slowest()

    def ahead(self, rank: int) -> int:
        """How many clocks `rank` is ahead of the slowest live worker."""
        self._known(rank)
        return self.clocks[rank] - self.slowest()

    def may_proceed(self, rank: int) -> bool:
        """True unless `rank` is more than `bound` clocks ahead of the slowest live worker (always, async)."""
        return self.bound is None or self.ahead(rank) <= self.bound

    def copy_is_fresh(self, rank: int, slowest_when_read: int) -> bool:
        """Whether parameters read while the slowest live clock was `slowest_when_read` may serve
        `rank`'s next piece of work: they hold every worker's first `slowest_when_read` pushes, and SSP
        asks a worker at clock ``c`` to see every worker's first ``c - s`` (Ho et al. 2013: updates of
        clocks up to ``c - s - 1``, counted from 0). Always False for async (no bound to measure by).
        Raises ValueError if `rank` is unknown."""
        self._known(rank)
        return self.bound is not None and slowest_when_read >= self.clocks[rank] - self.bound

    def _known(self, rank: int) -> None:
        if rank not in self.clocks:
            raise ValueError(f"worker rank {rank} has no clock (it never joined); known: {sorted(self.clocks)}")


def staleness_scale(staleness: int, scaling: Literal["none", "inverse"]) -> float:
    """The factor applied to an update `staleness` versions old.

    ``none``: 1 (SSP applies stale updates as they are; Ho et al. 2013 bound the error by s instead).
    ``inverse``: 1 / (k + 1), the staleness-dependent learning rate of Zhang, Gupta, Lian and Liu,
    "Staleness-aware Async-SGD for Distributed Deep Learning" (IJCAI 2016), who divide the learning rate
    by the staleness: an update computed on older parameters moves them less. (k + 1 rather than k so a
    fresh update, k = 0, keeps its full size.)

    Raises:
        ValueError: a negative staleness or an unknown scaling.
    """
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if scaling == "none":
        return 1.0
    if scaling == "inverse":
        return 1.0 / (staleness + 1)
    raise ValueError(f"unknown staleness scaling {scaling!r}; allowed: none | inverse")
