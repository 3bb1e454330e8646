"""The shaper's token bucket on each node's egress, shared by the round model's two simulations of the
links (`harness.analysis.round_model.sharded_round_s`, `harness.analysis.round_sim.simulate_sharded_steps`).

A node's egress is an htb class (or tbf) with ``ceil`` = ``rate``: bytes covered by its tokens leave at
the wire's speed, taken as instant against the shaped rate, and the tokens refill at the rate while the
egress is idle, up to its ``burst`` (Linux ``sch_htb.c``: a class with tokens is in ``HTB_CAN_SEND``;
tc-htb(8), "burst")."""

from __future__ import annotations

from collections import deque
from typing import Callable, Protocol


class QueuedMessage(Protocol):
    nbytes: float  # bytes still to cross the link


def spend_tokens(queues: dict[tuple[int, int], deque], tokens: list[float], idle_since: list[float | None],
                 now: float, byte_rate: float, burst_bytes: float, eps_bytes: float,
                 crossed: Callable[[int, QueuedMessage], None]) -> None:
    """The token buckets at time `now`. `queues`: (sender, receiver) -> the messages queued on that
    connection, head first; `tokens` and `idle_since` (when each sender's egress fell idle, None: busy)
    per node, updated in place. An egress with something to send first takes the tokens its idle time
    refilled (at `byte_rate`, bytes/s, up to `burst_bytes`), then lets what they cover cross at once, its
    connections' queues in turn; `crossed(receiver, message)` is told of each message whose bytes all
    crossed (it may queue more: repeated until nothing more crosses). An egress left with nothing to send
    is idle from `now`."""
    moved = bool(burst_bytes)
    while moved:
        moved = False
        for src in sorted({src for (src, _), queue in queues.items() if queue}):
            if idle_since[src] is not None:
                tokens[src] = min(burst_bytes, tokens[src] + (now - idle_since[src]) * byte_rate)
                idle_since[src] = None
            if tokens[src] <= eps_bytes:  # a busy egress without tokens: nothing crosses, it stays busy
                continue
            for (node, dst), queue in list(queues.items()):
                while node == src and queue and tokens[src] > eps_bytes:
                    head = queue[0]
                    sent = min(tokens[src], head.nbytes)
                    tokens[src] -= sent
                    head.nbytes -= sent
                    if head.nbytes > eps_bytes:
                        break
                    crossed(dst, queue.popleft())
                    moved = True
            if not any(queue for (node, _), queue in queues.items() if node == src):
                idle_since[src] = now
