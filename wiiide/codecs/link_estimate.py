"""The link rate a node infers from what it receives (`LinkEstimate`), for the network-aware policy
(`wiiide.codecs.policy`)."""

from __future__ import annotations

import math
from collections import deque

LINK_MIN_BYTES = 256 * 1024  # the link estimate's smallest payload by default (LinkEstimate.min_bytes)


def _quantile(ordered: list[float], q: float) -> float:
    """The `q` quantile (0..1) of the ascending non-empty list `ordered`, interpolated linearly between
    the closest ranks (numpy's default method, ``np.quantile(..., method="linear")``; Hyndman and Fan
    1996, definition 7). In plain Python: every message a node receives asks for it, and for a window
    of 32 rates `np.quantile`'s own overhead (about 0.1 ms) was 12 % of a parameter server's CPU."""
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return float(ordered[below] + (ordered[above] - ordered[below]) * (position - below))


class LinkEstimate:
    """Link bandwidth (bits/s) measured from the payloads this node receives.

    Each received payload of at least `min_bytes` gives a rate: its bytes over the time from the end
    of its header to its last byte (`Message.payload_recv_s`). A payload already waiting in the socket
    buffer reads faster than the link (the coordinator reading its second worker, say), so the
    estimate is a low quantile (25 %) of the last `window` rates rather than their mean. It assumes
    the link is as fast both ways (tc/tbf profiles shape each direction alike).
    """

    def __init__(self, min_bytes: int = LINK_MIN_BYTES, window: int = 32, quantile: float = 0.25) -> None:
        self.min_bytes, self.quantile = min_bytes, quantile
        self.rates_bps: deque[float] = deque(maxlen=window)

    def observe(self, payload_nbytes: int, seconds: float) -> None:
        """Count one received payload of `payload_nbytes` bytes that took `seconds` (ignored below `min_bytes`)."""
        if payload_nbytes >= self.min_bytes and seconds > 0:
            self.rates_bps.append(8.0 * payload_nbytes / seconds)

    def observe_rate(self, bps: float) -> None:
        """Count one rate in bit/s (a peer's report); ignored unless a finite number > 0."""
        if isinstance(bps, (int, float)) and not isinstance(bps, bool) and 0 < bps < float("inf"):
            self.rates_bps.append(float(bps))

    @property
    def bps(self) -> float | None:
        """The estimated link rate in bit/s (the `quantile` of recent rates), None before any sample."""
        if not self.rates_bps:
            return None
        return _quantile(sorted(self.rates_bps), self.quantile)
