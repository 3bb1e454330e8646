"""An emulated link in user space: a socket whose sends keep to a bit rate (a token bucket on `sendmsg`)."""

from __future__ import annotations

import socket
import time
from typing import Sequence

from wiiide.units import KIB


class PacedSocket:
    """A socket whose `sendmsg` keeps to `rate_bps` bit/s.

    Sends at most `slice_bytes` per call and sleeps until the bucket allows it; `send_frames` loops on
    partial sends, so frames go out at the rate. Bursts are limited to one slice.

    Args:
        sock: a connected socket.
        rate_bps: the link rate in bit/s (SI), > 0.
        slice_bytes: the most bytes one `sendmsg` passes to the kernel (the burst), > 0.

    Raises:
        ValueError: `rate_bps` or `slice_bytes` not positive.
    """

    def __init__(self, sock: socket.socket, rate_bps: float, slice_bytes: int = 64 * KIB) -> None:
        if rate_bps <= 0 or slice_bytes <= 0:
            raise ValueError(f"PacedSocket: rate_bps ({rate_bps}) and slice_bytes ({slice_bytes}) must be > 0")
        self.sock, self.slice_bytes = sock, slice_bytes
        self.rate_bytes_per_s = rate_bps / 8.0
        self._t_free = time.perf_counter()

    def sendmsg(self, buffers: Sequence[memoryview]) -> int:
        """Send up to `slice_bytes` of `buffers` once the bucket allows; return the bytes sent.

        Raises:
            OSError: the underlying `socket.sendmsg` failed.
        """
        budget, picked = self.slice_bytes, []
        for b in buffers:
            if budget <= 0:
                break
            view = memoryview(b)[:budget]
            picked.append(view)
            budget -= view.nbytes
        now = time.perf_counter()
        start = max(now, self._t_free)
        if start > now:
            time.sleep(start - now)
        sent = self.sock.sendmsg(picked)
        self._t_free = start + sent / self.rate_bytes_per_s
        return sent
