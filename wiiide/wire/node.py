"""What the coordinator and the worker share: a connection with accounting, and the node's life cycle.

`Connection` wraps one TCP socket: it sends frames and reads messages, updates the node's metrics
(bytes, times, codecs) and logs per message on the verbose tier. `run_node` runs a role's main
function so that its metrics file is written however it ends (normal end, error, SIGTERM) and turns
errors into one clear line and an exit code.
"""

from __future__ import annotations

import fcntl
import select
import signal
import socket
import struct
import termios
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from wiiide.codecs.chunked import CodecPool
from wiiide.config import RunConfig
from wiiide.errors import ConfigError, ProtocolError, WiiideError
from wiiide.log import TieredLog
from wiiide.metrics import NodeMetrics
from wiiide.summary import format_summary
from wiiide.trace import StepTrace
from wiiide.wire.encode import encode_message
from wiiide.wire.messages import Frame, Message
from wiiide.wire.reader import FrameReader
from wiiide.wire.send import send_frames

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_CONNECT = 3  # a worker could not reach the coordinator / the coordinator's workers did not all come
EXIT_PEER_LOST = 4  # a worker lost its coordinator, or a coordinator lost every worker
EXIT_TERMINATED = 143  # SIGTERM, as a shell reports it


HEARTBEAT = encode_message("heartbeat")


class Heartbeats:
    """A daemon thread that keeps idle connections alive: every `interval_s / 2` it sends a heartbeat
    on each connection `connections()` returns that sent nothing for `interval_s`."""

    def __init__(self, connections: Callable[[], Sequence["Connection"]], interval_s: float) -> None:
        self._connections = connections
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeats", daemon=True)

    def start(self) -> "Heartbeats":
        """Start the daemon thread that sends a heartbeat on every connection idle for `interval_s`; returns self."""
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s / 2):
            for conn in list(self._connections()):
                try:
                    conn.heartbeat_if_idle(self._interval_s)
                except OSError:
                    pass  # the main thread notices a broken connection on its next send or receive

    def stop(self) -> None:
        """Ask the thread to stop (it ends within half an interval); does not wait."""
        self._stop.set()


class NodeFailure(WiiideError):
    """A node cannot go on; carries the exit code its process ends with."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Terminated(BaseException):
    """Raised from the SIGTERM handler to unwind a node and write its metrics."""


class Connection:
    """One peer connection with metrics. `name` is for messages (e.g. ``worker 2``).

    Sends are serialised by a lock, so a heartbeat thread may share the socket with the node's main
    thread. `receive` passes over ``heartbeat`` frames: any frame proves the peer alive, and the
    socket's timeout (``io_timeout_s``) bounds the silence before a peer counts as lost.
    `max_frame_bytes` overrides the config's limit (the handshake reads with a small one). `pool`
    (the node's `CompressionPolicy.pool`) decodes received chunked payloads; None: in this thread.
    """

    def __init__(self, sock: socket.socket, cfg: RunConfig, metrics: NodeMetrics, log: TieredLog, name: str,
                 max_frame_bytes: int | None = None, pool: CodecPool | None = None) -> None:
        self.sock = sock
        self.name = name
        self.metrics = metrics
        self.log = log
        # reuse_buffers: the nodes consume each message before reading the next one on a connection.
        # whole_frames: one request per frame, as bench-wire's fastest raw loop (plain sockets only).
        self.reader = FrameReader(sock, max_frame_bytes or cfg.max_frame_bytes, cfg.recv_chunk_bytes,
                                  quickack=cfg.tcp_quickack, reuse_buffers=True, pool=pool, whole_frames=True)
        self._send_lock = threading.Lock()
        self.last_send = time.monotonic()

    def send(self, frames: Sequence[Frame]) -> None:
        """Send frames in one scatter-gather call, serialised with the heartbeat thread, and count them.

        Raises:
            OSError: from the socket (a broken or timed-out connection).
        """
        with self._send_lock:
            self._send_locked(frames)

    def _send_locked(self, frames: Sequence[Frame]) -> None:
        t0 = time.perf_counter()
        send_frames(self.sock, frames)
        seconds = time.perf_counter() - t0
        self.last_send = time.monotonic()
        for i, frame in enumerate(frames):
            self.metrics.record_sent(frame, seconds if i == 0 else 0.0, self.name)
            self.log.message("sent %s to %s: %d raw bytes, %d on the wire, codec %s",
                             frame.kind, self.name, frame.raw_nbytes, frame.wire_nbytes, frame.codec)

    def heartbeat_if_idle(self, interval_s: float) -> None:
        """Send a heartbeat when nothing was sent for `interval_s`; skip if a send is under way."""
        if time.monotonic() - self.last_send < interval_s or not self._send_lock.acquire(blocking=False):
            return
        try:
            self._send_locked([HEARTBEAT])
        finally:
            self._send_lock.release()

    def receive(self, expected_kinds: Sequence[str] | None = None, deadline: float | None = None) -> Message:
        """Read one message, passing over heartbeats; raises ProtocolError if its kind is not one of
        `expected_kinds`, socket.timeout after `io_timeout_s` of silence, and
        `wiiide.wire.format.DeadlineExceeded` (a TimeoutError) once `deadline` (a `time.monotonic()`
        instant, e.g. the handshake's) has passed, however slowly the peer's bytes trickle in."""
        while True:
            t0 = time.perf_counter()
            msg = self.reader.read_message(deadline)
            self.metrics.record_received(msg, time.perf_counter() - t0, self.name)
            if msg.kind != "heartbeat":
                break
        self.log.message("received %s from %s: %d raw bytes, %d on the wire, codec %s",
                         msg.kind, self.name, msg.raw_nbytes, msg.wire_nbytes, msg.codec)
        if expected_kinds is not None and msg.kind not in expected_kinds:
            raise ProtocolError(f"{self.name} sent a {msg.kind!r} message where {list(expected_kinds)} was expected")
        return msg

    def buffered_nbytes(self) -> int:
        """Bytes this connection already read from its socket and not yet returned: a TLS connection
        reads ahead (`wiiide.wire.tls_stream.TLSStream.pending`) and a reader with `whole_frames` may have taken
        bytes past its last frame (`FrameReader.buffered_nbytes`), so a frame may wait here while
        `select` on the socket says nothing is readable."""
        pending = getattr(self.sock, "pending", None)
        return (pending() if pending is not None else 0) + self.reader.buffered_nbytes()

    def close(self) -> None:
        """Close the socket; errors while closing are ignored (the peer is gone either way)."""
        try:
            self.sock.close()
        except OSError:
            pass


def unsent_nbytes(sock: Any) -> int | None:
    """Bytes in the socket's send queue the peer has not acknowledged yet (Linux ``SIOCOUTQ``, i.e.
    ``TIOCOUTQ``: tcp(7)); None where the kernel does not say."""
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    except (OSError, ValueError):
        return None


def close_after_delivery(conns: Sequence[Connection], idle_timeout_s: float) -> list[str]:
    """Close connections whose last frames must reach their peers (the coordinator's ``stop``), once
    they have: half-close each (``SHUT_WR``: the kernel sends what is queued, then a FIN), read and
    discard whatever the peers still send, and close each one when its peer closes its side.

    A plain close does not wait for that. With received bytes unread (a worker's heartbeats), Linux
    answers a close with a RST and drops what it had not sent yet (RFC 2525 section 2.17; ``tcp_close``
    in net/ipv4/tcp.c). A sharded run's ``stop`` carries the model's parameters to every worker. At
    50 Mbit/s, with 8 workers on the digits model, that is 9.6 MB behind the coordinator's link, about
    1.5 s. The coordinator's held-out evaluation takes less, and the workers then failed with "Connection
    reset by peer" after a finished run.

    A peer counts as gone, and its connection is closed anyway, once nothing it was sent moved for
    `idle_timeout_s` (s): the queue `unsent_nbytes` reports did not shrink. That wait starts again
    whenever the queue shrinks, so a slow link costs time, not the delivery.

    Returns the names of the connections closed that way, in `conns` order; never raises.
    """
    scratch = bytearray(64 * 1024)
    waiting: dict[int, Connection] = {}
    progress: dict[int, tuple[int | None, float]] = {}
    now = time.monotonic()
    for conn in conns:
        try:
            conn.sock.shutdown(socket.SHUT_WR)
            conn.sock.settimeout(0.05)  # a TLS stream may hold half a record: never block on it
            fd = conn.sock.fileno()
        except OSError:
            conn.close()
            continue
        waiting[fd], progress[fd] = conn, (unsent_nbytes(conn.sock), now)
    stale: list[Connection] = []
    while waiting:
        try:
            readable, _, _ = select.select(list(waiting), [], [], 0.1)
        except (OSError, ValueError):
            readable = list(waiting)
        for fd in readable:
            try:
                closed = waiting[fd].sock.recv_into(scratch) == 0
            except TimeoutError:
                closed = False
            except OSError:
                closed = True  # reset or broken: nothing more to deliver
            if closed:
                waiting.pop(fd).close()
        now = time.monotonic()
        for fd, conn in list(waiting.items()):
            queued, since = progress[fd]
            current = unsent_nbytes(conn.sock)
            if current is not None and queued is not None and current < queued:
                progress[fd] = (current, now)
            elif now - since >= idle_timeout_s:
                stale.append(waiting.pop(fd))
                conn.close()
    return [conn.name for conn in conns if conn in stale]


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def run_node(cfg: RunConfig, metrics: NodeMetrics, log: TieredLog, main: Callable[[], None]) -> int:
    """Run `main`, write the metrics file however it ends, and return the process exit code."""
    if cfg.torch_threads:
        # Several nodes share few cores: one intra-op thread each avoids oversubscription (a 100x
        # slowdown of small MLP steps measured with the default on 2 cores and 3 processes).
        import torch

        torch.set_num_threads(cfg.torch_threads)
    metrics.warmup_steps = cfg.warmup_steps  # left out of the Training Summary's timings
    if cfg.trace_steps:  # the timeline's spans of the first steps after the warm-up (wiiide.trace)
        metrics.trace = StepTrace(cfg.warmup_steps, cfg.trace_steps)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    status, error, code = "ok", None, EXIT_OK
    try:
        main()
    except Terminated:
        status, error, code = "terminated", "terminated by SIGTERM", EXIT_TERMINATED
    except KeyboardInterrupt:
        status, error, code = "terminated", "interrupted (SIGINT)", 130
    except NodeFailure as exc:
        status, error, code = "failed", str(exc), exc.exit_code
    except ConfigError as exc:
        status, error, code = "failed", str(exc), EXIT_CONFIG
    except (WiiideError, OSError) as exc:
        status, error, code = "failed", f"{type(exc).__name__}: {exc}", EXIT_ERROR
    except Exception as exc:  # a bug or an unforeseen input: still write the metrics, keep the trace
        status, error, code = "failed", f"unexpected {type(exc).__name__}: {exc}", EXIT_ERROR
        log.error("unexpected error:\n%s", traceback.format_exc())
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        path = metrics.write(cfg.metrics_dir, status, error)
        log.info("metrics written to %s", path)
    except OSError as exc:
        log.error("could not write metrics to %s: %s", cfg.metrics_dir, exc)
        code = code or EXIT_ERROR
    if error:
        log.error("%s %s: %s", metrics.role, metrics.node_id, error)
    elif metrics.role == "coordinator" and metrics.steps and cfg.log_tier != "silent":
        # rank 0 of every engine prints the guide's Training Summary block on stdout
        print(format_summary(metrics.training_summary()), flush=True)
    return code


def touch(path: str) -> None:
    """Write ``ready`` into `path` (parents created); an empty path does nothing. Raises OSError."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text("ready\n")


def wait_for_start_gate(cfg: RunConfig, metrics: NodeMetrics, log: TieredLog) -> None:
    """Block until ``cfg.start_gate_file`` exists (no-op when it is empty).

    The harness creates the file once the links are shaped, so no training traffic goes out before.
    Raises NodeFailure (exit 3) when it does not appear within ``connect_timeout_s``.
    """
    path = cfg.start_gate_file
    if not path:
        return
    t0 = time.monotonic()
    log.info("waiting for the start gate %s", path)
    while not Path(path).exists():
        if time.monotonic() - t0 >= cfg.connect_timeout_s:
            raise NodeFailure(f"the start gate file {path} did not appear within connect_timeout_s="
                              f"{cfg.connect_timeout_s:g} s; the harness creates it once it has shaped the links "
                              f"(set start_gate_file to '' to start at once)", EXIT_CONNECT)
        time.sleep(0.02)
    metrics.event("start_gate_opened", waited_s=round(time.monotonic() - t0, 3))
