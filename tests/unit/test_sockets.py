"""wiiide.wire.sockets.configure_socket on real TCP sockets: effective buffer sizes read back, TCP options."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from wiiide.config import RunConfig
from wiiide.wire.sockets import configure_socket

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


class _FakeIp:
    """Stands in for `subprocess.run` of ``ip``: answers ``ip -j route show`` with `routes` (JSON) and
    records every other command; refuses a change when `refuse` is set (as ip does without CAP_NET_ADMIN)."""

    def __init__(self, routes: str, refuse: str = "") -> None:
        self.routes, self.refuse, self.calls = routes, refuse, []

    def __call__(self, argv, **kwargs):
        import subprocess

        self.calls.append(argv)
        if argv[:4] == ["ip", "-j", "route", "show"]:
            return subprocess.CompletedProcess(argv, 0, self.routes, "")
        if self.refuse:
            return subprocess.CompletedProcess(argv, 2, "", self.refuse)
        return subprocess.CompletedProcess(argv, 0, "", "")


DOCKER_ROUTES = ('[{"dst":"default","gateway":"172.18.0.1","dev":"eth0","flags":[]},'
                 '{"dst":"172.18.0.0/16","dev":"eth0","protocol":"kernel","scope":"link","prefsrc":"172.18.0.3",'
                 '"flags":[]},{"dst":"127.0.0.0/8","dev":"lo","flags":[]}]')


def test_route_congestion_changes_every_route_but_loopback_keeping_its_attributes():
    from wiiide.wire.sockets import set_route_congestion

    ip = _FakeIp(DOCKER_ROUTES)
    assert set_route_congestion("cubic", ip) == ["default", "172.18.0.0/16"]
    assert ip.calls[1:] == [
        ["ip", "route", "change", "default", "via", "172.18.0.1", "dev", "eth0", "congctl", "cubic"],
        ["ip", "route", "change", "172.18.0.0/16", "dev", "eth0", "proto", "kernel", "scope", "link",
         "src", "172.18.0.3", "congctl", "cubic"]]


def test_route_congestion_refused_or_unreadable_is_an_oserror_naming_it():
    from wiiide.wire.sockets import set_route_congestion

    with pytest.raises(OSError, match="cubic.*Operation not permitted"):
        set_route_congestion("cubic", _FakeIp(DOCKER_ROUTES, refuse="RTNETLINK answers: Operation not permitted"))
    with pytest.raises(OSError, match="no JSON"):
        set_route_congestion("cubic", _FakeIp("default via 172.18.0.1 dev eth0"))


def test_congestion_in_force_counts_the_connections_of_each_algorithm():
    """Read back on real sockets: one end of a loopback connection switched to reno is counted by `ss`
    under reno (no other connection of this machine's namespace runs reno)."""
    from wiiide.wire.sockets import congestion_in_force

    before = congestion_in_force()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    with listener, socket.create_connection(listener.getsockname()) as client:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"reno")
        server, _ = listener.accept()
        with server:
            after = congestion_in_force()
    assert after.get("reno", 0) == before.get("reno", 0) + 1
    assert sum(after.values()) >= 2  # the server's end too, under the system's algorithm


def test_tcp_cwnd_bytes_is_the_congestion_window_ss_shows():
    """TCP_INFO read by hand: a loopback connection's cwnd (segments) x mss, as `ss -tin` prints them for
    the same socket; None for a socket that is not TCP."""
    import re
    import subprocess

    from wiiide.wire.sockets import tcp_cwnd_bytes

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    with listener, socket.create_connection(listener.getsockname()) as client:
        server, _ = listener.accept()
        with server:
            port = client.getsockname()[1]
            shown = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
                                   capture_output=True, text=True, timeout=10.0).stdout
            mss = re.search(r"\bmss:(\d+)", shown)
            cwnd = re.search(r"\bcwnd:(\d+)", shown)
            assert mss and cwnd, shown
            assert tcp_cwnd_bytes(client) == int(mss.group(1)) * int(cwnd.group(1))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        assert tcp_cwnd_bytes(udp) is None


@pytest.mark.parametrize("shard, overall, expected", [
    ("auto", "", "auto"), ("auto", "cubic", "cubic"), ("", "", ""), ("", "bbr", "bbr"), ("reno", "cubic", "reno")])
def test_the_shard_connections_congestion_control(shard, overall, expected):
    """shard_tcp_congestion names one, or defers to tcp_congestion when that is set; auto otherwise."""
    from wiiide.wire.sockets import shard_congestion

    assert shard_congestion(RunConfig(shard_tcp_congestion=shard, tcp_congestion=overall)) == expected


def test_auto_congestion_is_reno_where_allowed_and_the_systems_where_refused(tcp_socket):
    """``auto`` sets reno (built into every kernel and in every allowed list); where the kernel refuses
    it (a stand-in socket whose TCP_CONGESTION setsockopt fails) the socket keeps the system's."""
    opts = configure_socket(tcp_socket, RunConfig(), "auto")
    assert opts["tcp_congestion"] == "reno"

    class Refusing:
        def __init__(self, sock):
            self.sock = sock

        def setsockopt(self, level, option, value):
            if option == socket.TCP_CONGESTION:
                raise PermissionError(1, "Operation not permitted")
            self.sock.setsockopt(level, option, value)

        def getsockopt(self, *args):
            return self.sock.getsockopt(*args)

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as fresh:
        opts = configure_socket(Refusing(fresh), RunConfig(), "auto")
        assert opts["tcp_congestion"] == open("/proc/sys/net/ipv4/tcp_congestion_control").read().strip()
        with pytest.raises(OSError, match="cubic"):
            configure_socket(Refusing(fresh), RunConfig(), "cubic")  # a named one refused stays an error


class _CountingSends:
    """A socket wrapper that counts `sendmsg` calls (everything else goes to the real socket)."""

    def __init__(self, sock):
        self._sock, self.sendmsg_calls = sock, 0

    def sendmsg(self, buffers):
        self.sendmsg_calls += 1
        return self._sock.sendmsg(buffers)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def _send_one_frame(configure) -> tuple[int, float]:
    """Send one 1 MiB frame over a socketpair whose ends `configure` set up, read by a thread; return the
    sendmsg calls it took and the sum of the values received."""
    import threading

    import numpy as np

    from wiiide.wire.encode import encode_message
    from wiiide.wire.messages import WireTensor
    from wiiide.wire.reader import FrameReader
    from wiiide.wire.send import send_frames

    a, b = socket.socketpair()
    try:
        configure(a)
        configure(b)
        received = []
        reader = FrameReader(b, 4 << 20, reuse_buffers=True, whole_frames=True)
        thread = threading.Thread(target=lambda: received.append(float(reader.read_message().tensor("g").sum())))
        thread.start()
        counting = _CountingSends(a)
        send_frames(counting, [encode_message("m", {}, [WireTensor("g", np.ones(1 << 18, np.float32))])])
        thread.join(10)
        return counting.sendmsg_calls, received[0]
    finally:
        a.close()
        b.close()


def test_io_timeout_keeps_the_socket_blocking_so_a_frame_is_one_sendmsg():
    """With the kernel's timeouts a 1 MiB frame goes out in one sendmsg, as the raw loop sends it; with a
    Python timeout (non-blocking socket) the same frame takes one call per send buffer filled."""
    from wiiide.wire.sockets import set_io_timeout

    calls, total = _send_one_frame(lambda s: set_io_timeout(s, 10.0))
    assert (calls, total) == (1, float(1 << 18))
    calls, total = _send_one_frame(lambda s: s.settimeout(10.0))
    assert calls > 1 and total == float(1 << 18)


def test_io_timeout_still_bounds_a_silent_peer_with_socket_timeout():
    """A read with nothing to read, and a send nobody reads, fail with socket.timeout after the bound."""
    import numpy as np

    from wiiide.wire.encode import encode_message
    from wiiide.wire.messages import WireTensor
    from wiiide.wire.reader import FrameReader
    from wiiide.wire.send import send_frames
    from wiiide.wire.sockets import set_io_timeout

    a, b = socket.socketpair()
    try:
        set_io_timeout(a, 0.1)
        set_io_timeout(b, 0.1)
        assert a.gettimeout() is None
        for whole in (True, False):
            with pytest.raises(socket.timeout):
                FrameReader(b, 1 << 20, reuse_buffers=whole, whole_frames=whole).read_message()
        with pytest.raises(socket.timeout):  # nobody reads b: the send buffer fills, then nothing moves
            send_frames(a, [encode_message("m", {}, [WireTensor("g", np.ones(1 << 20, np.float32))])])
    finally:
        a.close()
        b.close()


def test_io_timeout_on_a_stream_that_is_not_a_kernel_socket_is_its_settimeout():
    from wiiide.wire.sockets import set_io_timeout

    class Stream:  # as wiiide.wire.tls_stream.TLSStream: settimeout, no kernel options
        timeout_s = None

        def settimeout(self, timeout_s):
            self.timeout_s = timeout_s

    stream = Stream()
    set_io_timeout(stream, 2.5)
    assert stream.timeout_s == 2.5
