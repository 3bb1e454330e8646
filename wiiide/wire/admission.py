"""Which accepted connections may handshake with the coordinator now, which wait, which are refused.

A stranger who cannot authenticate can still connect, slowly or often (docs/faults.md, the threat
model). Three defences, all per peer address (the IP, without the port), so one address never takes
every handshake slot and a worker with the secret connecting from another address is still served:

- **slots**: at most `max_active` handshakes at once (``max_handshakes``), at most
  `max_active_per_address` of them from one address;
- **waiting**: a connection that finds no slot waits (socket open, no thread) in its address's FIFO,
  at most `max_waiting_per_address` per address and `max_waiting` in all; a freed slot goes to the
  next address in round-robin order, so a long queue from one address cannot starve another. The
  handshake's deadline runs from accept: a connection still waiting at its deadline is refused;
- **penalty**: a token bucket per address (capacity `penalty_burst` tokens, one back every
  `penalty_refill_s` seconds; the token-bucket policer of RFC 2697, counting failures instead of
  bytes). Every failed handshake takes a token, a successful one gives one back; an address with no
  token left is refused at once (no slot, no waiting) until it has earned one back, so a peer that
  keeps failing is slowed down to one attempt per `penalty_refill_s`. A connection refused because
  its address already has `max_waiting_per_address` waiting counts as a failure, too.

Memory is bounded: at most `max_waiting` sockets wait, and at most `max_addresses` buckets are kept
(least recently used evicted first). `HandshakeGate` is thread-safe: the acceptor thread calls
`arrive` and `expire`, the slot threads `finish`.
"""

from __future__ import annotations

import socket
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

# refusal reasons (short categories: the metrics count refusals beyond their event cap by these)
REASON_PENALIZED = "penalized"
REASON_BUSY = "busy"
REASON_DEADLINE = "deadline"


@dataclass
class Pending:
    """An accepted connection: its socket, peer address (IP) and ``ip:port`` text, and the
    `time.monotonic()` instant by which its handshake must be complete."""

    sock: socket.socket
    address: str
    peer: str
    deadline: float


@dataclass
class Refusal:
    """A connection the gate refuses: a `reason` category (REASON_*) and a one-line `cause`."""

    pending: Pending
    reason: str
    cause: str


@dataclass
class _Bucket:
    tokens: float
    updated: float


@dataclass
class Decision:
    """What `arrive` decided: ``start`` (a slot is the caller's), ``wait`` or ``refuse`` (see `refusal`)."""

    action: str
    refusal: Refusal | None = None


@dataclass
class HandshakeGate:
    """Slots, per-address waiting queues and per-address failure penalties (module docstring).

    Args:
        max_active: handshakes at once (>= 1).
        max_active_per_address: of which from one address (>= 1).
        max_waiting: connections waiting for a slot, in all.
        max_waiting_per_address: of which from one address.
        penalty_burst: failed handshakes an address may have in a burst before it is refused at once.
        penalty_refill_s: seconds to earn back one token (> 0).
        max_addresses: buckets kept (least recently used evicted).
    """

    max_active: int
    max_active_per_address: int
    max_waiting: int
    max_waiting_per_address: int
    penalty_burst: int
    penalty_refill_s: float
    max_addresses: int = 4096
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _active: dict[str, int] = field(default_factory=dict, repr=False)
    _n_active: int = 0
    _waiting: "OrderedDict[str, deque[Pending]]" = field(default_factory=OrderedDict, repr=False)
    _n_waiting: int = 0
    _buckets: "OrderedDict[str, _Bucket]" = field(default_factory=OrderedDict, repr=False)

    @classmethod
    def for_cluster(cls, max_handshakes: int, num_workers: int, handshake_timeout_s: float) -> "HandshakeGate":
        """The coordinator's gate: half the slots per address (at least 1); a whole cluster's workers
        plus the slots may wait per address (so workers sharing one host, as on the local backend,
        are never refused for arriving together); a burst of 2 x max_handshakes failures, then one
        attempt per handshake_timeout_s."""
        per_address_waiting = num_workers + max_handshakes
        return cls(max_active=max_handshakes, max_active_per_address=max(1, max_handshakes // 2),
                   max_waiting=256 + per_address_waiting, max_waiting_per_address=per_address_waiting,
                   penalty_burst=2 * max_handshakes, penalty_refill_s=handshake_timeout_s)

    # --- token buckets ----------------------------------------------------------------------------
    def _bucket(self, address: str, now: float) -> _Bucket:
        bucket = self._buckets.get(address)
        if bucket is None:
            bucket = self._buckets[address] = _Bucket(float(self.penalty_burst), now)
            while len(self._buckets) > self.max_addresses:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(address)
            bucket.tokens = min(float(self.penalty_burst), bucket.tokens + (now - bucket.updated) / self.penalty_refill_s)
            bucket.updated = now
        return bucket

    def _penalized(self, pending: Pending, now: float) -> Refusal | None:
        if self._bucket(pending.address, now).tokens >= 1.0:
            return None
        return Refusal(pending, REASON_PENALIZED,
                       f"address {pending.address} failed {self.penalty_burst}+ handshakes recently: refused at "
                       f"once for up to {self.penalty_refill_s:g} s (one attempt per {self.penalty_refill_s:g} s)")

    # --- the three calls ----------------------------------------------------------------------------
    def arrive(self, pending: Pending, now: float) -> Decision:
        """A new connection: ``start`` it (the caller now holds a slot and must call `finish`),
        let it ``wait``, or ``refuse`` it at once (penalized address, or too many waiting)."""
        with self._lock:
            refusal = self._penalized(pending, now)
            if refusal is not None:
                return Decision("refuse", refusal)
            if self._n_active < self.max_active and self._active.get(pending.address, 0) < self.max_active_per_address:
                self._take_slot(pending.address)
                return Decision("start")
            queue = self._waiting.get(pending.address)
            waiting_here = len(queue) if queue else 0
            if waiting_here >= self.max_waiting_per_address or self._n_waiting >= self.max_waiting:
                if waiting_here >= self.max_waiting_per_address:  # it overflows its own queue: a failure
                    bucket = self._bucket(pending.address, now)
                    bucket.tokens = max(0.0, bucket.tokens - 1.0)
                return Decision("refuse", Refusal(pending, REASON_BUSY, (
                    f"every handshake slot is taken and {waiting_here} connections from {pending.address} "
                    f"({self._n_waiting} in all) already wait; at most {self.max_waiting_per_address} per "
                    f"address and {self.max_waiting} in all")))
            if queue is None:
                queue = self._waiting[pending.address] = deque()
            queue.append(pending)
            self._n_waiting += 1
            return Decision("wait")

    def finish(self, address: str, ok: bool, now: float) -> tuple[Pending | None, list[Refusal]]:
        """A handshake from `address` ended (`ok`: authenticated). Frees its slot, charges or credits
        the address's bucket, and hands the slot to the next waiting connection in round-robin order.

        Returns:
            (the connection the caller now holds the slot for, or None; connections to refuse: those
            found past their deadline or from an address penalized meanwhile).
        """
        with self._lock:
            self._release_slot(address)
            bucket = self._bucket(address, now)
            bucket.tokens = min(float(self.penalty_burst), bucket.tokens + 1.0) if ok else max(0.0, bucket.tokens - 1.0)
            refused: list[Refusal] = []
            return self._next(now, refused), refused

    def expire(self, now: float) -> list[Refusal]:
        """Take out every waiting connection whose deadline has passed (each costs its address a token)."""
        with self._lock:
            refused: list[Refusal] = []
            for address in list(self._waiting):
                queue = self._waiting[address]
                while queue and queue[0].deadline <= now:
                    refused.append(self._expired(queue.popleft(), now))
                if not queue:
                    del self._waiting[address]
            self._n_waiting = sum(len(q) for q in self._waiting.values())
            return refused

    def drain(self) -> list[Pending]:
        """Take out every waiting connection (the run is over: the caller closes them)."""
        with self._lock:
            pending = [p for q in self._waiting.values() for p in q]
            self._waiting.clear()
            self._n_waiting = 0
            return pending

    def counts(self) -> dict[str, int]:
        """Handshakes running, connections waiting and addresses tracked now (for logs and tests)."""
        with self._lock:
            return {"active": self._n_active, "waiting": self._n_waiting, "addresses": len(self._buckets)}

    # --- helpers (the lock held) --------------------------------------------------------------------
    def _take_slot(self, address: str) -> None:
        self._n_active += 1
        self._active[address] = self._active.get(address, 0) + 1

    def _release_slot(self, address: str) -> None:
        self._n_active -= 1
        left = self._active.get(address, 1) - 1
        if left:
            self._active[address] = left
        else:
            self._active.pop(address, None)

    def _expired(self, pending: Pending, now: float) -> Refusal:
        bucket = self._bucket(pending.address, now)
        bucket.tokens = max(0.0, bucket.tokens - 1.0)
        return Refusal(pending, REASON_DEADLINE, "waited for a handshake slot until the deadline "
                                                 "(every slot was taken)")

    def _next(self, now: float, refused: list[Refusal]) -> Pending | None:
        """Round-robin over the addresses with waiting connections, for one that may start now."""
        for _ in range(len(self._waiting)):
            if not self._waiting:
                break
            address, queue = next(iter(self._waiting.items()))
            self._waiting.move_to_end(address)  # the next pick starts with another address
            if self._active.get(address, 0) >= self.max_active_per_address:
                continue
            while queue:
                pending = queue.popleft()
                self._n_waiting -= 1
                if pending.deadline <= now:
                    refused.append(self._expired(pending, now))
                    continue
                penalty = self._penalized(pending, now)
                if penalty is not None:
                    refused.append(penalty)
                    continue
                if not queue:
                    del self._waiting[address]
                self._take_slot(address)
                return pending
            del self._waiting[address]
        return None
