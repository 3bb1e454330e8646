"""wiiide.sockets.configure_socket on real TCP sockets: effective buffer sizes read back, TCP options."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from wiiide.config import RunConfig
from wiiide.sockets import configure_socket

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="socket(7) buffer doubling is Linux's")


def sysctl(name: str) -> int:
    path = Path("/proc/sys/net/core") / name
    if not path.exists():
        pytest.skip(f"{path} not readable")
    return int(path.read_text())


def expected_effective(requested: int, cap: int) -> int:
    """socket(7): the kernel caps the request at net.core.[rw]mem_max and doubles it."""
    return 2 * min(requested, cap)


@pytest.fixture
def tcp_socket():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    yield s
    s.close()


@pytest.mark.parametrize("requested", [4096, 64 * 1024, 8 * 1024 * 1024])
def test_buffer_sizes_read_back(tcp_socket, requested):
    rmem_max, wmem_max = sysctl("rmem_max"), sysctl("wmem_max")
    cfg = RunConfig(sndbuf_bytes=requested, rcvbuf_bytes=requested)
    opts = configure_socket(tcp_socket, cfg)
    assert opts["sndbuf_requested_bytes"] == opts["rcvbuf_requested_bytes"] == requested
    assert opts["rcvbuf_bytes"] == expected_effective(requested, rmem_max)
    assert opts["sndbuf_bytes"] == expected_effective(requested, wmem_max)
    if requested <= min(rmem_max, wmem_max):
        assert opts["rcvbuf_bytes"] >= requested and opts["sndbuf_bytes"] >= requested
    # What is reported is what the socket has.
    assert opts["rcvbuf_bytes"] == tcp_socket.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    assert opts["sndbuf_bytes"] == tcp_socket.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)


def test_zero_leaves_kernel_default(tcp_socket):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as fresh:
        default_rcv = fresh.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        default_snd = fresh.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    opts = configure_socket(tcp_socket, RunConfig(sndbuf_bytes=0, rcvbuf_bytes=0))
    assert opts["rcvbuf_bytes"] == default_rcv and opts["sndbuf_bytes"] == default_snd
    assert opts["sndbuf_requested_bytes"] == 0


def test_tcp_options_on(tcp_socket):
    opts = configure_socket(tcp_socket, RunConfig())
    assert opts["tcp_nodelay"] is True
    assert tcp_socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    assert opts["keepalive"] is True
    assert tcp_socket.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) != 0
    assert opts["tcp_quickack"] is (True if hasattr(socket, "TCP_QUICKACK") else None)


def test_tcp_options_off(tcp_socket):
    tcp_socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    opts = configure_socket(tcp_socket, RunConfig(tcp_nodelay=False, keepalive=False, tcp_quickack=False))
    assert opts["tcp_nodelay"] is False
    assert tcp_socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
    assert opts["keepalive"] is False
    assert opts["tcp_quickack"] is (False if hasattr(socket, "TCP_QUICKACK") else None)


@pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"), reason="no TCP_CONGESTION on this platform")
def test_tcp_congestion_set_and_read_back(tcp_socket):
    default = configure_socket(tcp_socket, RunConfig())["tcp_congestion"]
    assert default == open("/proc/sys/net/ipv4/tcp_congestion_control").read().strip()
    opts = configure_socket(tcp_socket, RunConfig(tcp_congestion="reno"))  # reno is built into every kernel
    assert opts["tcp_congestion"] == "reno"
    assert tcp_socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0") == b"reno"
    with pytest.raises(OSError, match="nosuchcc.*tcp_available_congestion_control"):
        configure_socket(tcp_socket, RunConfig(tcp_congestion="nosuchcc"))


def test_options_survive_connect_and_accept():
    """The coordinator sets buffers on the listener; accepted sockets inherit them."""
    rmem_max = sysctl("rmem_max")
    cfg = RunConfig(sndbuf_bytes=128 * 1024, rcvbuf_bytes=128 * 1024)
    with socket.socket() as listener, socket.socket() as client:
        configure_socket(listener, cfg)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        configure_socket(client, cfg)
        client.connect(listener.getsockname())
        server, _ = listener.accept()
        with server:
            assert server.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == expected_effective(128 * 1024, rmem_max)
            assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
