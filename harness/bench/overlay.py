"""``bench-overlay``: what the swarm's encrypted overlay (``overlay_encrypted``, ``docker network create
--opt encrypted``) costs in goodput against a plain overlay, measured as ``bench-tls`` measures TLS.

Two containers of the node image, a sink and a source, each attached to two internal, attachable overlay
networks made for the run on the engine's swarm (started for the run and left again when the engine was
in none, as the swarm backend does): ``plain`` and ``encrypted`` (driver option ``encrypted``). The sink
listens once, on all addresses; the source reaches it as ``sink-plain`` or ``sink-encrypted`` (aliases
scoped to each network), so the mode picks the network and nothing else changes. Trials are
`harness.bench.tls.run_trials`: a fresh plaintext WIIIIIDE connection per trial, ``count`` frames of one
float32 tensor of ``size_bytes``, goodput = payload bytes / (first send -> the sink's ack), repeats
interleaved (plain, encrypted, then encrypted, plain, ...) so both see the same load; each side's thread
CPU seconds per MiB.

What is encrypted: libnetwork programs IPsec ESP (transport mode, AES-GCM, keys rotated by the managers)
for the VXLAN traffic between *nodes* that have endpoints on the network. Two containers on one node
talk through the bridge inside the overlay's namespace, never through VXLAN, so nothing is encrypted
(and nothing is paid). The probe records what the kernel and the network did: the host's xfrm states
and policies, ``/proc/net/xfrm_stat``, the kernel's ESP and GCM options (``/proc/config.gz``), the
host's iptables rules on VXLAN's port 4789 (libnetwork's for an encrypted overlay), and the bytes each
overlay's VXLAN device and bridge carried (its namespace, ``/var/run/docker/netns/1-<id>``).

``python -m harness bench-overlay [--size 1MiB --bytes-per-trial-mib 256 --repeats 7]``
"""

from __future__ import annotations

import argparse
import gzip
import json
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

REPORT_NAME = "bench-overlay"
PORT = 29623  # the sink's port
MODES = ("plain", "encrypted")
NETNS_DIR = Path("/var/run/docker/netns")  # where dockerd keeps the overlays' namespaces (``1-<network id[:10]>``)
KERNEL_OPTIONS = ("CONFIG_XFRM", "CONFIG_XFRM_USER", "CONFIG_INET_ESP", "CONFIG_CRYPTO_GCM", "CONFIG_CRYPTO_AES",
                  "CONFIG_VXLAN", "CONFIG_MODULES", "CONFIG_NETFILTER_XT_MATCH_POLICY")


def _plain_cfg():
    from wiiide.config import RunConfig

    return RunConfig(log_tier="silent")


def sink_main(port: int) -> None:
    """Listen on 0.0.0.0:`port` (both networks), print ``listening``, serve trials until a ``done``."""
    from harness.bench.tls import SOCKET_BUFFER_BYTES, _serve

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    listener.bind(("0.0.0.0", port))
    listener.listen(4)
    print("listening", flush=True)
    _serve(listener, _plain_cfg(), False)


def source_main(port: int, plan: dict[str, Any], progress: Callable[[str], None]) -> dict[str, Any]:
    """The interleaved trials against ``sink-plain`` and ``sink-encrypted``; ``{"trials": [...]}``."""
    from harness.bench.tls import _connect, run_trials
    from wiiide.wire.encode import encode_message
    from wiiide.wire.send import send_frames

    cfg = _plain_cfg()
    connectors = {mode: (lambda host=f"sink-{mode}": _connect(host, port, cfg, False, "")) for mode in MODES}
    trials = run_trials(connectors, plan, progress)
    with connectors["plain"]() as sock:
        send_frames(sock, [encode_message("done")])
    return {"trials": trials}


def _run(argv: Sequence[str]) -> str:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise OSError(f"`{' '.join(argv)}` exit {out.returncode}: {out.stderr.strip()[:200]}")
    return out.stdout


def kernel_ipsec() -> dict[str, Any]:
    """This kernel's IPsec: its config options of `KERNEL_OPTIONS` (``y``, ``m`` or ``not set``; None
    when ``/proc/config.gz`` is missing) and ``/proc/net/xfrm_stat`` (counter -> value; None when absent)."""
    options: dict[str, str] | None = None
    try:
        text = gzip.decompress(Path("/proc/config.gz").read_bytes()).decode()
        options = {name: "not set" for name in KERNEL_OPTIONS}
        for line in text.splitlines():
            key, sep, value = line.partition("=")
            if sep and key in options:
                options[key] = value
    except OSError:
        pass
    try:
        xfrm_stat = {k: int(v) for k, v in (line.split() for line in Path("/proc/net/xfrm_stat").read_text().splitlines())}
    except (OSError, ValueError):
        xfrm_stat = None
    return {"config": options, "xfrm_stat": xfrm_stat}


def probe_networks(networks: list) -> dict[str, Any]:
    """What IPsec and VXLAN did on this host (see the module doc). Each part that cannot be read (not
    root, no ``ip``/``nsenter``, another host's engine) is recorded as ``"unavailable: <why>"``."""
    out: dict[str, Any] = {"kernel": kernel_ipsec()}
    for what, argv in (("host_xfrm_states", ["ip", "xfrm", "state"]), ("host_xfrm_policies", ["ip", "xfrm", "policy"])):
        try:
            out[what] = sum(1 for line in _run(argv).splitlines() if line.startswith("src "))
        except OSError as exc:
            out[what] = f"unavailable: {exc}"
    try:  # libnetwork's rules for an encrypted overlay (drivers/overlay/encryption.go, programInput/programMangle)
        out["host_iptables_vxlan_rules"] = [line for line in _run(["iptables-save"]).splitlines() if "4789" in line]
    except OSError as exc:
        out["host_iptables_vxlan_rules"] = f"unavailable: {exc}"
    vxlan: dict[str, Any] = {}
    for net in networks:
        netns = NETNS_DIR / f"1-{net.id[:10]}"
        try:
            links = json.loads(_run(["nsenter", f"--net={netns}", "ip", "-d", "-s", "-j", "link", "show"]))
            vxlan[net.name] = {link["ifname"]: {"kind": link["linkinfo"]["info_kind"],
                                                "tx_bytes": link["stats64"]["tx"]["bytes"],
                                                "rx_bytes": link["stats64"]["rx"]["bytes"]}
                               for link in links if (link.get("linkinfo") or {}).get("info_kind") in ("vxlan", "bridge")}
        except (OSError, ValueError, KeyError) as exc:
            vxlan[net.name] = f"unavailable: {exc}"
    out["vxlan_devices"] = vxlan
    return out


def _run_swarm(plan: dict[str, Any], scratch: Path, progress: Callable[[str], None]) -> dict[str, Any]:
    from harness import REPO_ROOT
    from harness.bench.pair import PairNetwork, Peer, run_pair
    from harness.run.docker_client import docker_client
    from harness.run.swarm.cluster import ensure_swarm, leave_swarm_if_ours, swarm_info
    from harness.run.swarm.encryption import EncryptionRules
    from harness.run.swarm.stack import ENCRYPTED_OPTION

    out_dir = scratch / "out"
    out_dir.mkdir(parents=True)
    mounts = {str(REPO_ROOT / "harness"): ("/app/harness", "ro"), str(out_dir): ("/out", "rw")}

    def peer(node: str, *options: str) -> Peer:
        return Peer(["python", "-m", "harness.bench.overlay", "--port", str(PORT), "--peer", node, *options],
                    node, mounts)

    client = docker_client()
    rules = EncryptionRules()
    rules.snapshot()
    removed: list = []
    started = ensure_swarm(client, progress)
    try:
        nodes = swarm_info(client).get("Nodes")
        result, backend = run_pair(
            REPORT_NAME, peer("sink"), peer("source", "--plan", json.dumps(plan), "--out", "/out/source.json"),
            out_dir / "source.json", progress,
            networks=[PairNetwork("plain"), PairNetwork("encrypted", options={ENCRYPTED_OPTION: ""})],
            probe=probe_networks)
    finally:
        removed = rules.cleanup(progress)
        if started:
            leave_swarm_if_ours(client, progress)
    backend["iptables_rules_removed"] = [{"table": table, "rule": line} for table, line in removed]
    return {"backend": {"name": "swarm", "swarm_nodes": nodes, "swarm_started_by_bench": started,
                        "transport": "TCP between two containers on this node, on two internal attachable overlays "
                                     "(one with --opt encrypted)", **backend}, **result}


def run_bench(size_bytes: int, bytes_per_trial: int, repeats: int, results_dir: Path,
              progress: Callable[[str], None] = print) -> Path:
    """Run the trials on the swarm, write ``bench-overlay-<stamp>.json`` (raw trials, summary, probe,
    `machine_info`, `commit_info`) into `results_dir`; return its path.

    Raises:
        SpecError: sizes out of range. ClusterError: engine, swarm, image or container.
        OSError, ConnectionError, ProtocolError: the peers' connection failed.
    """
    import shutil

    from harness.bench.tls import summarize
    from harness.errors import SpecError
    from harness.run.machine import commit_info, machine_info
    from wiiide.metrics import write_json_atomic

    if not 4 <= size_bytes <= 256 << 20 or size_bytes % 4 or bytes_per_trial < size_bytes or repeats < 1:
        raise SpecError("bench-overlay: --size must be a multiple of 4 bytes in 4 B..256 MiB, --bytes-per-trial-mib "
                        "at least one frame, --repeats >= 1")
    plan = {"size_bytes": size_bytes, "count": bytes_per_trial // size_bytes, "repeats": repeats}
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    scratch = results_dir / f".{REPORT_NAME}-{stamp}"
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        result = _run_swarm(plan, scratch, progress)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = {"name": REPORT_NAME, "created_at_utc": started,
              "finished_at_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine_info": machine_info(), "commit_info": commit_info(), "plan": plan, **result,
              "summary": summarize(result["trials"], MODES)}
    path = results_dir / f"{REPORT_NAME}-{stamp}.json"
    write_json_atomic(path, report)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench-overlay`` verb's options (bench-tls's trial options)."""
    from harness.bench.tls import add_trial_arguments

    add_trial_arguments(p, REPORT_NAME)


def main_from_args(args: argparse.Namespace, progress: Callable[[str], None] = print) -> int:
    """The CLI verb: run, print the medians, what the probe saw, and the JSON's path; return 0.

    Raises:
        SpecError: bad options. ClusterError, OSError: as `run_bench`.
    """
    from harness.bench.tls import trial_options

    size_bytes, bytes_per_trial, results_dir = trial_options(args, REPORT_NAME)
    path = run_bench(size_bytes, bytes_per_trial, args.repeats, results_dir, progress)
    report = json.loads(path.read_text())
    s, probe = report["summary"], report["backend"].get("probe") or {}
    print(f"plain overlay {s['plain']['goodput_median_bytes_per_s'] / 1e6:.1f} MB/s, encrypted overlay "
          f"{s['encrypted']['goodput_median_bytes_per_s'] / 1e6:.1f} MB/s (medians); encrypted / plain "
          f"{s['encrypted_over_plain_median_of_ratios']:.2f}x (median of per-repeat ratios)")
    print(f"host xfrm states: {probe.get('host_xfrm_states')}, iptables rules on 4789: {len(probe.get('host_iptables_vxlan_rules') or [])}, overlay devices: {probe.get('vxlan_devices')}")
    print(path)
    return 0


def peer_main(argv: Sequence[str] | None = None) -> int:
    """``python -m harness.bench.overlay --peer sink|source ...``: one peer, in its container."""
    p = argparse.ArgumentParser(prog="python -m harness.bench.overlay")
    p.add_argument("--peer", choices=["sink", "source"], required=True)
    p.add_argument("--port", type=int, default=PORT)
    p.add_argument("--plan", help="source: the plan as JSON")
    p.add_argument("--out", help="source: write the result JSON here")
    args = p.parse_args(argv)
    if args.peer == "sink":
        sink_main(args.port)
        return 0
    if not args.plan or not args.out:
        p.error("--peer source needs --plan and --out")
    from wiiide.metrics import write_json_atomic

    result = source_main(args.port, json.loads(args.plan), lambda line: print(line, file=sys.stderr, flush=True))
    write_json_atomic(Path(args.out), result)
    return 0


if __name__ == "__main__":
    sys.exit(peer_main())
