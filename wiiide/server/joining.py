"""The coordinator's membership: joining, admission, loss (`Coordinator` inherits `CoordinatorJoining`).

An acceptor thread accepts connections for the whole run and a `wiiide.wire.admission.HandshakeGate`
decides which handshake now (on a slot thread), which wait and which are refused at once; a connection
that authenticated waits in a queue until the main thread admits it (`_admit`: a rank, its old one if it
comes back). Public: `members()`, `drop()`, and for a session that admits at its own rounds,
`joining_waits()` and `admit_waiting()`; `welcome_extra` is merged into every welcome's meta.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass

from wiiide.wire.handshake import Hello, accept_hello, refusal_reason, send_welcome
from wiiide.wire.node import EXIT_CONNECT, EXIT_PEER_LOST, Connection, Heartbeats, NodeFailure
from wiiide.server.ps.partition import resolve_shards
from wiiide.server.recovery import rejoin_hint
from wiiide.wire.admission import REASON_DEADLINE, Pending, Refusal

@dataclass
class _Joining:
    """A connection that passed the handshake, waiting for the main thread to admit it."""

    hello: Hello
    rejoin: dict | None = None  # a rejoining worker's hint (wiiide.server.recovery.rejoin_hint)

    @property
    def conn(self) -> Connection:
        return self.hello.conn

    @property
    def node_id(self) -> str:
        return self.hello.node_id

    @property
    def peer(self) -> str:
        return self.hello.peer


@dataclass
class WorkerSlot:
    """One joined worker: its rank (1..num_workers), connection, node id, batches trained and whether it is alive."""

    rank: int
    conn: Connection
    node_id: str
    batches: int = 0
    alive: bool = True
    tls_name: str | None = None  # with tls on: the first name of its certificate (what its peers dial it as)




class CoordinatorJoining:
    """The membership half of `wiiide.server.coordinator.Coordinator` (module docstring)."""


    def _accept_loop(self) -> None:
        """Accept connections for the whole run; the gate (`wiiide.wire.admission`) decides which handshake
        now (each on a slot thread), which wait and which are refused at once."""
        assert self.listener is not None
        self.listener.settimeout(0.5)
        try:
            while not self._closing.is_set():
                for refusal in self._gate.expire(time.monotonic()):
                    self._refuse_pending(refusal)
                try:
                    sock, addr = self.listener.accept()
                except socket.timeout:
                    continue
                except OSError:
                    return  # the listener was closed: the run is over
                now = time.monotonic()
                pending = Pending(sock, str(addr[0]), f"{addr[0]}:{addr[1]}", now + self.cfg.handshake_timeout_s)
                decision = self._gate.arrive(pending, now)
                if decision.action == "start":
                    self._start_slot(pending)
                elif decision.refusal is not None:
                    self._refuse_pending(decision.refusal)
        finally:
            for pending in self._gate.drain():
                _close_quietly(pending.sock)

    def _start_slot(self, pending: Pending) -> None:
        try:
            threading.Thread(target=self._slot, args=(pending,), name=f"handshake {pending.peer}", daemon=True).start()
        except RuntimeError as exc:  # no thread to be had: give the slot back
            self._refuse(pending.sock, pending.peer, f"no handshake thread: {exc}", "unexpected")
            self._gate.finish(pending.address, False, time.monotonic())

    def _slot(self, pending: Pending | None) -> None:
        """A handshake slot: run handshakes, then the next waiting connection the gate hands over."""
        while pending is not None:
            ok = False
            try:
                ok = self._handshake(pending.sock, pending.peer, pending.deadline)
            finally:
                pending, refused = self._gate.finish(pending.address, ok, time.monotonic())
                for refusal in refused:
                    self._refuse_pending(refusal)

    def _refuse_pending(self, refusal: Refusal) -> None:
        self._refuse(refusal.pending.sock, refusal.pending.peer, refusal.cause, refusal.reason)

    def _refuse(self, sock: socket.socket, peer: str, cause: str, reason: str) -> None:
        """Close `sock`, record a ``connection_refused`` event (`reason`: a short category, `cause`: the
        line) and log it; once the events of that kind are capped (`wiiide.metrics`), one line per 1000."""
        kept = self.metrics.event("connection_refused", peer=peer, reason=reason, cause=cause[:300])
        count = self.metrics.event_counts.get("connection_refused", 0)
        if kept:
            self.log.error("refused connection from %s: %s", peer, cause[:300])
        elif count % 1000 == 0:
            self.log.error("refused %d connections so far (the last from %s: %s); by reason beyond the first "
                           "ones: %s", count, peer, cause[:300], self.metrics.events_dropped.get("connection_refused"))
        _close_quietly(sock)

    def _handshake(self, sock: socket.socket, peer: str, deadline: float) -> bool:
        """Challenge-response (`wiiide.wire.handshake.accept_hello`) by `deadline` (a time.monotonic() instant:
        accept + handshake_timeout_s, enforced on every read, whatever the peer sends and however slowly)
        and with a 64 KiB frame limit. Returns True if the peer authenticated (it is queued for `_admit`).

        Never raises: any failure, an unforeseen exception included, is a refusal with its cause logged
        and recorded.
        """
        cfg = self.cfg
        try:
            hello = accept_hello(sock, cfg, self.secret, self.metrics, self.log, peer, deadline, self.policy.pool)
            self._joining.put(_Joining(hello, rejoin_hint(hello.meta)))
            return True
        except Exception as exc:  # ProtocolError, OSError, or a bug an input found: a refusal, never a dead thread
            reason = refusal_reason(exc)
            if reason == REASON_DEADLINE:
                cause = f"handshake not complete within handshake_timeout_s={cfg.handshake_timeout_s:g} s ({exc})"
            else:
                cause = f"{'unexpected ' if reason == 'unexpected' else ''}{type(exc).__name__}: {str(exc)[:300]}"
            if reason == "unexpected":
                self.log.message("handshake with %s failed unexpectedly:\n%s", peer, traceback.format_exc())
            self._refuse(sock, peer, cause, reason)
        return False

    def _admit(self, joining: "_Joining") -> None:
        """Give an authenticated worker a rank (its old one if it comes back) and welcome it."""
        cfg = self.cfg
        # A worker that comes back (same node id) gets its old rank; a new one takes a free rank, or
        # the slot of a lost worker once every rank has been handed out.
        old = next((w for w in self.workers if not w.alive and w.node_id == joining.node_id), None)
        if old is None:
            if sum(w.alive for w in self.workers) >= cfg.num_workers:
                self._refuse(joining.conn.sock, joining.peer, f"all {cfg.num_workers} worker slots are taken",
                             "workers_full")
                return
            if len(self.workers) >= cfg.num_workers:
                old = next(w for w in self.workers if not w.alive)
        rank = old.rank if old is not None else len(self.workers) + 1
        try:
            conn = send_welcome(joining.hello, cfg, self.secret, rank, {
                "rank": rank, "world_size": cfg.num_workers + 1, "num_workers": cfg.num_workers, "model": self._spec,
                **({"ps_shards": resolve_shards(cfg.ps_shards, cfg.num_workers + 1)} if cfg.ps_shards != "1" else {}),
                **self.welcome_extra,
            }, f"worker {rank}")
        except OSError as exc:
            self._refuse(joining.conn.sock, joining.peer, f"welcome failed: {exc}", "socket")
            return
        if self.recovery is not None:
            self.recovery.note_rejoin(joining.rejoin)
        self.metrics.socket_options.append({"rank": rank, **joining.hello.options})
        if old is not None:
            old.conn, old.node_id, old.alive, old.tls_name = conn, joining.node_id, True, joining.hello.tls_name
            self.metrics.event("worker_rejoined", rank=rank, node_id=joining.node_id, peer=joining.peer,
                               step=self.metrics.steps)
            self.log.info("worker %d rejoined from %s (%s) at step %d", rank, joining.peer, joining.node_id,
                          self.metrics.steps)
        else:
            self.workers.append(WorkerSlot(rank, conn, joining.node_id, tls_name=joining.hello.tls_name))
            self.metrics.event("worker_joined", rank=rank, node_id=joining.node_id, peer=joining.peer)
            self.log.info("worker %d joined from %s (%s); %d of %d", rank, joining.peer, joining.node_id,
                          len(self.workers), cfg.num_workers)

    def _admit_waiting(self) -> None:
        """Admit every worker that finished its handshake since the last call (rejoins mid-run).

        Of the connections of a lost worker's node id, only as many of the newest as there are lost
        workers of that id are admitted; the older ones are refused (``superseded``). A worker that waited
        for its welcome longer than its handshake timeout (the coordinator busy with a long step) gave up
        on that connection and opened another: admitting the first would give its rank to a dead socket
        and refuse the live one ("all worker slots are taken"), so the worker could not get back in.
        Connections of other node ids (new workers) are admitted as they come."""
        waiting: list[_Joining] = []
        while True:
            try:
                waiting.append(self._joining.get_nowait())
            except queue.Empty:
                break
        lost = Counter(w.node_id for w in self.workers if not w.alive)
        later = Counter()  # per node id, its connections queued after the one at hand
        superseded = [False] * len(waiting)
        for i in reversed(range(len(waiting))):
            node_id = waiting[i].node_id
            superseded[i] = 0 < lost[node_id] <= later[node_id]
            later[node_id] += 1
        for joining, old in zip(waiting, superseded):
            if old:
                self._refuse(joining.conn.sock, joining.peer, f"superseded by a newer connection of node "
                             f"{joining.node_id[:64]!r}", "superseded")
            else:
                self._admit(joining)

    def _accept_workers(self, spec: dict, restarted: bool = False) -> None:
        """Wait for all `num_workers` within connect_timeout_s (NodeFailure, exit 3, if they do not come);
        a `restarted` coordinator waits rejoin_timeout_s (or connect_timeout_s) and goes on with those
        that came back, if any."""
        cfg = self.cfg
        self._spec = spec
        self._acceptor = threading.Thread(target=self._accept_loop, name="acceptor", daemon=True)
        self._acceptor.start()
        self._heartbeats = Heartbeats(lambda: [w.conn for w in self.workers if w.alive], cfg.heartbeat_interval_s).start()
        deadline = time.monotonic() + ((restarted and cfg.rejoin_timeout_s) or cfg.connect_timeout_s)
        while sum(w.alive for w in self.workers) < cfg.num_workers:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and restarted and any(w.alive for w in self.workers):
                self.log.error("restarted: %d of %d workers came back; going on with them",
                               sum(w.alive for w in self.workers), cfg.num_workers)
                return
            if remaining <= 0:
                raise NodeFailure(
                    f"only {sum(w.alive for w in self.workers)} of {cfg.num_workers} workers connected within "
                    f"connect_timeout_s={cfg.connect_timeout_s:g} s; are the workers running, pointed at this "
                    f"host and port {cfg.port}, and given the same shared secret?", EXIT_CONNECT)
            try:
                self._admit(self._joining.get(timeout=min(remaining, 0.5)))
            except queue.Empty:
                continue

    def drop(self, worker: WorkerSlot, cause: BaseException) -> None:
        """Membership: mark `worker` lost (its connection closed, a ``worker_lost`` event with `cause`).
        A worker of that node id that comes back is admitted again with its rank."""
        worker.alive = False
        worker.conn.close()
        self.metrics.event("worker_lost", rank=worker.rank, node_id=worker.node_id, cause=f"{type(cause).__name__}: {cause}")
        self.log.error("dropped worker %d: %s: %s", worker.rank, type(cause).__name__, cause)

    def members(self) -> list[WorkerSlot]:
        """Membership: every worker that joined, by rank (lost ones included, ``alive`` False)."""
        return sorted(self.workers, key=lambda w: w.rank)

    def _live(self) -> list[WorkerSlot]:
        """The live workers; when none is left, wait up to connect_timeout_s for one to come back."""
        live = [w for w in self.workers if w.alive]
        if not live:
            self.log.error("every worker is lost; waiting up to %g s for one to come back", self.cfg.connect_timeout_s)
            try:
                self._admit(self._joining.get(timeout=self.cfg.connect_timeout_s))
            except queue.Empty:
                pass
            live = [w for w in self.workers if w.alive]
            if not live:
                raise NodeFailure("every worker was lost and none came back within connect_timeout_s="
                                  f"{self.cfg.connect_timeout_s:g} s; see the events in the metrics", EXIT_PEER_LOST)
        return live

    def joining_waits(self) -> bool:
        """True when a connection that authenticated waits to be admitted (a worker coming back)."""
        return not self._joining.empty()

    def admit_waiting(self) -> None:
        """Admit every worker that finished its handshake since the last call (`_admit_waiting`)."""
        self._admit_waiting()


def _close_quietly(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass

