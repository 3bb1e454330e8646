"""Coordinator and worker: run_node's life cycle in-process, and whole runs on loopback.

Subprocess tests run ``python -m wiiide coordinator|worker`` configured by WIIIIIDE_* variables, each bounded
by a timeout. In-process tests run the coordinator in the main thread (run_node installs a SIGTERM handler)
and scripted peers in threads; the peers speak the authenticated handshake of `wiiide.wire.auth`
(challenge -> hello with an HMAC -> welcome with an HMAC) with the test's shared secret.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Union

import numpy as np
import pytest
import torch
from torch import nn

from wiiide.config import RunConfig
from wiiide.server.coordinator import Coordinator
from wiiide.errors import ConfigError, PeerClosed, ProtocolError
from wiiide.log import TieredLog
from wiiide.metrics import NodeMetrics
from wiiide.training.model import FlatParams, build_mlp, model_spec
from wiiide.wire.node import (
    EXIT_CONNECT,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_PEER_LOST,
    EXIT_TERMINATED,
    NodeFailure,
    run_node,
)
from wiiide.wire.auth import hello_mac, new_nonce, verify, welcome_mac
from wiiide.wire.encode import encode_message
from wiiide.wire.format import MAGIC, PREFIX, PROTOCOL_VERSION
from wiiide.wire.messages import Message, WireTensor
from wiiide.wire.reader import FrameReader
from wiiide.wire.send import send_frames

MIB = 1024 * 1024
SECRET = "unit-tests-shared-secret-0123456789"  # what node_env gives the subprocesses, too
SECRET_BYTES = SECRET.encode()


@pytest.fixture(autouse=True)
def shared_secret(monkeypatch):
    """In-process nodes read the shared secret from the environment (wiiide.wire.auth.load_secret)."""
    monkeypatch.setenv("WIIIIIDE_SECRET", SECRET)


def read_json(path: Path) -> dict[str, Any]:
    assert path.exists(), f"missing {path}; folder holds {sorted(p.name for p in path.parent.glob('*'))}"
    return json.loads(path.read_text())


def connect_retry(port: int, timeout_s: float = 20.0) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
            sock.settimeout(timeout_s)
            return sock
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def wait_closed_by_peer(sock: socket.socket) -> bool:
    """Read until the peer closes; True if it did (EOF or reset) before the socket's timeout."""
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def read_skipping_heartbeats(reader: FrameReader) -> Message:
    while True:
        msg = reader.read_message()
        if msg.kind != "heartbeat":
            return msg


def frame_bytes(kind: str, meta: dict) -> bytes:
    return b"".join(bytes(b) for b in encode_message(kind, meta).buffers)


@contextlib.contextmanager
def capture_log(name: str):
    """Collect the messages of a wiiide logger (it does not propagate, so caplog cannot see it)."""
    records: list[str] = []

    class ListHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = ListHandler(level=logging.DEBUG)
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


# --------------------------------------------------------------------------------------------------
# run_node in-process
# --------------------------------------------------------------------------------------------------
def node_cfg(tmp_path: Path, **fields: Any) -> RunConfig:
    return RunConfig(metrics_dir=str(tmp_path / "metrics"), log_tier="silent", **fields)


def run_main(tmp_path: Path, main: Callable[[], None], **cfg_fields: Any) -> tuple[int, dict[str, Any]]:
    cfg = node_cfg(tmp_path, **cfg_fields)
    metrics = NodeMetrics("worker", "unit")
    metrics.rank = 5
    code = run_node(cfg, metrics, TieredLog(cfg, "unit"), main)
    return code, read_json(tmp_path / "metrics" / "worker-5.json")


def test_run_node_ok(tmp_path):
    code, data = run_main(tmp_path, lambda: None)
    assert code == EXIT_OK and data["status"] == "ok" and data["error"] is None


@pytest.mark.parametrize("exc, code, needle", [
    (NodeFailure("no coordinator", EXIT_CONNECT), EXIT_CONNECT, "no coordinator"),
    (NodeFailure("generic"), EXIT_ERROR, "generic"),
    (ConfigError("config field 'port'"), 2, "'port'"),
    (ProtocolError("bad magic"), EXIT_ERROR, "ProtocolError: bad magic"),
    (PeerClosed("gone"), EXIT_ERROR, "PeerClosed: gone"),
    (ConnectionResetError("reset"), EXIT_ERROR, "ConnectionResetError: reset"),
])
def test_run_node_errors_become_exit_codes(tmp_path, exc, code, needle):
    def main() -> None:
        raise exc

    got, data = run_main(tmp_path, main)
    assert got == code
    assert data["status"] == "failed" and needle in data["error"]


def test_run_node_sigterm_writes_terminated_and_restores_handler(tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    seen: list[str] = []

    def main() -> None:
        seen.append("started")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # interrupted by the handler
        seen.append("not reached")

    code, data = run_main(tmp_path, main)
    assert code == EXIT_TERMINATED == 143
    assert seen == ["started"]
    assert data["status"] == "terminated" and "SIGTERM" in data["error"]
    assert signal.getsignal(signal.SIGTERM) is previous


def test_run_node_unwritable_metrics_dir_is_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cfg = RunConfig(metrics_dir=str(blocker / "metrics"), log_tier="silent")
    assert run_node(cfg, NodeMetrics("worker", "x"), TieredLog(cfg, "unit"), lambda: None) == EXIT_ERROR


def test_run_node_unexpected_exception_still_writes_metrics(tmp_path):
    def main() -> None:
        raise ValueError("unexpected")

    code, data = run_main(tmp_path, main)
    assert code == EXIT_ERROR
    assert data["status"] == "failed" and "unexpected" in data["error"]


# --------------------------------------------------------------------------------------------------
# In-process coordinator with scripted peers
# --------------------------------------------------------------------------------------------------
Stranger = Union[bytes, Callable[[socket.socket], None]]


def authenticate(sock: socket.socket, node_id: str = "fake", secret: bytes = SECRET_BYTES) -> tuple[FrameReader, Message]:
    """The worker's side of the handshake: challenge -> hello (HMAC) -> welcome (HMAC checked)."""
    reader = FrameReader(sock, 64 * MIB)
    challenge = read_skipping_heartbeats(reader)
    assert challenge.kind == "challenge" and challenge.meta["protocol_version"] == PROTOCOL_VERSION
    nonce_c, nonce_w = challenge.meta["nonce"], new_nonce()
    send_frames(sock, [encode_message("hello", {
        "protocol_version": PROTOCOL_VERSION, "node_id": node_id, "nonce": nonce_w,
        "mac": hello_mac(secret, PROTOCOL_VERSION, nonce_c, nonce_w, node_id)})])
    welcome = read_skipping_heartbeats(reader)
    if welcome.kind == "welcome":
        verify(welcome_mac(secret, PROTOCOL_VERSION, nonce_w, nonce_c, welcome.meta["rank"]), welcome.meta["mac"],
               "welcome")
    return reader, welcome


class ScriptedPeers(threading.Thread):
    """Strangers first (each sends its bytes, or runs its script, then waits to be closed), then one
    scripted worker that answers every batch with a zero gradient whose meta is `gradient_meta(step)`."""

    def __init__(self, port: int, strangers: list[Stranger], gradient_meta: Callable[[int], dict]) -> None:
        super().__init__(daemon=True)
        self.port, self.strangers, self.gradient_meta = port, strangers, gradient_meta
        self.strangers_closed: list[bool] = []
        self.steps_answered = 0
        self.ended_by: str = ""

    def run(self) -> None:
        try:
            for stranger in self.strangers:
                with connect_retry(self.port) as s:
                    if isinstance(stranger, bytes):
                        s.sendall(stranger)
                    else:
                        stranger(s)
                    self.strangers_closed.append(wait_closed_by_peer(s))
            with connect_retry(self.port) as s:
                reader, welcome = authenticate(s)
                assert welcome.kind == "welcome"
                numel = 0
                while True:
                    msg = read_skipping_heartbeats(reader)
                    if msg.kind == "stop":
                        self.ended_by = "stop"
                        return
                    if msg.kind == "params":
                        numel = msg.tensor("params").size
                        continue
                    step = msg.meta["step"]
                    send_frames(s, [encode_message("gradients", self.gradient_meta(step),
                                                   [WireTensor("grad", np.zeros(numel, np.float32))])])
                    self.steps_answered += 1
        except (OSError, ProtocolError, AssertionError) as exc:
            self.ended_by = f"{type(exc).__name__}: {exc}"


def run_coordinator_with(tmp_path: Path, port: int, strangers: list[Stranger], gradient_meta: Callable[[int], dict],
                         **cfg_fields: Any) -> tuple[int, dict[str, Any], ScriptedPeers]:
    # the scripted peers speak the central server's protocol (a gradients frame per step)
    fields = dict(port=port, num_workers=1, max_steps=3, hidden_sizes=(8,), connect_timeout_s=20, io_timeout_s=20,
                  ps_shards="1")
    cfg = node_cfg(tmp_path, **{**fields, **cfg_fields})
    peers = ScriptedPeers(port, strangers, gradient_meta)
    peers.start()
    code = Coordinator(cfg).run()
    peers.join(timeout=30)
    assert not peers.is_alive()
    return code, read_json(tmp_path / "metrics" / "coordinator.json"), peers


def hello_with_wrong_secret(sock: socket.socket) -> None:
    reader, answer = authenticate(sock, node_id="impostor", secret=b"not-the-shared-secret-at-all")
    assert answer.kind == "refused" and "authentication failed" in answer.meta["reason"]


def test_coordinator_in_process_refuses_bad_handshakes_and_runs(tmp_path, free_port):
    strangers: list[Stranger] = [
        frame_bytes("gradients", {"step": 0}),  # a valid frame of the wrong kind
        frame_bytes("hello", {"protocol_version": 99, "node_id": "future"}),
        frame_bytes("hello", {"node_id": "no version"}),
        hello_with_wrong_secret,
        b"\x00" * 7,  # shorter than a prefix, then nothing: the handshake times out
    ]
    code, data, peers = run_coordinator_with(tmp_path, free_port, strangers, lambda step: {"step": step, "loss": 1.0},
                                             handshake_timeout_s=2)
    assert code == EXIT_OK, data["error"]
    assert peers.strangers_closed == [True] * 5
    refused = [e["cause"] for e in data["events"] if e["event"] == "connection_refused"]
    assert len(refused) == 5
    assert "'gradients' message where ['hello'] was expected" in refused[0]
    assert "protocol version 99" in refused[1]
    assert "protocol version None" in refused[2]
    assert "authentication failed" in refused[3]
    assert "timed out" in refused[4] or "timeout" in refused[4]
    assert data["steps"] == 3 and data["workers_connected"] == 1 and data["batches_per_worker"] == {"1": 3}
    assert peers.ended_by == "stop" and peers.steps_answered == 3


def test_coordinator_drops_worker_with_wrong_step(tmp_path, free_port):
    code, data, peers = run_coordinator_with(tmp_path, free_port, [], lambda step: {"step": step + 1, "loss": 1.0},
                                             connect_timeout_s=3)
    assert code == EXIT_PEER_LOST
    assert data["status"] == "failed" and "every worker was lost" in data["error"]
    lost = [e for e in data["events"] if e["event"] == "worker_lost"]
    assert len(lost) == 1 and lost[0]["rank"] == 1 and "gradients for step 1, expected 0" in lost[0]["cause"]
    assert data["steps"] == 0


@pytest.mark.parametrize("loss", ["abc", [1.0], 10**400])  # 10**400: beyond a float
def test_coordinator_drops_worker_with_non_numeric_loss(tmp_path, free_port, loss):
    code, data, _ = run_coordinator_with(tmp_path, free_port, [], lambda step: {"step": step, "loss": loss},
                                         connect_timeout_s=3)
    assert code == EXIT_PEER_LOST
    assert any(e["event"] == "worker_lost" for e in data["events"])


def test_coordinator_survives_stranger_with_unhashable_dtype(tmp_path, free_port):
    hdr = json.dumps({"kind": "hello", "meta": {}, "codec": "none", "raw_nbytes": 4,
                      "tensors": [{"name": "x", "dtype": ["float32"], "shape": [1]}]}).encode()
    stranger = PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, len(hdr), 4) + hdr + bytes(4)
    code, data, _ = run_coordinator_with(tmp_path, free_port, [stranger], lambda step: {"step": step, "loss": 1.0})
    assert code == EXIT_OK
    refused = [e["cause"] for e in data["events"] if e["event"] == "connection_refused"]
    assert len(refused) == 1 and "unknown dtype" in refused[0]


# --------------------------------------------------------------------------------------------------
# Whole runs: python -m wiiide coordinator|worker
# --------------------------------------------------------------------------------------------------
def test_worker_connect_retries_fast_and_bounded(monkeypatch, free_port):
    """Refused connects are retried after 50 ms, then growing, never more than 250 ms apart, until the
    timeout; then exit code 3 with the number of attempts (a fake clock: no real waiting)."""
    import wiiide.worker as worker_module

    clock = {"now": 1000.0}
    sleeps: list[float] = []

    def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock["now"] += seconds

    monkeypatch.setattr(worker_module.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(worker_module.time, "sleep", fake_sleep)
    worker = worker_module.Worker(RunConfig(port=free_port, log_tier="silent", coordinator_host="127.0.0.1"))
    with pytest.raises(NodeFailure) as info:
        worker._connect(5.0)
    assert info.value.exit_code == EXIT_CONNECT
    assert sleeps[0] == pytest.approx(0.05) and max(sleeps) == pytest.approx(0.25)
    assert all(a <= b for a, b in zip(sleeps, sleeps[1:]))  # it only grows
    assert sum(sleeps) <= 5.0 and len(sleeps) > 15  # about 20 attempts in 5 s (it was 5 with a 2 s cap)
    assert f"({len(sleeps) + 1} attempts;" in str(info.value)


def test_exit_now_flushes_output_and_skips_shutdown(tmp_path):
    """`exit_now` keeps the exit code, flushes stdout, stderr and logging handlers, and runs no atexit hook."""
    import subprocess
    import sys

    code = ("import atexit, logging, sys\n"
            "from wiiide.__main__ import exit_now\n"
            "logging.basicConfig(stream=sys.stderr)\n"
            "atexit.register(lambda: print('atexit ran', flush=True))\n"
            "sys.stdout = open(sys.stdout.fileno(), 'w', buffering=1 << 20, closefd=False)\n"
            "print('written', end='')\n"
            "logging.getLogger('node').error('a log line')\n"
            "exit_now(4)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 4
    assert proc.stdout == "written" and "atexit ran" not in proc.stdout
    assert "a log line" in proc.stderr


def test_worker_without_coordinator_exits_3(tmp_path, free_port, node_env, node_procs):
    proc = node_procs.start("worker", node_env(connect_timeout_s=1, node_id="lonely"))
    assert node_procs.wait(proc, 60) == EXIT_CONNECT
    err = node_procs.stderr(proc)
    assert f"127.0.0.1:{free_port}" in err and "could not reach the coordinator" in err
    assert "Traceback" not in err
    data = read_json(tmp_path / "metrics" / "worker-lonely.json")
    assert data["status"] == "failed" and f"127.0.0.1:{free_port}" in data["error"]


def test_coordinator_without_workers_exits_3(tmp_path, free_port):
    """In-process (a coordinator subprocess costs seconds of imports): Coordinator.run is what the CLI returns."""
    cfg = node_cfg(tmp_path, port=free_port, num_workers=2, connect_timeout_s=1)
    with capture_log("wiiide.coordinator") as records:
        assert Coordinator(cfg).run() == EXIT_CONNECT
    data = read_json(tmp_path / "metrics" / "coordinator.json")
    assert data["status"] == "failed" and data["workers_connected"] == 0
    assert "only 0 of 2 workers connected" in data["error"] and f"port {free_port}" in data["error"]
    assert any("only 0 of 2 workers connected" in r for r in records)


class Evil:
    """Unpickling this creates a folder: proof that nobody unpickled it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (str(self.path),))


def test_strangers_are_refused_and_run_completes(tmp_path, free_port, node_env, node_procs):
    """Strangers connect first (garbage, then a pickle); the real worker (a subprocess) still gets its run."""
    pwned = tmp_path / "pwned"
    strangers = [
        b"GET / HTTP/1.1\r\nHost: coordinator\r\n\r\n",
        pickle.dumps({"kind": "hello", "payload": Evil(pwned), "padding": "x" * 64}),
    ]
    closed: list[bool] = []
    worker_box: list[Any] = []

    def strangers_then_worker() -> None:
        for data in strangers:
            with connect_retry(free_port) as s:
                s.sendall(data)
                closed.append(wait_closed_by_peer(s))
        worker_box.append(node_procs.start("worker", node_env(node_id="real")))

    thread = threading.Thread(target=strangers_then_worker, daemon=True)
    thread.start()
    cfg = node_cfg(tmp_path, port=free_port, num_workers=1, max_steps=50, compression="adaptive",
                   connect_timeout_s=60, io_timeout_s=30, ps_shards="1")  # the central server's codec counts below
    with capture_log("wiiide.coordinator") as records:
        code = Coordinator(cfg).run()
    thread.join(timeout=30)
    assert worker_box, "the scripted strangers did not finish"
    worker = worker_box[0]
    assert node_procs.wait(worker, 90) == 0, node_procs.stderr(worker)
    assert code == EXIT_OK

    assert closed == [True, True]
    assert not pwned.exists()  # nobody unpickled anything
    refusals = [r for r in records if "refused connection from 127.0.0.1" in r]
    assert len(refusals) == 2 and all("bad frame magic" in r for r in refusals)
    c = read_json(tmp_path / "metrics" / "coordinator.json")
    refused = [e for e in c["events"] if e["event"] == "connection_refused"]
    assert len(refused) == 2 and all("magic" in e["cause"] for e in refused)
    assert c["status"] == "ok" and c["steps"] == 50 and c["batches_per_worker"] == {"1": 50}
    # adaptive: params and batches at zlib-9; control frames carry no tensors, so no codec
    assert c["codec_counts"]["zlib-9"] == 2 * 50 and set(c["codec_counts"]) == {"zlib-9", "none"}
    w = read_json(tmp_path / "metrics" / "worker-1.json")
    assert w["status"] == "ok" and w["node_id"] == "real"
    assert set(w["codec_counts"]) == {"none"}  # small gradients go uncompressed
    assert w["codec_counts"]["none"] >= 51  # hello + 50 gradients


def test_worker_sigterm_writes_terminated_metrics(tmp_path, node_env, node_procs):
    """A scripted coordinator serves real steps, checks the gradient, then the worker gets SIGTERM."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        proc = node_procs.start("worker", node_env(port=port, node_id="w-term"))
        deadline = time.monotonic() + 60
        while True:
            try:
                conn, _ = listener.accept()
                break
            except socket.timeout:
                assert proc.poll() is None, node_procs.stderr(proc)
                assert time.monotonic() < deadline, "the worker never connected"
        with conn:
            conn.settimeout(60)
            reader = FrameReader(conn, 64 * MIB)
            nonce_c = new_nonce()
            send_frames(conn, [encode_message("challenge", {"protocol_version": PROTOCOL_VERSION, "nonce": nonce_c})])
            hello = read_skipping_heartbeats(reader)
            assert hello.kind == "hello"
            assert hello.meta["protocol_version"] == PROTOCOL_VERSION and hello.meta["node_id"] == "w-term"
            assert hello.meta["pid"] == proc.pid
            nonce_w = hello.meta["nonce"]
            verify(hello_mac(SECRET_BYTES, PROTOCOL_VERSION, nonce_c, nonce_w, "w-term"), hello.meta["mac"], "hello")

            model = build_mlp(64, [8], 10, seed=3)
            flat = FlatParams(model)
            rng = np.random.default_rng(0)
            x = rng.standard_normal((4, 64)).astype(np.float32)
            y = np.array([0, 3, 9, 3], dtype=np.int64)
            send_frames(conn, [
                encode_message("welcome", {"rank": 1, "world_size": 2, "num_workers": 1,
                                           "model": model_spec(64, [8], 10),
                                           "mac": welcome_mac(SECRET_BYTES, PROTOCOL_VERSION, nonce_w, nonce_c, 1)}),
                encode_message("params", {"step": 0}, [WireTensor("params", flat.params.numpy())]),
                encode_message("batch", {"step": 0}, [WireTensor("x", x), WireTensor("y", y)]),
            ])
            grads = read_skipping_heartbeats(reader)
            assert grads.kind == "gradients" and grads.meta["step"] == 0 and grads.meta["samples"] == 4
            loss = nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
            loss.backward()
            np.testing.assert_allclose(grads.tensor("grad"), flat.grads.numpy(), rtol=1e-4, atol=1e-6)
            assert grads.meta["loss"] == pytest.approx(loss.item(), rel=1e-5)
            # A second step: once its gradient is here, the worker has accounted the first one.
            send_frames(conn, [encode_message("params", {"step": 1}, [WireTensor("params", flat.params.numpy())]),
                               encode_message("batch", {"step": 1}, [WireTensor("x", x), WireTensor("y", y)])])
            assert read_skipping_heartbeats(reader).meta["step"] == 1

            proc.send_signal(signal.SIGTERM)
            assert node_procs.wait(proc, 60) == EXIT_TERMINATED
    data = read_json(tmp_path / "metrics" / "worker-1.json")
    assert data["status"] == "terminated" and "SIGTERM" in data["error"]
    assert data["rank"] == 1 and data["steps"] in (1, 2) and data["batches"] in (1, 2)
    assert data["node_id"] == "w-term"
