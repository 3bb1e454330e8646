"""The coordinator's accept and handshake path under attack, on loopback only.

Attackers connect from 127.0.0.2 (Linux routes all of 127.0.0.0/8 to lo), the real worker from
127.0.0.1, so the per-address defences of `wiiide.wire.admission` can tell them apart. The coordinator is
run in-process up to its acceptor (`_listen` + `_accept_loop`), and the test admits what it
authenticated with `_admit`, as the main loop does. No timing is asserted: outcomes, event order, and
deadlines with margins of 5-10x.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from typing import Iterator

import pytest

from wiiide.config import RunConfig
from wiiide.server.coordinator import Coordinator
from wiiide.errors import PeerClosed, ProtocolError
from wiiide.metrics import MAX_EVENTS_PER_KIND, NodeMetrics
from wiiide.wire.admission import (
    REASON_BUSY,
    REASON_DEADLINE,
    REASON_PENALIZED,
    HandshakeGate,
    Pending,
)
from wiiide.wire.auth import hello_frame, hello_mac, verify, welcome_mac
from wiiide.wire.decode import parse_header
from wiiide.wire.format import MAGIC, PREFIX, PROTOCOL_VERSION
from wiiide.wire.reader import FrameReader
from wiiide.wire.send import send_frames

SECRET = b"handshake-tests-shared-secret-0123456789"
ATTACKER = "127.0.0.2"


# --------------------------------------------------------------------------------------------------
# The gate alone, with a hand-driven clock
# --------------------------------------------------------------------------------------------------
def pending(address: str, deadline: float = 100.0) -> Pending:
    return Pending(None, address, f"{address}:1", deadline)  # type: ignore[arg-type]


def test_gate_keeps_slots_for_other_addresses_and_serves_them_round_robin():
    gate = HandshakeGate(max_active=4, max_active_per_address=2, max_waiting=10, max_waiting_per_address=3,
                         penalty_burst=100, penalty_refill_s=1.0)
    assert [gate.arrive(pending("a"), 0).action for _ in range(6)] == ["start", "start", "wait", "wait", "wait", "refuse"]
    assert gate.arrive(pending("b"), 0).action == "start"  # a holds 2 of 4: b still gets a slot
    assert gate.arrive(pending("b"), 0).action == "start"
    assert gate.arrive(pending("c"), 0).action == "wait"  # every slot taken now
    # b's slot frees: a is at its own cap, so c (not a) takes it
    nxt, refused = gate.finish("b", True, 1)
    assert nxt is not None and nxt.address == "c" and refused == []
    nxt, _ = gate.finish("a", True, 1)
    assert nxt is not None and nxt.address == "a"
    assert gate.counts() == {"active": 4, "waiting": 2, "addresses": 3}


def test_gate_refuses_waiting_connections_at_their_deadline():
    gate = HandshakeGate(max_active=1, max_active_per_address=1, max_waiting=10, max_waiting_per_address=10,
                         penalty_burst=100, penalty_refill_s=1.0)
    assert gate.arrive(pending("a", 5), 0).action == "start"
    assert gate.arrive(pending("a", 5), 0).action == "wait"
    assert gate.expire(4.9) == []
    [refusal] = gate.expire(5.0)
    assert refusal.reason == REASON_DEADLINE and "deadline" in refusal.cause
    assert gate.counts()["waiting"] == 0


def test_gate_penalizes_an_address_that_keeps_failing_then_forgives_it():
    gate = HandshakeGate(max_active=8, max_active_per_address=4, max_waiting=10, max_waiting_per_address=10,
                         penalty_burst=3, penalty_refill_s=10.0)
    for _ in range(3):
        assert gate.arrive(pending("a"), 0).action == "start"
        gate.finish("a", False, 0)
    decision = gate.arrive(pending("a"), 0)
    assert decision.action == "refuse" and decision.refusal.reason == REASON_PENALIZED
    assert gate.arrive(pending("b"), 0).action == "start"  # another address is not affected
    assert gate.arrive(pending("a"), 10.0).action == "start"  # one token earned back after penalty_refill_s


def test_gate_forgets_the_least_recent_addresses_beyond_its_bound():
    gate = HandshakeGate(max_active=1, max_active_per_address=1, max_waiting=0, max_waiting_per_address=0,
                         penalty_burst=1, penalty_refill_s=1.0, max_addresses=50)
    for i in range(500):
        address = f"10.0.{i // 256}.{i % 256}"
        if gate.arrive(pending(address), 0).action == "start":
            gate.finish(address, False, 0)
    assert gate.counts()["addresses"] == 50


# --------------------------------------------------------------------------------------------------
# Header parser and MACs: what used to escape as another exception
# --------------------------------------------------------------------------------------------------
def header_text(shape_literal: str, raw_nbytes_literal: str = "16") -> bytes:
    return ('{"kind":"hello","meta":{},"codec":"none","raw_nbytes":' + raw_nbytes_literal +
            ',"tensors":[{"name":"t","dtype":"float32","shape":' + shape_literal + '}]}').encode()


def test_eight_dimensions_of_ten_to_the_600_are_a_protocol_error():
    with pytest.raises(ProtocolError, match="more than"):
        parse_header(header_text("[" + ",".join(["1" + "0" * 600] * 8) + "]"), 1 << 20)


@pytest.mark.parametrize("escaped", ['"\\ud800"', '"a\\udfffb"', '{"\\udbff": 1}'])
def test_lone_surrogates_anywhere_in_a_header_are_a_protocol_error(escaped):
    text = '{"kind":"hello","meta":{"node_id":' + escaped + '},"codec":"none","raw_nbytes":0,"tensors":[]}'
    with pytest.raises(ProtocolError, match="surrogate"):
        parse_header(text.encode(), 1 << 20)


def test_a_surrogate_pair_is_a_character_not_an_error():
    text = '{"kind":"hello","meta":{"node_id":"\\ud83d\\ude00"},"codec":"none","raw_nbytes":0,"tensors":[]}'
    assert parse_header(text.encode(), 1 << 20)["meta"]["node_id"] == "\U0001F600"


def test_utf8_encoded_surrogates_are_not_utf8():
    text = '{"kind":"hello","meta":{"node_id":"X"},"codec":"none","raw_nbytes":0,"tensors":[]}'.encode()
    with pytest.raises(ProtocolError, match="UTF-8"):
        parse_header(text.replace(b"X", "\ud800".encode("utf-8", "surrogatepass")), 1 << 20)


def test_macs_of_any_string_and_any_received_mac_raise_only_protocol_error():
    mac = hello_mac(SECRET, PROTOCOL_VERSION, "a" * 64, "b" * 64, "node-\ud800")  # no UnicodeEncodeError
    assert len(mac) == 64
    for received in ["\udfff" * 64, mac.upper(), 10**600, None, mac[:-1]]:
        with pytest.raises(ProtocolError, match="authentication failed"):
            verify(mac, received, "hello")
    verify(mac, mac, "hello")


# --------------------------------------------------------------------------------------------------
# Events capped
# --------------------------------------------------------------------------------------------------
def test_events_are_capped_per_kind_and_counted_by_reason(tmp_path):
    metrics = NodeMetrics("coordinator", "unit")
    for i in range(3 * MAX_EVENTS_PER_KIND):
        metrics.event("connection_refused", peer=f"x:{i}", reason="penalized" if i % 3 else "deadline", cause="c" * 300)
    metrics.event("worker_lost", rank=1)  # after the flood: still kept
    for i in range(100):
        metrics.event("connection_refused", reason=f"made-up-{i}")  # reasons are bounded, too
    kinds = [e["event"] for e in metrics.events]
    assert kinds.count("connection_refused") == MAX_EVENTS_PER_KIND and kinds[-1] == "worker_lost"
    assert metrics.event_counts == {"connection_refused": 3 * MAX_EVENTS_PER_KIND + 100, "worker_lost": 1}
    dropped = metrics.events_dropped["connection_refused"]
    assert dropped["penalized"] + dropped["deadline"] == 2 * MAX_EVENTS_PER_KIND
    assert sum(dropped.values()) == 2 * MAX_EVENTS_PER_KIND + 100 and len(dropped) <= 32 + 1
    path = metrics.write(tmp_path, "ok")
    data = json.loads(path.read_text())
    assert data["event_counts"]["connection_refused"] == 3 * MAX_EVENTS_PER_KIND + 100
    assert path.stat().st_size < 200_000


# --------------------------------------------------------------------------------------------------
# The coordinator's acceptor under attack
# --------------------------------------------------------------------------------------------------
ACCEPTOR_FIELDS = {"num_workers": 1, "handshake_timeout_s": 2.0, "max_handshakes": 4, "log_tier": "silent"}


@pytest.fixture
def acceptor(tmp_path, free_port) -> Iterator[Coordinator]:
    """A coordinator listening on 127.0.0.1:free_port with its acceptor thread running (no training)."""
    yield from running_acceptor(RunConfig(port=free_port, metrics_dir=str(tmp_path / "metrics"), **ACCEPTOR_FIELDS))


def running_acceptor(cfg: RunConfig) -> Iterator[Coordinator]:
    """A coordinator of `cfg` up to its acceptor thread (the body of the `acceptor` fixtures)."""
    node = Coordinator(cfg)
    node.secret = SECRET
    node._spec = {"hidden_sizes": [8]}
    node._listen()
    thread = threading.Thread(target=node._accept_loop, daemon=True)
    thread.start()
    try:
        yield node
    finally:
        node._closing.set()
        node.listener.close()
        thread.join(timeout=10)


def connect(port: int, source: str = "127.0.0.1", timeout_s: float = 30.0) -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(timeout_s)
    sock.connect(("127.0.0.1", port))
    return sock


def worker_handshake(node: Coordinator, port: int, node_id: str = "real") -> str:
    """A real worker's side (challenge -> hello with the MAC -> welcome) while the test plays the main
    thread's `_admit`; returns the kind of the answer (welcome or refused)."""
    with connect(port) as sock:
        reader = FrameReader(sock, 1 << 20)
        nonce_c = reader.read_message().meta["nonce"]
        hello, nonce_w = hello_frame(SECRET, nonce_c, node_id)
        send_frames(sock, [hello])
        node._admit(node._joining.get(timeout=30))
        answer = reader.read_message()
        if answer.kind == "welcome":
            verify(welcome_mac(SECRET, PROTOCOL_VERSION, nonce_w, nonce_c, answer.meta["rank"]), answer.meta["mac"], "w")
        return answer.kind


class Slowloris(threading.Thread):
    """Sends a frame prefix announcing a 4 GiB payload, one byte per `interval_s`, until closed."""

    def __init__(self, port: int, interval_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.sock = connect(port, ATTACKER)
        self.interval_s = interval_s
        self.bytes_sent = 0
        self.closed_by_peer = threading.Event()

    def run(self) -> None:
        data = PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, 64, 4 << 30) + b"{" * 1000
        try:
            for byte in data:
                self.sock.send(bytes([byte]))
                self.bytes_sent += 1
                readable, _, _ = select.select([self.sock], [], [], self.interval_s)
                if readable and not self.sock.recv(1 << 16):  # the challenge, then EOF once closed
                    break
        except OSError:
            pass
        self.closed_by_peer.set()
        self.sock.close()


def refusals(node: Coordinator) -> list[dict]:
    return [e for e in node.metrics.events if e["event"] == "connection_refused"]


def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    """Poll `condition` until it holds; a generous deadline, not a timing assertion."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s:g} s"
        time.sleep(0.02)


def test_slowloris_is_dropped_at_the_deadline_and_a_worker_is_admitted_meanwhile(acceptor):
    node, port = acceptor, acceptor.cfg.port
    lorises = [Slowloris(port) for _ in range(6)]  # more than max_handshakes=4
    for loris in lorises:
        loris.start()
    wait_for(lambda: sum(node._gate.counts()[k] for k in ("active", "waiting")) == 6, "six accepted connections")
    assert node._gate.counts()["active"] == 2  # the address holds half the slots (max_handshakes=4); 4 wait
    assert worker_handshake(node, port) == "welcome"
    for loris in lorises:  # deadline 2 s; old behaviour: held for as long as the bytes trickle in
        assert loris.closed_by_peer.wait(30), f"slowloris still connected after {loris.bytes_sent} bytes"
    events = [e["event"] for e in node.metrics.events]
    assert events.index("worker_joined") < events.index("connection_refused")
    causes = refusals(node)
    assert len(causes) == 6 and all(e["peer"].startswith(ATTACKER) and e["reason"] == REASON_DEADLINE for e in causes)
    # refused at their deadline: the 2 holding a slot while reading, the others while waiting (or at
    # once when a freed slot reached them a moment before their own deadline)
    held = [e for e in causes if "handshake_timeout_s=2" in e["cause"]]
    waited = [e for e in causes if "waited for a handshake slot" in e["cause"]]
    assert len(held) >= 2 and len(waited) >= 1 and len(held) + len(waited) == 6
    # every slot freed (a slot thread records its refusal just before it gives the slot back)
    wait_for(lambda: node._gate.counts()["active"] == 0, "every slot freed")
    assert node._gate.counts() == {"active": 0, "waiting": 0, "addresses": 2}


def test_a_flood_of_junk_from_one_address_does_not_stop_a_worker(acceptor):
    node, port = acceptor, acceptor.cfg.port
    flood: list[socket.socket] = []
    for i in range(300):
        try:
            sock = connect(port, ATTACKER, timeout_s=5)
            sock.send(b"GET / HTTP/1.1\r\n\r\n" if i % 2 else b"\x00" * 3)
            flood.append(sock)
        except OSError:
            pass
    assert len(flood) >= 250
    assert worker_handshake(node, port) == "welcome"
    for sock in flood:
        sock.close()
    joined = [e for e in node.metrics.events if e["event"] == "worker_joined"]
    assert len(joined) == 1 and joined[0]["peer"].startswith("127.0.0.1:")
    counts = node.metrics.event_counts["connection_refused"]
    kept = refusals(node)
    assert len(kept) == MAX_EVENTS_PER_KIND  # capped, the rest counted by reason
    dropped = node.metrics.events_dropped["connection_refused"]
    assert counts == len(kept) + sum(dropped.values())
    assert dropped.get(REASON_PENALIZED, 0) > 0  # the address was slowed down
    assert {e["reason"] for e in kept} <= {"protocol", REASON_PENALIZED, REASON_BUSY, "socket", REASON_DEADLINE}


def raw_frame(header: bytes) -> bytes:
    return PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, len(header), 0) + header


def hello_header(node_id_json: str, mac_json: str) -> bytes:
    return ('{"kind":"hello","meta":{"protocol_version":1,"node_id":' + node_id_json + ',"nonce":"' + "a" * 64 +
            '","mac":' + mac_json + '},"codec":"none","raw_nbytes":0,"tensors":[]}').encode()


@pytest.mark.parametrize("frame, needle", [
    (raw_frame(hello_header('"\\ud800"', '"' + "0" * 64 + '"')), "surrogate"),
    (raw_frame(hello_header('"w1"', '"' + "\\udfff" * 64 + '"')), "surrogate"),
    (raw_frame(header_text("[" + ",".join(["1" + "0" * 600] * 8) + "]", "0")), "more than"),
    (raw_frame(header_text("[1]", "1" + "0" * 5000)), "not valid UTF-8 JSON"),  # beyond int's 4300 digits
], ids=["surrogate node_id", "surrogate mac", "8 dims of 10^600", "5000-digit raw_nbytes"])
def test_bad_unicode_and_huge_integers_give_a_logged_refusal_and_the_coordinator_goes_on(acceptor, frame, needle):
    from tests.unit.test_nodes import capture_log

    node, port = acceptor, acceptor.cfg.port
    node.log.logger.setLevel("ERROR")
    with capture_log("wiiide.coordinator") as records:
        with connect(port, ATTACKER) as sock:
            FrameReader(sock, 1 << 20).read_message()  # the challenge
            sock.sendall(frame)
            while sock.recv(1 << 16):  # a refused frame, then EOF: closed by the coordinator
                pass
        wait_for(lambda: refusals(node), "the refusal's event")
        assert worker_handshake(node, port) == "welcome"  # the acceptor still serves
        # the log line follows the event on the handshake thread: wait for it too
        wait_for(lambda: any("refused connection from 127.0.0.2" in r and needle in r for r in records),
                 "the refusal's log line")
    [refusal] = refusals(node)
    assert needle in refusal["cause"] and refusal["reason"] == "protocol"


def test_a_read_deadline_bounds_a_frame_that_trickles_in(sock_pair):
    """One byte per 0.2 s would take 3.2 s for a prefix; the read gives up at its 0.5 s deadline."""
    from wiiide.wire.format import DeadlineExceeded

    writer, reader_sock = sock_pair
    sent: list[int] = []
    done = threading.Event()

    def trickle() -> None:
        for byte in PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, 64, 4 << 30):
            try:
                writer.send(bytes([byte]))
            except OSError:
                return
            sent.append(byte)
            if done.wait(0.2):
                return

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    reader_sock.settimeout(60.0)  # per recv: would never fire while bytes keep coming
    with pytest.raises(DeadlineExceeded, match="deadline passed"):
        FrameReader(reader_sock, 1 << 20).read_message(deadline=time.monotonic() + 0.5)
    assert len(sent) < 16  # it gave up before the prefix was complete
    done.set()
    assert reader_sock.gettimeout() == 60.0  # the socket's own timeout is restored
    thread.join(timeout=10)


def test_an_unforeseen_exception_in_a_handshake_is_a_logged_refusal(acceptor, monkeypatch):
    """A bug an input finds (here: verify raising RuntimeError) refuses that peer; the next one joins."""
    from tests.unit.test_nodes import capture_log

    node, port = acceptor, acceptor.cfg.port
    calls: list[int] = []

    def broken_verify(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return verify(*args, **kwargs)

    monkeypatch.setattr("wiiide.wire.handshake.verify", broken_verify)
    with capture_log("wiiide.coordinator") as records:
        with connect(port) as sock:
            reader = FrameReader(sock, 1 << 20)
            send_frames(sock, [hello_frame(SECRET, reader.read_message().meta["nonce"], "first")[0]])
            answer = reader.read_message()
        assert answer.kind == "refused" and "boom" in answer.meta["reason"]
        assert worker_handshake(node, port, "second") == "welcome"
        wait_for(lambda: refusals(node), "the refusal's event")  # recorded just after the refused frame
        # the log line follows the event on the handshake thread: wait for it too
        wait_for(lambda: any("unexpected RuntimeError: boom" in r for r in records), "the refusal's log line")
    [refusal] = refusals(node)
    assert refusal["reason"] == "unexpected" and "RuntimeError: boom" in refusal["cause"]


def test_of_two_waiting_connections_of_a_lost_worker_only_the_newest_is_admitted(tmp_path, free_port):
    """A lost worker that gave up waiting for its welcome (the coordinator busy with a long step) and
    came again has two authenticated connections queued: the older is refused as superseded, the newer
    gets the worker's old rank, and the queue is empty after. Two new workers of one node id (e.g. one
    host name) are both admitted, as before."""
    cfg = RunConfig(port=free_port, metrics_dir=str(tmp_path / "metrics"), **{**ACCEPTOR_FIELDS, "num_workers": 2})

    def queue_hellos(node_id: str, count: int) -> list:
        readers = []
        for _ in range(count):  # each connection's hello, nobody admitted yet
            sock = connect(free_port)
            reader = FrameReader(sock, 1 << 20)
            hello, _ = hello_frame(SECRET, reader.read_message().meta["nonce"], node_id)
            send_frames(sock, [hello])
            readers.append(reader)
        deadline = time.monotonic() + 30
        while node._joining.qsize() < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return readers

    for node in running_acceptor(cfg):
        assert worker_handshake(node, free_port, "comes-again") == "welcome"  # rank 1
        node.workers[0].alive = False  # lost
        older, newer = queue_hellos("comes-again", 2)
        node._admit_waiting()
        answer = newer.read_message()
        assert answer.kind == "welcome" and answer.meta["rank"] == 1
        with pytest.raises((PeerClosed, ConnectionError)):
            older.read_message()  # closed without a welcome
        assert [(w.rank, w.node_id, w.alive) for w in node.workers] == [(1, "comes-again", True)]
        assert node._joining.empty()
        refused = [e for e in node.metrics.events if e["event"] == "connection_refused"]
        assert [e["reason"] for e in refused] == ["superseded"]
        older.sock.close()
        newer.sock.close()
    for node in running_acceptor(RunConfig(port=free_port, metrics_dir=str(tmp_path / "m2"),
                                           **{**ACCEPTOR_FIELDS, "num_workers": 2})):
        first, second = queue_hellos("one-host", 2)  # two new workers, one node id
        node._admit_waiting()
        assert sorted(r.read_message().meta["rank"] for r in (first, second)) == [1, 2]
        first.sock.close()
        second.sock.close()
