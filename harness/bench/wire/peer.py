"""The two peers: the sink (reads what it is sent, acknowledges each trial) and the source (runs the plan).

``python -m harness.bench.wire peer --role sink|source ...`` runs one of them: in a container of the
node image (harness mounted at /app/harness) or as a local process. Standard library, numpy, torch
and `wiiide` only.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from harness.bench.wire.channel import PORT, configure_socket, connect, send_control
from harness.bench.wire.codec_table import codec_table
from harness.bench.wire.frames import frames_section
from harness.bench.wire.iperf import IPERF3_PORT, start_server, stop_server
from harness.bench.wire.links import links_section
from harness.bench.wire.payloads import gradients
from harness.bench.wire.plan import FRAME_READERS, WirePlan
from harness.bench.wire.raw import RAW_CHUNK_BYTES, recv_raw
from wiiide.codecs.chunked import CodecPool
from wiiide.metrics import write_json_atomic
from wiiide.units import MIB
from wiiide.wire.reader import FrameReader

MAX_FRAME_BYTES = 1 << 31
CONNECT_TIMEOUT_S = 60.0


def sink(sock: socket.socket, recv_chunk_bytes: int = 64 * MIB, read_ahead_bytes: int = 0) -> None:
    """Serve trials until ``done``: each starts with a ``trial`` control frame naming its mode, count and size.

    Frames are read by the reader the trial names (``reader``: ``whole``, the nodes' `FrameReader` with
    `whole_frames`, the default; ``exact``: every frame part read exactly), with `recv_chunk_bytes` (bytes;
    the nodes' default 64 MiB unless told otherwise) and `read_ahead_bytes` (bytes; 0: none; ``exact``
    only), reusing its receive buffer. A raw trial receives the way its
    ``recv`` names (`harness.bench.wire.raw.recv_raw`) into one reused buffer. Each trial ends with an
    ``ack`` carrying ``recv_s``, the frames' ``decode_s`` and this process's CPU seconds ``cpu_s`` (user +
    system, `time.process_time`) over the trial;
    a ``roundtrip`` trial also acks every message.

    Raises:
        ConnectionError: the source closed during a raw trial. ProtocolError: (wiiide) a malformed frame.
    """
    # Control frames are read exactly (a raw trial's bytes follow its control frame at once, and must
    # stay in the socket); a trial's frames by a reader that may read past a frame: nothing follows a
    # trial's last frame before the sink's ack, so nothing is left read ahead when a trial ends.
    control_reader = FrameReader(sock, max_frame_bytes=MAX_FRAME_BYTES, reuse_buffers=True)
    readers = {name: FrameReader(sock, max_frame_bytes=MAX_FRAME_BYTES, recv_chunk_bytes=recv_chunk_bytes,
                                 reuse_buffers=True, read_ahead_bytes=read_ahead_bytes, whole_frames=name == "whole")
               for name in FRAME_READERS}
    raw_buf = bytearray(0)
    while True:
        control = control_reader.read_message()
        meta = control.meta
        if control.kind == "done":
            return
        count, size_bytes = int(meta["count"]), int(meta["size"])
        t0, cpu0 = time.perf_counter(), time.process_time()
        decode_s = 0.0
        if meta["mode"] == "raw":
            chunk_bytes = int(meta.get("chunk_bytes", RAW_CHUNK_BYTES))
            if len(raw_buf) < max(size_bytes, chunk_bytes):
                raw_buf = bytearray(max(size_bytes, chunk_bytes))
            recv_raw(sock, memoryview(raw_buf), size_bytes, count, str(meta.get("recv", "whole")), chunk_bytes)
        else:
            reader = readers[str(meta.get("reader", "whole"))]
            for _ in range(count):
                msg = reader.read_message()
                decode_s += msg.decode_s
                if meta["mode"] == "roundtrip":
                    send_control(sock, "ack")
        send_control(sock, "ack", recv_s=time.perf_counter() - t0, decode_s=decode_s,
                     cpu_s=time.process_time() - cpu0)


def source(sock: socket.socket, plan: WirePlan, progress: Callable[[str], None],
           iperf3_host: str | None = None, iperf3_port: int = IPERF3_PORT) -> dict[str, Any]:
    """Run the plan against a connected sink, then send ``done``.

    `iperf3_host`:`iperf3_port`: the sink's iperf3 server, measured between the frame trials (None: not).

    Returns:
        ``gradients`` (name -> ``nbytes``, ``elements``), ``frames``, ``links`` and ``codecs``: the rows of
        `frames_section`, `links_section` and `codec_table`.

    Raises:
        OSError, ConnectionError: the connection failed. ProtocolError: (wiiide) a malformed frame.
    """
    reader = FrameReader(sock, max_frame_bytes=MAX_FRAME_BYTES)
    grads = gradients(plan.small)
    out: dict[str, Any] = {"gradients": {k: {"nbytes": int(v.nbytes), "elements": int(v.size)}
                                         for k, v in grads.items()}}
    pool = CodecPool(plan.codec_threads, MIB)
    try:
        if "frames" in plan.sections:
            progress("frames: raw socket vs WIIIIIDE frames")
            out["frames"] = frames_section(sock, reader, grads["synthetic-mlp"], plan.sizes_bytes,
                                           plan.frame_codecs, plan.repeats, plan.bytes_per_trial, pool, progress,
                                           iperf3_host=iperf3_host,
                                           iperf3_port=iperf3_port, frame_readers=plan.frame_readers)
        if "links" in plan.sections:
            progress("links: synchronous gradient round trips on paced links")
            out["links"] = links_section(sock, reader, grads["digits-mlp"], plan.link_rates_bps, plan.link_policies,
                                         plan.link_messages, plan.codec_threads, progress)
        if "codecs" in plan.sections:
            progress("codecs: ratio and speed on real gradients")
            out["codecs"] = codec_table(grads, plan.table_codecs, plan.table_threads, plan.repeats, progress)
    finally:
        pool.close()
        send_control(sock, "done")
    return out


def serve_sink(host: str, port: int, recv_chunk_bytes: int, iperf3_port: int = IPERF3_PORT,
               read_ahead_bytes: int = 0) -> None:
    """Start an iperf3 server on `iperf3_port` (when iperf3 is installed), listen on `host`:`port`, print
    ``listening`` (the local backend waits for it), serve one source, stop the iperf3 server.

    Raises:
        OSError: the address is taken or the connection failed. ConnectionError, ProtocolError: as `sink`.
    """
    iperf3_server = start_server(iperf3_port)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        configure_socket(listener)
        listener.bind((host, port))
        listener.listen(1)
        print("listening", flush=True)
        conn, _ = listener.accept()
        configure_socket(conn)
        try:
            with conn:
                sink(conn, recv_chunk_bytes, read_ahead_bytes)
        finally:
            stop_server(iperf3_server)


def peer_main(argv: Sequence[str] | None = None) -> int:
    """``python -m harness.bench.wire peer --role sink|source ...``: what runs in each container or process.

    The source reads the plan (`WirePlan.as_dict` as JSON) from ``--plan`` and writes its result JSON
    to ``--out`` (atomically). Returns the exit status (0).

    Raises:
        SystemExit: bad arguments (argparse). PlanError: a plan `WirePlan` refuses. OSError,
        ConnectionError, ProtocolError: as `sink` and `source`.
    """
    p = argparse.ArgumentParser(prog="python -m harness.bench.wire peer")
    p.add_argument("--role", choices=["sink", "source"], required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=PORT)
    p.add_argument("--plan", help="source: the plan as JSON")
    p.add_argument("--out", help="source: write the result JSON here")
    p.add_argument("--recv-chunk-bytes", type=int, default=64 * MIB, help="sink: FrameReader's recv_chunk_bytes")
    p.add_argument("--read-ahead-bytes", type=int, default=0, help="sink: FrameReader's read_ahead_bytes")
    p.add_argument("--iperf3-port", type=int, default=IPERF3_PORT, help="the sink's iperf3 server port")
    p.add_argument("--no-iperf3", action="store_true", help="source: do not measure iperf3")
    args = p.parse_args(argv)
    if args.role == "sink":
        serve_sink(args.host, args.port, args.recv_chunk_bytes, args.iperf3_port, args.read_ahead_bytes)
        return 0
    if not args.plan or not args.out:
        p.error("--role source needs --plan and --out")
    plan = WirePlan.from_dict(json.loads(args.plan))
    sock = connect(args.host, args.port, timeout_s=CONNECT_TIMEOUT_S)
    with sock:
        result = source(sock, plan, lambda line: print(line, file=sys.stderr, flush=True),
                        iperf3_host=None if args.no_iperf3 else args.host, iperf3_port=args.iperf3_port)
    write_json_atomic(Path(args.out), result)
    return 0
