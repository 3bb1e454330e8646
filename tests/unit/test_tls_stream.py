"""The TLS transport (`wiiide.wire.tls_stream.TLSStream`: `ssl.SSLObject` + `ssl.MemoryBIO` over a plain socket), on
loopback with real certificates from `harness.run.certs` (test_tls.py's fixture): frames of several sizes both ways, a changed
record refused with a clear error, a heartbeat thread writing while the main thread reads, a trickled
record cut at the read deadline, the peer's end. No timing is asserted.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from typing import Iterator

import numpy as np
import pytest

from tests.unit.test_tls import node_cfg, pki  # noqa: F401 (pki: the cluster's certificates, a fixture)
from wiiide.config import RunConfig
from wiiide.errors import PeerClosed
from wiiide.log import TieredLog
from wiiide.metrics import NodeMetrics
from wiiide.wire.node import Connection
from wiiide.wire.encode import encode_message
from wiiide.wire.format import DeadlineExceeded
from wiiide.wire.messages import WireTensor
from wiiide.wire.reader import FrameReader
from wiiide.wire.send import send_frames
from wiiide.wire.tls import wrap_client, wrap_server
from wiiide.wire.tls_stream import RECV_CIPHERTEXT_BYTES, TLSRecordError, TLSStream


@pytest.fixture
def streams(pki) -> Iterator[tuple[TLSStream, TLSStream]]:  # noqa: F811 (the fixture imported above)
    """(client, server): the two ends of one TLS connection over 127.0.0.1, each with a 10 s timeout."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        served: list = []
        server_thread = threading.Thread(target=lambda: served.append(
            wrap_server(listener.accept()[0], node_cfg(pki, "coordinator"))), daemon=True)
        server_thread.start()
        client = wrap_client(socket.create_connection(listener.getsockname()), node_cfg(pki, "worker-1"), "127.0.0.1")
        server_thread.join(timeout=30)
    server = served[0]
    assert isinstance(client, TLSStream) and isinstance(server, TLSStream)
    for end in (client, server):
        end.settimeout(10.0)
    yield client, server
    client.close()
    server.close()


def tensor_of(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.mark.parametrize("direction", ["client_to_server", "server_to_client"])
def test_frames_of_several_sizes_arrive_intact(streams, direction):
    client, server = streams
    writer, reader_end = (client, server) if direction == "client_to_server" else (server, client)
    assert writer.version() == "TLSv1.3" and reader_end.getpeercert()
    # around the 16 KiB record, the 64 KiB join limit, the receive buffer, and several of them
    sizes = [0, 1, 16 * 1024 - 1, 16 * 1024 + 1, 64 * 1024, RECV_CIPHERTEXT_BYTES + 3, 3 * RECV_CIPHERTEXT_BYTES]
    sent = [tensor_of(n, i) for i, n in enumerate(sizes)]
    frames = [encode_message("gradients", {"i": i}, [WireTensor("g", a)]) for i, a in enumerate(sent)]

    def send() -> None:
        send_frames(writer, frames[:2])  # two frames in one call
        for frame in frames[2:]:
            send_frames(writer, [frame])

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    reader = FrameReader(reader_end, 1 << 26)
    for i, want in enumerate(sent):
        msg = reader.read_message()
        assert msg.meta == {"i": i}
        np.testing.assert_array_equal(msg.tensor("g"), want)
    sender.join(timeout=30)
    assert reader_end.pending() == 0


def test_a_record_changed_on_the_way_is_refused_with_a_clear_error(streams):
    client, server = streams
    send_frames(client, [encode_message("heartbeat")])
    assert FrameReader(server, 1 << 20).read_message().kind == "heartbeat"
    # what an attacker on the path does: the client's next record, one ciphertext byte flipped
    client._tls.write(bytes(encode_message("gradients", {}, [WireTensor("g", tensor_of(4096, 1))]).buffers[0]))
    record = bytearray(client._outgoing.read())
    record[len(record) // 2] ^= 0x01
    client._sock.sendall(record)
    with pytest.raises(TLSRecordError, match="TLS record from the peer refused.*BAD_RECORD_MAC|bad record mac") as info:
        FrameReader(server, 1 << 20).read_message()
    assert isinstance(info.value, ssl.SSLError) and isinstance(info.value, OSError)  # callers close on OSError
    assert "connection is closed" in str(info.value)
    # the server told the client why: OpenSSL's alert
    with pytest.raises(TLSRecordError, match="the peer ended the TLS connection with an alert: .*BAD_RECORD_MAC"):
        FrameReader(client, 1 << 20).read_message()


def test_a_heartbeat_thread_may_write_while_the_main_thread_reads(streams):
    client, server = streams
    cfg = RunConfig(log_tier="silent")
    log = TieredLog(cfg, "coordinator")
    conn = Connection(server, cfg, NodeMetrics("coordinator", "c"), log, "client")
    payloads = [tensor_of(256 * 1024 + i, i) for i in range(24)]
    heartbeats_sent = 300

    def heartbeat_thread() -> None:  # what wiiide.wire.node.Heartbeats does, as often as it can
        for _ in range(heartbeats_sent):
            conn.send([encode_message("heartbeat")])
        conn.send([encode_message("done")])

    def client_side(counts: dict) -> None:  # sends big frames while reading the heartbeats
        reader = FrameReader(client, 1 << 20)
        for i, a in enumerate(payloads):
            send_frames(client, [encode_message("gradients", {"i": i}, [WireTensor("g", a)])])
        while (kind := reader.read_message().kind) == "heartbeat":
            counts["heartbeats"] += 1
        counts["last"] = kind

    counts = {"heartbeats": 0}
    threads = [threading.Thread(target=heartbeat_thread, daemon=True),
               threading.Thread(target=client_side, args=(counts,), daemon=True)]
    for t in threads:
        t.start()
    for i, want in enumerate(payloads):  # the main thread reads while the heartbeat thread writes
        msg = conn.receive(["gradients"])
        assert msg.meta == {"i": i}
        np.testing.assert_array_equal(msg.tensor("g"), want)
    for t in threads:
        t.join(timeout=60)
    assert counts == {"heartbeats": heartbeats_sent, "last": "done"}


def test_a_record_trickled_one_byte_at_a_time_is_cut_at_the_read_deadline(streams):
    client, server = streams
    client._tls.write(bytes(encode_message("heartbeat", {"pad": "x" * 60}).buffers[0]))
    record = client._outgoing.read()
    client._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each byte its own segment
    stop, sent = threading.Event(), []

    def trickle() -> None:
        for byte in record:
            if stop.wait(0.05):
                return
            client._sock.send(bytes([byte]))
            sent.append(byte)

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    try:  # each byte comes well within the socket's timeout, but the record takes 5 s; the deadline is 1 s
        with pytest.raises(DeadlineExceeded):
            FrameReader(server, 1 << 20).read_message(deadline=time.monotonic() + 1.0)
        assert len(sent) < len(record), "the reader waited for the whole trickled record"
    finally:
        stop.set()
        trickler.join(timeout=10)
    assert server.gettimeout() == 10.0  # the reader restored the timeout it found


def test_the_peers_end_between_and_within_frames(streams):
    client, server = streams
    frame = encode_message("gradients", {}, [WireTensor("g", tensor_of(100_000, 3))])
    client._tls.write(bytes(frame.buffers[0]))
    client._tls.write(bytes(frame.buffers[1])[:50_000])  # half a frame, then the TCP connection ends
    client._sock.sendall(client._outgoing.read())
    client._sock.shutdown(socket.SHUT_WR)
    with pytest.raises(PeerClosed, match="middle of a frame"):
        FrameReader(server, 1 << 20).read_message()
    with pytest.raises(PeerClosed, match="^peer closed the connection$"):
        FrameReader(server, 1 << 20).read_message()


def test_a_frame_read_ahead_is_seen_by_the_pace_servers_wait(streams):
    import selectors
    from types import SimpleNamespace

    from wiiide.server.pace.server import PaceServer

    client, server = streams
    cfg = RunConfig(log_tier="silent")
    conn = Connection(server, cfg, NodeMetrics("coordinator", "c"), TieredLog(cfg, "coordinator"), "worker 1")
    send_frames(client, [encode_message("gradients", {"i": 2}), encode_message("gradients", {"i": 3})])  # one write
    assert conn.receive().meta == {"i": 2}
    assert conn.buffered_nbytes() > 0  # frame 3 was read from the socket with frame 2
    with selectors.DefaultSelector() as selector:
        worker = SimpleNamespace(rank=1)
        selector.register(server, selectors.EVENT_READ, (worker, conn))
        assert selector.select(timeout=0.2) == []  # the socket has nothing more: select alone would wait
        ready = PaceServer._ready(SimpleNamespace(_selector=selector), 0.2)
    assert ready == [(worker, conn)]
    assert conn.receive().meta == {"i": 3} and conn.buffered_nbytes() == 0
