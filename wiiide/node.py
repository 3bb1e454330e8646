"""What the coordinator and the worker share: a connection with accounting, and the node's life cycle.

`Connection` wraps one TCP socket: it sends frames and reads messages, updates the node's metrics
(bytes, times, codecs) and logs per message on the verbose tier. `run_node` runs a role's main
function so that its metrics file is written however it ends (normal end, error, SIGTERM) and turns
errors into one clear line and an exit code.
"""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from wiiide.config import RunConfig
from wiiide.errors import ConfigError, ProtocolError, WiiideError
from wiiide.log import TieredLog
from wiiide.metrics import NodeMetrics
from wiiide.protocol import Frame, FrameReader, Message, send_frames

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_CONNECT = 3  # a worker could not reach the coordinator / the coordinator's workers did not all come
EXIT_PEER_LOST = 4  # a worker lost its coordinator, or a coordinator lost every worker
EXIT_TERMINATED = 143  # SIGTERM, as a shell reports it


class NodeFailure(WiiideError):
    """A node cannot go on; carries the exit code its process ends with."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Terminated(BaseException):
    """Raised from the SIGTERM handler to unwind a node and write its metrics."""


class Connection:
    """One peer connection with metrics. `name` is for messages (e.g. ``worker 2``)."""

    def __init__(self, sock: socket.socket, cfg: RunConfig, metrics: NodeMetrics, log: TieredLog, name: str) -> None:
        self.sock = sock
        self.name = name
        self.metrics = metrics
        self.log = log
        # reuse_buffers: the nodes consume each message before reading the next one on a connection.
        self.reader = FrameReader(sock, cfg.max_frame_bytes, cfg.recv_chunk_bytes, quickack=cfg.tcp_quickack,
                                  reuse_buffers=True)

    def send(self, frames: Sequence[Frame]) -> None:
        t0 = time.perf_counter()
        send_frames(self.sock, frames)
        seconds = time.perf_counter() - t0
        for i, frame in enumerate(frames):
            self.metrics.record_sent(frame, seconds if i == 0 else 0.0)
            self.log.message("sent %s to %s: %d raw bytes, %d on the wire, codec %s",
                             frame.kind, self.name, frame.raw_nbytes, frame.wire_nbytes, frame.codec)

    def receive(self, expected_kinds: Sequence[str] | None = None) -> Message:
        """Read one message; raises ProtocolError if its kind is not one of `expected_kinds`."""
        t0 = time.perf_counter()
        msg = self.reader.read_message()
        self.metrics.record_received(msg, time.perf_counter() - t0)
        self.log.message("received %s from %s: %d raw bytes, %d on the wire, codec %s",
                         msg.kind, self.name, msg.raw_nbytes, msg.wire_nbytes, msg.codec)
        if expected_kinds is not None and msg.kind not in expected_kinds:
            raise ProtocolError(f"{self.name} sent a {msg.kind!r} message where {list(expected_kinds)} was expected")
        return msg

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def run_node(cfg: RunConfig, metrics: NodeMetrics, log: TieredLog, main: Callable[[], None]) -> int:
    """Run `main`, write the metrics file however it ends, and return the process exit code."""
    if cfg.torch_threads:
        # Several nodes share few cores: one intra-op thread each avoids oversubscription (a 100x
        # slowdown of small MLP steps measured with the default on 2 cores and 3 processes).
        import torch

        torch.set_num_threads(cfg.torch_threads)
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
    return code


def touch(path: str) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text("ready\n")
