"""``bench-tls``: what TLS 1.3 (the ``tls`` knob, `wiiide.wire.tls`) costs in goodput, against plaintext.

Two peers, a sink and a source, as two containers of the node image on a bridge (``--backend docker``)
or two processes over 127.0.0.1 (``local``). The sink listens on three ports: one plaintext, one TLS
(`wiiide.wire.tls.wrap_server`, mutual authentication against a CA made for this run by
`harness.run.certs`), one TLS over `ssl.SSLSocket` (``--with-sslsocket``). Each trial opens a fresh connection of one mode, sends ``count`` WIIIIIDE frames
of ``size_bytes`` (one float32 tensor each, `wiiide.wire.send.send_frames`: ``sendmsg`` on plaintext,
`wiiide.wire.tls_stream.TLSStream.send_buffers` on TLS) and waits for the sink's ``ack`` once it has read them all
with a `FrameReader` (``recv_chunk_bytes`` reads, as the nodes read). Goodput = payload bytes /
(first send -> ack); the connection's setup (TCP connect, TLS handshake) is timed apart, as ``connect_s``.

Repeats are interleaved (plain, TLS, then TLS, plain, ...) so that both modes see the same load; the
summary gives medians and the median of the per-repeat ratios TLS / plaintext (the target,
`TARGET_RATIO`: >= 0.8x for 1 MiB frames), and each side's CPU seconds per MiB (`time.thread_time` of the sending and
of the receiving thread: user + system), which, unlike goodput, does not depend on what else the
machine runs. The JSON keeps every raw trial, `machine_info` and `commit_info`.

``--with-sslsocket`` adds a third mode, ``tls_sslsocket``: TLS over `ssl.SSLSocket` on both sides (the
transport before `wiiide.wire.tls_stream.TLSStream`), interleaved with the other two, so the two TLS transports
are compared in one run.

``python -m harness bench-tls --backend docker [--size 1MiB --bytes-per-trial-mib 256 --repeats 7 --with-sslsocket]``
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

REPORT_NAME = "bench-tls"
PLAIN_PORT, TLS_PORT, TLS_SSLSOCKET_PORT = 29621, 29622, 29623  # the sink's ports in the docker backend
SOCKET_BUFFER_BYTES = 8 * 1024 * 1024  # the nodes' default sndbuf/rcvbuf
CONNECT_TIMEOUT_S = 60.0
TARGET_RATIO = 0.8  # the target: TLS goodput >= 0.8x plaintext for 1 MiB frames between containers
MODES = ("plain", "tls")
SSLSOCKET_MODE = "tls_sslsocket"  # --with-sslsocket: TLS over ssl.SSLSocket, the transport before wiiide.wire.tls_stream.TLSStream


def _node_cfg(tls_dir: str | None):
    """The RunConfig the peers' sockets follow (the nodes' defaults), with TLS files when given."""
    from wiiide.config import RunConfig

    if tls_dir is None:
        return RunConfig(log_tier="silent")
    base = tls_dir.rstrip("/")
    return RunConfig(log_tier="silent", tls=True, tls_ca_file=f"{base}/ca.crt", tls_cert_file=f"{base}/node.crt",
                     tls_key_file=f"{base}/node.key", handshake_timeout_s=30.0)


def _serve(listener: socket.socket, cfg, tls: bool, memory_bio: bool = True) -> None:
    """Serve trials on `listener` one connection at a time until a ``done`` frame; each connection
    carries one trial: a ``trial`` frame (``count``), ``count`` frames, then this side's ``ack``.
    `memory_bio`: with `tls`, `wiiide.wire.tls_stream.TLSStream` (False: an `ssl.SSLSocket`)."""
    from wiiide.wire.encode import encode_message
    from wiiide.wire.reader import FrameReader
    from wiiide.wire.send import send_frames
    from wiiide.wire.sockets import configure_socket
    from wiiide.wire.tls import wrap_server

    while True:
        conn, _ = listener.accept()
        configure_socket(conn, cfg)
        if tls:
            conn = wrap_server(conn, cfg, memory_bio=memory_bio)
        conn.settimeout(CONNECT_TIMEOUT_S)
        with conn:
            reader = FrameReader(conn, 1 << 31, cfg.recv_chunk_bytes, quickack=cfg.tcp_quickack, reuse_buffers=True)
            control = reader.read_message()
            if control.kind == "done":
                return
            cpu0_s = time.thread_time()
            for _ in range(int(control.meta["count"])):
                reader.read_message()
            send_frames(conn, [encode_message("ack", {"cpu_s": time.thread_time() - cpu0_s})])


def sink_main(host: str, tls_dir: str, plain_port: int, tls_port: int, tls_sslsocket_port: int) -> None:
    """Listen on the three ports (plaintext, TLS, TLS over `ssl.SSLSocket`), print ``listening``, serve
    until each port got its ``done``."""
    cfg = _node_cfg(tls_dir)
    threads = []
    for port, tls, memory_bio in ((plain_port, False, True), (tls_port, True, True), (tls_sslsocket_port, True, False)):
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        listener.bind((host, port))
        listener.listen(4)
        threads.append(threading.Thread(target=_serve, args=(listener, cfg, tls, memory_bio), daemon=True))
    print("listening", flush=True)
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _connect(host: str, port: int, cfg, tls: bool, server_name: str, memory_bio: bool = True) -> socket.socket:
    from wiiide.wire.sockets import configure_socket
    from wiiide.wire.tls import wrap_client

    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        configure_socket(sock, cfg)
        try:
            sock.connect((host, port))
            break
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    if tls:
        sock = wrap_client(sock, cfg, server_name, memory_bio=memory_bio)
    sock.settimeout(CONNECT_TIMEOUT_S)
    return sock


def source_main(host: str, tls_dir: str, plain_port: int, tls_port: int, tls_sslsocket_port: int,
                plan: dict[str, Any], progress: Callable[[str], None]) -> dict[str, Any]:
    """Run the interleaved trials of ``plan["modes"]`` (default plain, tls) against the sink; returns
    ``{"trials": [...]}`` (raw values)."""
    from wiiide.wire.encode import encode_message
    from wiiide.wire.send import send_frames

    plain_cfg, tls_cfg = _node_cfg(None), _node_cfg(tls_dir)
    ports = {"plain": (plain_port, False, True), "tls": (tls_port, True, True),
             SSLSOCKET_MODE: (tls_sslsocket_port, True, False)}

    def connector(mode: str) -> Callable[[], socket.socket]:
        port, tls, memory_bio = ports[mode]
        return lambda: _connect(host, port, tls_cfg if tls else plain_cfg, tls, plan["server_name"], memory_bio)

    connectors = {mode: connector(mode) for mode in plan.get("modes", MODES)}
    trials = run_trials(connectors, plan, progress)
    for mode in ports:  # every port of the sink waits for its done
        with connector(mode)() as sock:
            send_frames(sock, [encode_message("done")])
    return {"trials": trials}


def run_trials(connectors: dict[str, Callable[[], socket.socket]], plan: dict[str, Any],
               progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """``plan["repeats"]`` rounds of one trial per mode (the order of `connectors`, reversed every other
    round), each on a fresh connection from its connector: a ``trial`` frame, ``plan["count"]`` frames of
    one float32 tensor of ``plan["size_bytes"]``, then the sink's ``ack``. Returns the raw trials
    (mode, repeat, seconds, connect_s, goodput_bytes_per_s, each side's thread CPU seconds).

    Raises:
        ConnectionError: the sink answered something else than ``ack``; OSError: the connection failed.
    """
    import numpy as np

    from wiiide.wire.encode import encode_message
    from wiiide.wire.messages import WireTensor
    from wiiide.wire.reader import FrameReader
    from wiiide.wire.send import send_frames

    modes = list(connectors)
    size_bytes, count = int(plan["size_bytes"]), int(plan["count"])
    payload = np.random.default_rng(0).standard_normal(size_bytes // 4, dtype=np.float32)
    frames = [encode_message("gradients", {"i": 0}, [WireTensor("g", payload)])]
    trials = []
    for repeat in range(int(plan["repeats"])):
        for mode in (modes if repeat % 2 == 0 else modes[::-1]):
            t0 = time.perf_counter()
            sock = connectors[mode]()
            connect_s = time.perf_counter() - t0
            with sock:
                reader = FrameReader(sock, 1 << 20)
                t1, cpu1_s = time.perf_counter(), time.thread_time()
                send_frames(sock, [encode_message("trial", {"count": count})])
                for _ in range(count):
                    send_frames(sock, frames)
                ack = reader.read_message()
                seconds, source_cpu_s = time.perf_counter() - t1, time.thread_time() - cpu1_s
            if ack.kind != "ack":
                raise ConnectionError(f"expected an ack, got {ack.kind!r}")
            goodput = count * size_bytes / seconds
            trials.append({"mode": mode, "repeat": repeat, "frames": count, "size_bytes": size_bytes,
                           "seconds": seconds, "connect_s": connect_s, "goodput_bytes_per_s": goodput,
                           "source_cpu_s": source_cpu_s, "sink_cpu_s": float(ack.meta.get("cpu_s", 0.0))})
            progress(f"repeat {repeat + 1}/{plan['repeats']} {mode:5s}: {goodput / 1e6:8.1f} MB/s "
                     f"(connect {connect_s * 1e3:.1f} ms)")
    return trials


def summarize(trials: Sequence[dict[str, Any]], modes: Sequence[str] = MODES) -> dict[str, Any]:
    """Medians per mode (goodput bytes/s, connect s) and the ratio of each later mode to the first
    (``tls_over_plain_...`` by default): the median of the per-repeat ratios (each repeat ran the modes
    back to back) and the ratio of the medians. ``meets_target``: the second mode's median of ratios."""
    base, other, *more = modes
    by_mode = {m: [t for t in trials if t["mode"] == m] for m in modes}
    out: dict[str, Any] = {}
    for mode, rows in by_mode.items():
        values = [t["goodput_bytes_per_s"] for t in rows]
        out[mode] = {"goodput_median_bytes_per_s": statistics.median(values), "goodput_min_bytes_per_s": min(values),
                     "goodput_max_bytes_per_s": max(values),
                     "connect_median_s": statistics.median(t["connect_s"] for t in rows), "trials": len(rows),
                     # CPU seconds (user + system, of the sending / receiving thread) per MiB: what the
                     # mode costs whatever else runs on the machine
                     "source_cpu_median_s_per_mib": statistics.median(
                         t["source_cpu_s"] / (t["frames"] * t["size_bytes"] / 2**20) for t in rows),
                     "sink_cpu_median_s_per_mib": statistics.median(
                         t["sink_cpu_s"] / (t["frames"] * t["size_bytes"] / 2**20) for t in rows)}
    plain = {t["repeat"]: t["goodput_bytes_per_s"] for t in by_mode[base]}
    for mode in (other, *more):
        ratios = [t["goodput_bytes_per_s"] / plain[t["repeat"]] for t in by_mode[mode] if t["repeat"] in plain]
        out[f"{mode}_over_{base}_median_of_ratios"] = statistics.median(ratios)
        out[f"{mode}_over_{base}_ratio_of_medians"] = (out[mode]["goodput_median_bytes_per_s"]
                                                       / out[base]["goodput_median_bytes_per_s"])
    out["target_ratio"] = TARGET_RATIO
    out["meets_target"] = out[f"{other}_over_{base}_median_of_ratios"] >= TARGET_RATIO
    return out


def _run_local(plan: dict[str, Any], tls_root: Path, progress: Callable[[str], None]) -> dict[str, Any]:
    from harness import REPO_ROOT
    from harness.run.local import free_port

    plain_port, tls_port, tls_sslsocket_port = free_port(), free_port(), free_port()
    argv = [sys.executable, "-m", "harness.bench.tls", "--peer", "sink", "--host", "127.0.0.1",
            "--tls-dir", str(tls_root / "sink"), "--plain-port", str(plain_port), "--tls-port", str(tls_port),
            "--tls-sslsocket-port", str(tls_sslsocket_port)]
    sink = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        sink.stdout.readline()  # "listening"
        result = source_main("127.0.0.1", str(tls_root / "source"), plain_port, tls_port, tls_sslsocket_port, plan,
                             progress)
        sink.wait(timeout=60)
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait(timeout=10)
    return {"backend": {"name": "local", "transport": "TCP over 127.0.0.1, two processes"}, **result}


def _run_docker(plan: dict[str, Any], tls_root: Path, progress: Callable[[str], None]) -> dict[str, Any]:
    from harness import REPO_ROOT
    from harness.bench.pair import Peer, run_pair

    out_dir = tls_root / "out"
    out_dir.mkdir()

    def peer(node: str, *options: str) -> Peer:
        return Peer(["python", "-m", "harness.bench.tls", "--tls-dir", "/tls", "--plain-port", str(PLAIN_PORT),
                     "--tls-port", str(TLS_PORT), "--tls-sslsocket-port", str(TLS_SSLSOCKET_PORT), "--peer", node,
                     *options], node,
                    {str(REPO_ROOT / "harness"): ("/app/harness", "ro"), str(tls_root / node): ("/tls", "ro"),
                     str(out_dir): ("/out", "rw")})

    result, backend = run_pair(REPORT_NAME, peer("sink", "--host", "0.0.0.0"),
                               peer("source", "--host", "sink", "--plan", json.dumps(plan), "--out", "/out/source.json"),
                               out_dir / "source.json", progress)
    return {"backend": {"name": "docker", "transport": "TCP between two containers on a user-defined bridge",
                        **backend}, **result}


def run_bench(backend: str, size_bytes: int, bytes_per_trial: int, repeats: int, results_dir: Path,
              progress: Callable[[str], None] = print, with_sslsocket: bool = False) -> Path:
    """Make the certificates, run the trials on `backend`, write ``bench-tls-<stamp>.json``; return its path.
    `with_sslsocket`: a third mode, ``tls_sslsocket`` (TLS over `ssl.SSLSocket`, the transport before
    `wiiide.wire.tls_stream.TLSStream`), interleaved with the other two.

    The certificates live in a scratch folder of `results_dir`, removed at the end.

    Raises:
        SpecError: unknown backend or sizes out of range. ClusterError: (docker) engine, image or container.
        OSError, ConnectionError, ProtocolError: the peers' connection failed.
    """
    import shutil

    from harness.errors import SpecError
    from harness.run.certs import write_cluster_tls
    from harness.run.machine import commit_info, machine_info
    from wiiide.metrics import write_json_atomic

    runners = {"local": _run_local, "docker": _run_docker}
    if backend not in runners:
        raise SpecError(f"bench-tls: unknown backend {backend!r}; one of {sorted(runners)}")
    if not 4 <= size_bytes <= 256 << 20 or size_bytes % 4 or bytes_per_trial < size_bytes or repeats < 1:
        raise SpecError("bench-tls: --size must be a multiple of 4 bytes in 4 B..256 MiB, --bytes-per-trial-mib at "
                        "least one frame, --repeats >= 1")
    plan = {"size_bytes": size_bytes, "count": bytes_per_trial // size_bytes, "repeats": repeats,
            "server_name": "sink" if backend == "docker" else "127.0.0.1",
            "modes": [*MODES, SSLSOCKET_MODE] if with_sslsocket else list(MODES)}
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    scratch = results_dir / f".{REPORT_NAME}-{stamp}"
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        write_cluster_tls(scratch, {"sink": ["sink", "127.0.0.1"], "source": ["source"]}, REPORT_NAME)
        result = runners[backend](plan, scratch, progress)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = {"name": REPORT_NAME, "created_at_utc": started,
              "finished_at_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine_info": machine_info(), "commit_info": commit_info(), "plan": plan, **result,
              "summary": summarize(result["trials"], plan["modes"])}
    path = results_dir / f"{REPORT_NAME}-{stamp}.json"
    write_json_atomic(path, report)
    return path


def add_trial_arguments(p: argparse.ArgumentParser, report_name: str) -> None:
    """The trial options of a `run_trials` bench (bench-tls, bench-overlay): size, MiB per trial, repeats, results dir."""
    p.add_argument("--size", default="1MiB", help="frame payload size, IEC (default 1MiB)")
    p.add_argument("--bytes-per-trial-mib", type=int, default=256, help="MiB per trial (default 256)")
    p.add_argument("--repeats", type=int, default=7, help="interleaved repeats of each mode (default 7)")
    p.add_argument("--results-dir", help=f"where {report_name}-<stamp>.json goes (default results/)")


def trial_options(args: argparse.Namespace, report_name: str) -> tuple[int, int, Path]:
    """(frame size in bytes, bytes per trial, the results folder, created if missing) from `add_trial_arguments`' options.

    Raises:
        SpecError: ``--size`` is not an IEC size (naming `report_name`).
    """
    from harness import REPO_ROOT
    from harness.errors import SpecError
    from wiiide.units import MIB, UnitError, parse_size_bytes

    try:
        size_bytes = parse_size_bytes(args.size, "--size")
    except UnitError as exc:
        raise SpecError(f"{report_name}: {exc}") from None
    results_dir = Path(args.results_dir) if args.results_dir else REPO_ROOT / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    return size_bytes, args.bytes_per_trial_mib * MIB, results_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench-tls`` verb's options."""
    p.add_argument("--backend", choices=["local", "docker"], default="local")
    p.add_argument("--with-sslsocket", action="store_true",
                   help=f"also run TLS over ssl.SSLSocket (the transport before TLSStream) as a third mode, {SSLSOCKET_MODE}")
    add_trial_arguments(p, REPORT_NAME)


def main_from_args(args: argparse.Namespace, progress: Callable[[str], None] = print) -> int:
    """The CLI verb: run, print the medians and the JSON's path; return 0.

    Raises:
        SpecError: bad options. ClusterError, OSError: as `run_bench`.
    """
    size_bytes, bytes_per_trial, results_dir = trial_options(args, REPORT_NAME)
    path = run_bench(args.backend, size_bytes, bytes_per_trial, args.repeats, results_dir, progress,
                     args.with_sslsocket)
    s = json.loads(path.read_text())["summary"]
    print(f"plaintext {s['plain']['goodput_median_bytes_per_s'] / 1e6:.1f} MB/s, TLS 1.3 "
          f"{s['tls']['goodput_median_bytes_per_s'] / 1e6:.1f} MB/s (medians); TLS / plaintext "
          f"{s['tls_over_plain_median_of_ratios']:.2f}x (median of per-repeat ratios; target >= {TARGET_RATIO}x)")
    print("CPU per MiB (median; sender / receiver thread): plaintext "
          f"{s['plain']['source_cpu_median_s_per_mib'] * 1e3:.2f} / {s['plain']['sink_cpu_median_s_per_mib'] * 1e3:.2f} ms, "
          f"TLS {s['tls']['source_cpu_median_s_per_mib'] * 1e3:.2f} / {s['tls']['sink_cpu_median_s_per_mib'] * 1e3:.2f} ms")
    if SSLSOCKET_MODE in s:
        old = s[SSLSOCKET_MODE]
        print(f"TLS over ssl.SSLSocket: {old['goodput_median_bytes_per_s'] / 1e6:.1f} MB/s, "
              f"{s[f'{SSLSOCKET_MODE}_over_plain_median_of_ratios']:.2f}x plaintext; CPU per MiB "
              f"{old['source_cpu_median_s_per_mib'] * 1e3:.2f} / {old['sink_cpu_median_s_per_mib'] * 1e3:.2f} ms")
    print(path)
    return 0


def peer_main(argv: Sequence[str] | None = None) -> int:
    """``python -m harness.bench.tls --peer sink|source ...``: one peer (in a container or a process)."""
    p = argparse.ArgumentParser(prog="python -m harness.bench.tls")
    p.add_argument("--peer", choices=["sink", "source"], required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--tls-dir", required=True, help="this peer's ca.crt, node.crt, node.key")
    p.add_argument("--plain-port", type=int, default=PLAIN_PORT)
    p.add_argument("--tls-port", type=int, default=TLS_PORT)
    p.add_argument("--tls-sslsocket-port", type=int, default=TLS_SSLSOCKET_PORT)
    p.add_argument("--plan", help="source: the plan as JSON")
    p.add_argument("--out", help="source: write the result JSON here")
    args = p.parse_args(argv)
    if args.peer == "sink":
        sink_main(args.host, args.tls_dir, args.plain_port, args.tls_port, args.tls_sslsocket_port)
        return 0
    if not args.plan or not args.out:
        p.error("--peer source needs --plan and --out")
    from wiiide.metrics import write_json_atomic

    result = source_main(args.host, args.tls_dir, args.plain_port, args.tls_port, args.tls_sslsocket_port,
                         json.loads(args.plan),
                         lambda line: print(line, file=sys.stderr, flush=True))
    write_json_atomic(Path(args.out), result)
    return 0


if __name__ == "__main__":
    sys.exit(peer_main())
