"""`wiiide.wire.node.close_after_delivery`: a coordinator's last frames reach a worker that is slow to read
them, however many bytes the worker sent that the coordinator never read; a peer that never takes
them is closed after the idle timeout and named."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from wiiide.wire.node import HEARTBEAT, close_after_delivery, unsent_nbytes
from wiiide.wire.encode import encode_message
from wiiide.wire.messages import WireTensor

PARAMS_BYTES = 8 << 20  # more than the kernel's default buffers of a loopback pair hold


def _stop_with_params() -> tuple:
    params = np.arange(PARAMS_BYTES // 4, dtype=np.float32)
    return encode_message("stop", {"reason": "finished"}, [WireTensor("params", params)]), params


def test_a_slow_reader_gets_the_whole_stop_although_its_heartbeats_were_never_read(conn_pair):
    coord, worker = conn_pair
    for _ in range(20):
        worker.send([HEARTBEAT])  # bytes the coordinator never reads: a plain close would reset
    stop, params = _stop_with_params()
    out: dict = {}

    def coordinator_ends() -> None:
        coord.send([stop])  # returns once the kernel holds the rest
        out["stale"] = close_after_delivery([coord], idle_timeout_s=10.0)

    thread = threading.Thread(target=coordinator_ends)
    thread.start()
    time.sleep(0.3)  # the worker is still busy: the coordinator's half-close comes first
    msg = worker.receive(["stop"])
    worker.close()
    thread.join(10)
    assert not thread.is_alive() and out["stale"] == []
    np.testing.assert_array_equal(msg.tensor("params"), params)
    assert coord.sock.fileno() == -1  # closed


def test_a_peer_that_never_takes_its_frames_is_closed_after_the_idle_timeout_and_named(conn_pair):
    coord, worker = conn_pair
    stop, _ = _stop_with_params()
    def send_stop() -> None:
        try:
            coord.send([stop])  # blocks: the worker never reads
        except OSError:
            pass  # the socket was closed under it

    thread = threading.Thread(target=send_stop)
    thread.start()
    deadline = time.monotonic() + 5
    while (unsent_nbytes(coord.sock) or 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert unsent_nbytes(coord.sock) > 0
    stale = close_after_delivery([coord], idle_timeout_s=0.3)
    thread.join(10)  # the blocked send fails once the socket is closed
    assert stale == ["worker 1"]
    assert coord.sock.fileno() == -1


def test_a_peer_that_is_already_gone_is_closed_without_waiting_and_not_named(conn_pair):
    coord, worker = conn_pair
    worker.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    worker.close()  # linger 0: a reset
    time.sleep(0.05)
    assert close_after_delivery([coord], idle_timeout_s=30.0) == []
    assert coord.sock.fileno() == -1
