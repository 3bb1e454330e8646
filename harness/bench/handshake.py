"""``python -m harness.bench.handshake`` (also ``wiiide-lab bench-handshake``): a worker's admission
time and the run's samples/s while strangers attack the coordinator's handshake (docs/faults.md).

Each run, on loopback: a coordinator and one real worker (``python -m wiiide``, as the local backend
starts them; digits, ``--duration-s`` seconds of training), an attacker subprocess
(`harness.bench.handshake_attack`) bound to 127.0.0.2 (Linux routes all of 127.0.0.0/8 to lo, so the
coordinator sees another peer address), and a probe worker in this process, from 127.0.0.1. Scenarios:

- ``none``: no attack: the baseline, run *beside* each attacked run, at the same time on the same
  machine (two clusters on two ports), so both see the same load from everything else on a shared
  machine, the attacker's own CPU included; each attacked run is compared with its twin;
- ``slowloris``: ``--slowloris-connections`` (50) connections, each sending a frame prefix that
  announces a 4 GiB payload, then one byte per second, each reopened once the coordinator closes it;
- ``flood``: bursts of ``--flood-connections`` (500) connections opened as fast as the attacker can,
  each sending junk (half a bad magic, half three bytes and silence), a new burst one second after
  the coordinator closed the last one.

The attack starts once the coordinator listens; the probe connects 1.5 x handshake_timeout_s later
(every slot the attacker can take is taken by then) and measures its **admission time**: from its
first connect to the coordinator's authenticated welcome (retrying on a refusal). The probe then
trains as worker 2 of a central server (``ps_shards: 1``: answering every batch with a zero gradient
at once, so the real worker sets the pace; the handshake is the same for every placement) and the
coordinator's metrics give **samples/s** (samples / train_time_s), its **peak RSS** and its refusal
counts. The JSON (``results/bench-handshake-<UTC stamp>.json``) keeps every raw run,
``machine_info``, ``commit_info`` and the 1-minute load average before and after each run, and per
attacked scenario the median admission time, the median of samples/s over its twin's (and the raw
ratios) and the median peak RSS growth over the twin.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from harness import REPO_ROOT
from harness.run.machine import commit_info, machine_info
from wiiide.config import RunConfig
from wiiide.metrics import write_json_atomic
from wiiide.wire.auth import generate_secret, hello_frame, verify, welcome_mac
from wiiide.wire.encode import encode_message
from wiiide.wire.format import PROTOCOL_VERSION
from wiiide.wire.messages import WireTensor
from wiiide.wire.reader import FrameReader
from wiiide.wire.send import send_frames

Log = Callable[[str], None]

SCENARIOS = ("none", "slowloris", "flood")
PROBE_ADDRESS = "127.0.0.1"


# --------------------------------------------------------------------------------------------------
# The probe worker (this process)
# --------------------------------------------------------------------------------------------------
def probe_join(port: int, secret: bytes, node_id: str, give_up_s: float) -> tuple[socket.socket, FrameReader, dict]:
    """Connect from PROBE_ADDRESS and authenticate, retrying on a refusal, for up to `give_up_s`.

    Returns the joined socket, its reader and ``{"admission_s", "attempts", "refusals"}``: seconds from
    the first connect to the verified welcome. Raises TimeoutError when it never joins.
    """
    t0 = time.monotonic()
    attempts, refusals = 0, []
    while time.monotonic() - t0 < give_up_s:
        attempts += 1
        sock = socket.socket()
        try:
            sock.bind((PROBE_ADDRESS, 0))
            sock.settimeout(max(0.1, give_up_s - (time.monotonic() - t0)))
            sock.connect(("127.0.0.1", port))
            reader = FrameReader(sock, 64 << 20)
            nonce_c = reader.read_message().meta["nonce"]
            hello, nonce_w = hello_frame(secret, nonce_c, node_id)
            send_frames(sock, [hello])
            welcome = reader.read_message()
            while welcome.kind == "heartbeat":
                welcome = reader.read_message()
            if welcome.kind != "welcome":
                raise ConnectionError(f"{welcome.kind}: {welcome.meta.get('reason')}")
            verify(welcome_mac(secret, PROTOCOL_VERSION, nonce_w, nonce_c, welcome.meta["rank"]), welcome.meta["mac"],
                   "welcome")
            sock.settimeout(60.0)
            return sock, reader, {"admission_s": round(time.monotonic() - t0, 4), "attempts": attempts,
                                  "refusals": refusals[:5]}
        except Exception as exc:  # a refusal or a closed connection: try again
            refusals.append(f"{type(exc).__name__}: {exc}"[:200])
            sock.close()
            time.sleep(0.05)
    raise TimeoutError(f"the probe was not admitted within {give_up_s:g} s ({attempts} attempts; {refusals[-3:]})")


def probe_train(sock: socket.socket, reader: FrameReader) -> int:
    """Answer every batch with a zero gradient until ``stop``; returns the steps answered."""
    numel, steps = 0, 0
    try:
        while True:
            msg = reader.read_message()
            if msg.kind == "stop":
                return steps
            if msg.kind == "params":
                numel = msg.tensor("params").size
            elif msg.kind == "batch":
                send_frames(sock, [encode_message("gradients", {"step": msg.meta["step"], "loss": 1.0},
                                                  [WireTensor("grad", np.zeros(numel, np.float32))])])
                steps += 1
    except OSError:
        return steps
    finally:
        sock.close()


# --------------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(role: str, cfg: RunConfig, secret: str, stderr_path: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WIIIIIDE_")}
    env.update(cfg.to_env())
    env["WIIIIIDE_SECRET"] = secret
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    with open(stderr_path, "wb") as err:
        return subprocess.Popen([sys.executable, "-m", "wiiide", role], env=env, cwd=REPO_ROOT,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)


def _wait_file(path: Path, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {timeout_s:g} s")
        time.sleep(0.05)


def measure_run(scenario: str, params: dict[str, Any], work_dir: Path, log: Log) -> dict[str, Any]:
    """One run of `scenario` (none, slowloris, flood); returns its raw figures (module docstring)."""
    port = _free_port()
    secret = generate_secret()
    metrics_dir = work_dir / "metrics"
    cfg = RunConfig(port=port, num_workers=2, dataset="digits", duration_s=params["duration_s"],
                    handshake_timeout_s=params["handshake_timeout_s"], metrics_dir=str(metrics_dir),
                    ready_file=str(work_dir / "ready"), log_tier="normal", log_every_steps=100000,
                    connect_timeout_s=120, io_timeout_s=30,
                    ps_shards=1)  # the probe trains as a central server's worker; the handshake is every placement's
    load_before = os.getloadavg()[0]
    procs: list[subprocess.Popen] = []
    attacker: subprocess.Popen | None = None
    result: dict[str, Any] = {"scenario": scenario, "load_1m_before": round(load_before, 2)}
    try:
        procs.append(_node("coordinator", cfg, secret, work_dir / "coordinator.stderr"))
        procs.append(_node("worker", cfg.replace(node_id="real-worker"), secret, work_dir / "worker.stderr"))
        _wait_file(work_dir / "ready", 120)
        attack_s = params["duration_s"] + 60.0  # outlasts start-up and training; stopped at the end
        if scenario != "none":
            connections = params[f"{scenario}_connections"]
            attacker = subprocess.Popen(
                [sys.executable, "-m", "harness.bench.handshake_attack", scenario, "--port", str(port),
                 "--connections", str(connections), "--attack-s", str(attack_s)],
                cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
        time.sleep(1.5 * params["handshake_timeout_s"])
        sock, reader, joined = probe_join(port, secret.encode(), "probe", 4 * params["handshake_timeout_s"])
        result.update(joined)
        result["probe_steps"] = probe_train(sock, reader)
        coordinator_code = procs[0].wait(timeout=params["duration_s"] + 120)
        worker_code = procs[1].wait(timeout=60)
        result.update({"coordinator_exit": coordinator_code, "worker_exit": worker_code})
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if attacker is not None:
            if attacker.poll() is None:
                attacker.terminate()
            try:
                out, _ = attacker.communicate(timeout=20)
                result["attacker"] = json.loads(out.decode().strip().splitlines()[-1]) if out.strip() else None
            except (subprocess.TimeoutExpired, ValueError, IndexError):
                attacker.kill()
                attacker.wait()
    result["load_1m_after"] = round(os.getloadavg()[0], 2)
    coordinator_file = metrics_dir / "coordinator.json"
    if coordinator_file.exists():
        c = json.loads(coordinator_file.read_text())
        train_s = c.get("train_time_s") or 0
        result.update({
            "status": c["status"], "steps": c["steps"], "samples": c["samples"], "train_time_s": train_s,
            "samples_per_s": round(c["samples"] / train_s, 2) if train_s else None,
            "peak_rss_bytes": c["peak_rss_bytes"], "metrics_file_bytes": coordinator_file.stat().st_size,
            "refused": c.get("event_counts", {}).get("connection_refused", 0),
            "refused_beyond_cap": c.get("events_dropped", {}).get("connection_refused", {}),
            "events_kept": len(c.get("events", [])),
        })
    log(f"{scenario:9s} admission {result.get('admission_s')} s, {result.get('samples_per_s')} samples/s, "
        f"refused {result.get('refused')}, peak RSS {(result.get('peak_rss_bytes') or 0) / 2**20:.1f} MiB, "
        f"load {load_before:.2f}{'; ' + result['error'] if 'error' in result else ''}")
    return result


def summarize(runs: list[dict[str, Any]], handshake_timeout_s: float) -> dict[str, Any]:
    """Per scenario: median (and max) admission_s; for attacked scenarios, per pair the ratio of
    samples/s to the unattacked twin's and the peak RSS growth over it (MB), their medians, and
    whether the targets hold (admission within 2 x handshake_timeout_s in every run, median
    samples/s ratio >= 0.9, median RSS growth < 20 MB)."""
    def median(values: list[Any]) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    summary: dict[str, Any] = {}
    for scenario in SCENARIOS:
        rs = [r for r in runs if r["scenario"] == scenario]
        if not rs:
            continue
        admissions = [r.get("admission_s") for r in rs]
        entry: dict[str, Any] = {
            "runs": len(rs), "ok": sum(r.get("status") == "ok" for r in rs),
            "admission_s": {"median": median(admissions), "max": max((a if a is not None else float("inf"))
                                                                      for a in admissions), "raw": admissions},
            "samples_per_s": {"median": median([r.get("samples_per_s") for r in rs]),
                              "raw": [r.get("samples_per_s") for r in rs]},
            "refused_median": median([r.get("refused") for r in rs]),
        }
        if scenario != "none":
            twins = {(r["repeat"], r["pair"]): r for r in runs if r["scenario"] == "none"}
            ratios, growth = [], []
            for r in rs:
                twin = twins.get((r["repeat"], r["pair"]))
                if twin and r.get("samples_per_s") and twin.get("samples_per_s"):
                    ratios.append(round(r["samples_per_s"] / twin["samples_per_s"], 3))
                if twin and r.get("peak_rss_bytes") and twin.get("peak_rss_bytes"):
                    growth.append(round((r["peak_rss_bytes"] - twin["peak_rss_bytes"]) / 1e6, 1))
            entry.update({
                "samples_per_s_vs_twin": {"median": median(ratios), "raw": ratios},
                "peak_rss_growth_mb": {"median": median(growth), "raw": growth},
                "targets": {
                    "admitted_within_2_timeouts": all(a is not None and a <= 2 * handshake_timeout_s for a in admissions),
                    "samples_per_s_at_least_0.9x": bool(ratios) and median(ratios) >= 0.9,
                    "rss_growth_below_20_mb": bool(growth) and median(growth) < 20,
                },
            })
        summary[scenario] = entry
    return summary


def run_bench(params: dict[str, Any], results_dir: Path, log: Log) -> Path:
    """For each repeat and each attacked scenario, run it and an unattacked twin at the same time;
    write the JSON and return its path."""
    runs: list[dict[str, Any]] = []
    attacked = [s for s in params["scenarios"] if s != "none"] or ["none"]
    with tempfile.TemporaryDirectory(prefix="bench-handshake-") as tmp:
        for repeat in range(params["repeats"]):
            for pair, scenario in enumerate(attacked):
                scenarios = [scenario] if scenario == "none" else ["none", scenario]
                box: dict[str, dict[str, Any]] = {}
                threads = []
                for name in scenarios:
                    work_dir = Path(tmp) / f"{repeat}-{pair}-{name}"
                    work_dir.mkdir()
                    threads.append(threading.Thread(
                        target=lambda n=name, w=work_dir: box.__setitem__(n, measure_run(n, params, w, log))))
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                for name in scenarios:
                    runs.append({**box[name], "repeat": repeat, "pair": pair})
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = results_dir / f"bench-handshake-{stamp}.json"
    write_json_atomic(path, {
        "kind": "bench-handshake", "machine_info": machine_info(), "commit_info": commit_info(),
        "params": params, "summary": summarize(runs, params["handshake_timeout_s"]), "runs": runs,
    })
    return path


def format_summary(summary: dict[str, Any]) -> str:
    """A plain text table: one row per scenario (medians; ratios and growth against the twin)."""
    def num(value: Any, fmt: str) -> str:
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    lines = [f"{'scenario':10s} {'runs':>4s} {'admission_s':>11s} {'samples/s':>10s} {'vs twin':>8s} "
             f"{'RSS +MB':>8s} {'refused':>8s}"]
    for scenario, s in summary.items():
        lines.append(f"{scenario:10s} {s['runs']:4d} {num(s['admission_s']['median'], '11.4f')} "
                     f"{num(s['samples_per_s']['median'], '10.0f')} "
                     f"{num(s.get('samples_per_s_vs_twin', {}).get('median'), '8.3f')} "
                     f"{num(s.get('peak_rss_growth_mb', {}).get('median'), '8.1f')} "
                     f"{num(s['refused_median'], '8.0f')}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command line of ``bench-handshake``."""
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--repeats", type=int, default=3, help="runs per attacked scenario, each beside an "
                                                                   "unattacked twin (default 3)")
    parser.add_argument("--duration-s", type=float, default=10.0, help="seconds of training per run (default 10)")
    parser.add_argument("--handshake-timeout-s", type=float, default=5.0, help="the coordinator's (default 5)")
    parser.add_argument("--slowloris-connections", type=int, default=50)
    parser.add_argument("--flood-connections", type=int, default=500)
    parser.add_argument("--results-dir", default=str(REPO_ROOT / "results"))


def main_from_args(args: argparse.Namespace, log: Log) -> int:
    """Run the benchmark from parsed arguments, print the table and the JSON's path; exit code 0, or 1
    (each failed run's error on stderr) when a run failed."""
    params = {"scenarios": list(args.scenarios), "repeats": args.repeats, "duration_s": args.duration_s,
              "handshake_timeout_s": args.handshake_timeout_s, "slowloris_connections": args.slowloris_connections,
              "flood_connections": args.flood_connections}
    path = run_bench(params, Path(args.results_dir), log)
    data = json.loads(path.read_text())
    print(format_summary(data["summary"]))
    print(f"wrote {path}")
    failed = [r for r in data["runs"] if r.get("error") or r.get("status") != "ok"]
    for r in failed:
        print(f"error: {r['scenario']} run of repeat {r['repeat']}: "
              f"{r.get('error') or 'coordinator status ' + str(r.get('status'))}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m harness.bench.handshake [--repeats 3] [--duration-s 10]``."""
    parser = argparse.ArgumentParser(prog="python -m harness.bench.handshake", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return main_from_args(parser.parse_args(argv), lambda line: print(line, file=sys.stderr, flush=True))


if __name__ == "__main__":
    sys.exit(main())
