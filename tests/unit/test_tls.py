"""TLS 1.3 on the coordinator's connections (`wiiide.wire.tls`), on loopback only.

The coordinator runs in-process up to its acceptor, as in test_handshake.py; every refusal must be a
``connection_refused`` event with a cause, the slot freed and the next worker still admitted. No
timing is asserted: outcomes, and deadlines with margins of 10x and more.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import stat
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from harness.run.certs import config_fields, write_cluster_tls
from tests.unit.test_handshake import (
    ACCEPTOR_FIELDS,
    SECRET,
    connect,
    refusals,
    running_acceptor,
    wait_for,
)
from wiiide.config import RunConfig
from wiiide.server.coordinator import Coordinator
from wiiide.errors import ConfigError
from wiiide.wire.admission import REASON_DEADLINE
from wiiide.wire.auth import hello_frame, verify, welcome_mac
from wiiide.wire.encode import encode_message
from wiiide.wire.format import PROTOCOL_VERSION
from wiiide.wire.reader import FrameReader
from wiiide.wire.send import send_frames
from wiiide.wire.tls import TLSHandshakeError, client_context, wrap_client


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    """The cluster's certificates (coordinator, worker-1) and a stranger's from another CA."""
    root = tmp_path_factory.mktemp("pki")
    cluster = write_cluster_tls(root / "cluster", {"coordinator": ["localhost", "127.0.0.1"],
                                                   "worker-1": ["worker-1"]})
    other = write_cluster_tls(root / "other", {"stranger": ["stranger"]}, cluster="other")
    return {**cluster, **other}


def node_cfg(pki: dict, node: str, **fields) -> RunConfig:
    return RunConfig(tls=True, **config_fields(str(pki[node].folder)), **fields)


@pytest.fixture
def tls_acceptor(tmp_path, free_port, pki) -> Iterator[Coordinator]:
    """A TLS coordinator listening on 127.0.0.1:free_port with its acceptor thread running (no training)."""
    yield from running_acceptor(node_cfg(pki, "coordinator", port=free_port, metrics_dir=str(tmp_path / "metrics"),
                                         **ACCEPTOR_FIELDS))


def tls_worker_handshake(node: Coordinator, cfg: RunConfig) -> str:
    """A worker's side over TLS: TLS handshake, then challenge -> hello -> welcome inside it."""
    with wrap_client(connect(node.cfg.port), cfg, "127.0.0.1") as sock:
        assert sock.version() == "TLSv1.3"
        sock.settimeout(30)
        reader = FrameReader(sock, 1 << 20)
        nonce_c = reader.read_message().meta["nonce"]
        hello, nonce_w = hello_frame(SECRET, nonce_c, "tls-worker")
        send_frames(sock, [hello])
        node._admit(node._joining.get(timeout=30))
        answer = reader.read_message()
        verify(welcome_mac(SECRET, PROTOCOL_VERSION, nonce_w, nonce_c, answer.meta["rank"]), answer.meta["mac"], "w")
        send_frames(sock, [encode_message("heartbeat")])  # the frame path on an SSLSocket, both ways
        return answer.kind


def last_refusal(node: Coordinator, count: int) -> dict:
    wait_for(lambda: len(refusals(node)) >= count, f"refusal number {count}")
    wait_for(lambda: node._gate.counts()["active"] == 0, "the slot freed")
    return refusals(node)[count - 1]


def test_keys_are_private_and_each_node_gets_its_own_folder(pki):
    folder = pki["coordinator"].folder
    assert stat.S_IMODE(os.stat(pki["coordinator"].key_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert sorted(p.name for p in folder.iterdir()) == ["ca.crt", "node.crt", "node.key"]
    assert pki["coordinator"].ca_file.read_bytes() == pki["worker-1"].ca_file.read_bytes()
    assert not list(folder.parent.glob("**/ca.key"))  # the CA's key is never written


def test_a_cluster_worker_joins_over_tls_with_the_hmac_handshake_inside(tls_acceptor, pki):
    assert tls_worker_handshake(tls_acceptor, node_cfg(pki, "worker-1")) == "welcome"
    assert refusals(tls_acceptor) == []


def test_a_client_certificate_from_another_ca_is_refused_and_the_coordinator_goes_on(tls_acceptor, pki):
    node = tls_acceptor
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # trusts the cluster's CA (public), offers its own certificate
    ctx.load_verify_locations(cafile=pki["worker-1"].ca_file)
    ctx.load_cert_chain(pki["stranger"].cert_file, pki["stranger"].key_file)
    with pytest.raises((ssl.SSLError, ConnectionError)):  # TLS 1.3: the client learns it on its first read
        with ctx.wrap_socket(connect(node.cfg.port), server_hostname="127.0.0.1") as sock:
            sock.settimeout(30)
            sock.recv(1)
    event = last_refusal(node, 1)
    assert event["reason"] == "tls" and "certificate" in event["cause"].lower(), event
    assert tls_worker_handshake(node, node_cfg(pki, "worker-1")) == "welcome"


def test_a_client_of_the_same_ca_refuses_a_server_that_does_not_carry_the_name_dialled(tls_acceptor, pki):
    with pytest.raises(TLSHandshakeError, match="not-the-coordinator|hostname|match"):
        wrap_client(connect(tls_acceptor.cfg.port), node_cfg(pki, "worker-1"), "not-the-coordinator")


def test_a_tls_1_2_only_client_is_refused(tls_acceptor, pki):
    node = tls_acceptor
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cafile=pki["worker-1"].ca_file)
    ctx.load_cert_chain(pki["worker-1"].cert_file, pki["worker-1"].key_file)
    with pytest.raises((ssl.SSLError, ConnectionError)):
        with ctx.wrap_socket(connect(node.cfg.port), server_hostname="127.0.0.1"):
            pass
    event = last_refusal(node, 1)
    assert event["reason"] == "tls" and "TLS 1.3 is required" in event["cause"], event
    assert tls_worker_handshake(node, node_cfg(pki, "worker-1")) == "welcome"


def test_a_plaintext_client_is_refused_without_a_dead_thread(tls_acceptor, pki):
    node = tls_acceptor
    with connect(node.cfg.port) as sock:
        hello, _ = hello_frame(SECRET, "00" * 16, "plain")
        send_frames(sock, [hello])  # a WIIIIIDE frame where a ClientHello should be
        try:
            while sock.recv(1 << 16):  # whatever alert the server sends, then EOF: the connection is closed
                pass
        except ConnectionError:
            pass
    event = last_refusal(node, 1)
    assert event["reason"] == "tls", event
    threads = [t.name for t in threading.enumerate() if t.name.startswith("handshake ")]
    assert threads == [], threads  # the slot thread ended with its refusal, it did not die or hang
    assert tls_worker_handshake(node, node_cfg(pki, "worker-1")) == "welcome"


def test_a_client_hello_sent_one_byte_at_a_time_is_cut_at_the_handshake_deadline(tls_acceptor, pki):
    node = tls_acceptor  # handshake_timeout_s=2
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_context(node_cfg(pki, "worker-1")).wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        client.do_handshake()
    client_hello = outgoing.read()
    assert len(client_hello) > 100  # at 0.25 s a byte: more than 25 s, against a 2 s deadline
    sent = 0
    with connect(node.cfg.port) as sock:
        for byte in client_hello:
            try:
                sock.send(bytes([byte]))
            except OSError:
                break
            sent += 1
            readable, _, _ = select.select([sock], [], [], 0.25)
            if readable and not sock.recv(1 << 16):
                break
    assert sent < len(client_hello), "the coordinator read the whole slow ClientHello"
    event = last_refusal(node, 1)
    assert event["reason"] == REASON_DEADLINE and "TLS" in event["cause"], event


def test_missing_or_bad_tls_files_are_config_errors_naming_the_field(tmp_path, pki):
    with pytest.raises(ConfigError, match="tls_ca_file"):
        client_context(RunConfig(tls=True))
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    fields = {**config_fields(str(pki["worker-1"].folder)), "tls_ca_file": str(bad)}
    with pytest.raises(ConfigError, match="tls_ca_file"):
        client_context(RunConfig(tls=True, **fields))
    with pytest.raises(ConfigError, match="tls_key_file"):
        client_context(RunConfig(tls=True, **{**config_fields(str(pki["worker-1"].folder)),
                                              "tls_key_file": str(pki["coordinator"].key_file)}))


def test_tls_needs_the_wiiide_engine():
    with pytest.raises(ConfigError, match="'tls'.*engine wiiide"):
        RunConfig(tls=True, engine="ddp")


def test_a_plain_socket_pair_still_sends_with_sendmsg(sock_pair):
    writer, reader = sock_pair  # the TLS branch of send_frames leaves plain sockets alone
    assert isinstance(writer, socket.socket) and not isinstance(writer, ssl.SSLSocket)
    send_frames(writer, [encode_message("heartbeat")])
    assert FrameReader(reader, 1 << 20).read_message().kind == "heartbeat"


def test_node_names_must_be_plain(tmp_path):
    from harness.errors import HarnessError

    with pytest.raises(HarnessError, match="plain name"):
        write_cluster_tls(Path(tmp_path), {"../evil": ["x"]})


def test_docker_certificates_name_what_peers_dial_and_point_into_the_mount(tmp_path):
    from cryptography import x509

    from harness.run.compose_project import CONTAINER_TLS_DIR, PROJECT, write_docker_tls

    cfg, folder = write_docker_tls(RunConfig(num_workers=2, tls=True), tmp_path)
    assert cfg.tls_cert_file == f"{CONTAINER_TLS_DIR}/node.crt" and cfg.tls_key_file.startswith(CONTAINER_TLS_DIR)
    assert sorted(p.name for p in folder.iterdir()) == ["coordinator", "worker-1", "worker-2"]
    cert = x509.load_pem_x509_certificate((folder / "coordinator" / "node.crt").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert names == ["coordinator", f"{PROJECT}_coordinator_1"]  # workers dial coordinator_host=coordinator


def test_a_server_that_closes_during_the_handshake_is_a_lost_connection_the_worker_retries(pki):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        closer = threading.Thread(target=lambda: listener.accept()[0].close(), daemon=True)
        closer.start()
        with pytest.raises(OSError) as info:  # not TLSHandshakeError: Worker._connect retries OSErrors
            wrap_client(connect(listener.getsockname()[1]), node_cfg(pki, "worker-1"), "127.0.0.1")
        assert not isinstance(info.value, TLSHandshakeError)
        closer.join(timeout=10)


def test_a_shard_over_tls_serves_the_cluster_and_checks_the_name_its_peer_expects(tmp_path, pki):
    """Worker-shard connections take the coordinator's TLS wrapping (`wiiide.wire.handshake`): a worker
    dialling the shard by the name on its certificate joins over TLS 1.3; one expecting another name,
    or holding a stranger's certificate, never reaches the HMAC handshake."""
    import numpy as np

    from wiiide.log import TieredLog
    from wiiide.metrics import NodeMetrics
    from wiiide.server.ps.client import ShardFailed, connect_shard
    from wiiide.server.ps.partition import partition_flat
    from wiiide.server.ps.shard import ROLE_WORKER, ShardServer

    fields = {"num_workers": 1, "log_tier": "silent", "handshake_timeout_s": 2, "connect_timeout_s": 2}
    shard_cfg = node_cfg(pki, "coordinator", **fields)  # the shard's node: certificate names localhost, 127.0.0.1
    server = ShardServer(shard_cfg, SECRET, NodeMetrics("worker", "shard"), TieredLog(shard_cfg, "shard"), 1)
    port = server.listen()
    server.configure(partition_flat(100, 2, 64), np.zeros(100, np.float32), lossy_pulls=False)
    server.start()
    try:
        worker_cfg = node_cfg(pki, "worker-1", **fields)
        m, lg = NodeMetrics("worker", "w1"), TieredLog(worker_cfg, "w1")
        with pytest.raises(ShardFailed, match="failed TLS"):
            connect_shard(worker_cfg, SECRET, m, lg, "127.0.0.1", port, 1, ROLE_WORKER, 1, "w1", tls_name="worker-9")
        stranger = node_cfg(pki, "stranger", **fields)
        with pytest.raises(ShardFailed):
            connect_shard(stranger, SECRET, m, lg, "127.0.0.1", port, 1, ROLE_WORKER, 1, "w1")
        conn = connect_shard(worker_cfg, SECRET, m, lg, "127.0.0.1", port, 1, ROLE_WORKER, 1, "w1",
                             tls_name="localhost")
        try:
            assert conn.sock.version() == "TLSv1.3"
            deadline = time.monotonic() + 10  # the shard records its peer just after sending the welcome
            while "peer_tls" not in server.stats and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.stats["peer_tls"] == {"worker 1": "TLSv1.3"}
        finally:
            conn.close()
    finally:
        server.close()
