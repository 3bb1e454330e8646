"""Per-container settings of a point (harness/spec/cluster.py) as sweep specs give them: link
profiles by role and worker, presets, cpus and mem_limit; the local backend refusing them; the
report's link columns; the coordinator's start gate; compose.yaml's limit variables."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import yaml

from harness.errors import ClusterError, SpecError
from harness.links.plan import Capabilities, plan_shaping
from harness.present.table import format_table
from harness.run.local import LocalBackend
from harness.run.loop import run_point
from harness.spec.cluster import (
    ClusterSettings,
    load_presets,
    param_label,
    parse_cluster,
    parse_link,
)
from harness.spec.links import LinkProfile
from harness.spec.points import build_spec, load_spec
from harness.sweep import run_sweep
from wiiide.config import RunConfig
from wiiide.log import TieredLog
from wiiide.metrics import NodeMetrics
from wiiide.wire.node import NodeFailure, wait_for_start_gate

REPO_ROOT = Path(__file__).resolve().parents[2]
PRESETS = {"slow": {"rate": "10mbit"}, "fast": {"rate": "1gbit"}, "wan": {"rate": "100mbit", "delay": "20ms"}}
NO_NETEM = Capabilities(netem=False, tbf=True, htb=True, ifb=True)


def spec_with(base=None, axes=None, **extra):
    return build_spec({"name": "t", "base": {"num_workers": 3, **(base or {})}, "axes": axes or {},
                       "link_presets": PRESETS, **extra}, "t.yaml")


def test_one_profile_for_every_container():
    for value in ("slow", {"rate": "10mbit"}):
        setting = parse_link(value, PRESETS, "link")
        profiles = [setting.profiles.for_container("coordinator")] + \
            [setting.profiles.for_container("worker", i) for i in (1, 2, 3)]
        assert all(p.rate_bps == 10_000_000 for p in profiles) and setting.allow_partial is False
    assert parse_link("slow", PRESETS, "link").profiles.for_container("worker", 1).name == "slow"
    assert parse_link("none", PRESETS, "link") is None and parse_link(None, PRESETS, "link") is None


def test_roles_and_workers_most_specific_wins():
    setting = parse_link({"all": "fast", "coordinator": "slow", "worker-2": {"rate": "5mbit"}, "worker-3": "none",
                          "allow_partial": True}, PRESETS, "link")
    get = setting.profiles.for_container
    assert get("coordinator").rate_bps == 10_000_000
    assert get("worker", 1).rate_bps == 10**9 and get("worker", 2).rate_bps == 5_000_000
    assert get("worker", 3) is None  # explicitly unshaped beats `all`
    assert setting.allow_partial is True and setting.label == "fast coordinator=slow worker-2=inline worker-3=none (partial)"
    worker_only = parse_link({"worker": "slow"}, PRESETS, "link").profiles
    assert worker_only.for_container("coordinator") is None and worker_only.for_container("worker", 7).rate_bps == 10**7


@pytest.mark.parametrize("value, needle", [
    ("nope", "unknown link preset 'nope'"),
    ({"coordinator": "slow", "switch": "fast"}, "link.switch: unknown key"),
    ({"worker-0": "slow"}, "numbered from 1"),
    ({"rate": "10mbit", "coordinator": "slow"}, "only profile keys"),
    ({"allow_partial": "yes", "rate": "1gbit"}, "allow_partial"),
    ({"allow_partial": True}, "no profile"),
    ({"coordinator": 12}, "expected a preset name or a mapping"),
    ({"coordinator": {"rate": "1gbit", "jitter": "5ms"}}, "link.coordinator: link profile 'inline': jitter"),
])
def test_bad_link_values_name_the_path(value, needle):
    with pytest.raises(SpecError, match=needle):
        parse_link(value, PRESETS, "link")


def test_spec_expands_link_cpus_and_mem_axes():
    spec = spec_with(base={"link": "fast", "mem_limit": "1GiB"},
                     axes={"link": ["slow", {"coordinator": "slow", "worker": "fast"}], "cpus": [0, {"worker-2": 0.5}]})
    assert [p.params for p in spec.points] == [
        {"link": "slow", "cpus": 0}, {"link": "slow", "cpus": "worker-2=0.5"},
        {"link": "coordinator=slow worker=fast", "cpus": 0}, {"link": "coordinator=slow worker=fast", "cpus": "worker-2=0.5"}]
    first, last = spec.points[0], spec.points[-1]
    assert first.cluster.cpus is None and first.cluster.mem_limit.for_container("worker", 1) == 2**30
    assert last.cluster.cpus.for_container("worker", 2) == 0.5 and last.cluster.cpus.for_container("worker", 1) is None
    assert "link" not in first.config.to_dict() and first.config.num_workers == 3
    assert spec.to_dict()["link_presets"] == PRESETS
    assert first.cluster.to_dict()["link"]["profiles"]["all"]["rate_bps"] == 10_000_000


@pytest.mark.parametrize("base, axes, needle", [
    ({"link": {"rate": 100}}, {}, "t.yaml: base.link: link profile 'inline': rate: 100 needs a unit"),
    ({}, {"link": ["slow", {"delay": "5ms", "jitter": "9ms"}]}, "t.yaml: axes.link[1]: "),
    ({"link": {"worker-4": "slow"}}, {}, "t.yaml: base.link: worker-4 but the point has 3 workers"),
    ({}, {"cpus": [0.5, 99]}, "t.yaml: axes.cpus[1]: 99 CPUs; allowed: 0 (no limit) or 0.01.."),
    ({}, {"cpus": [{"worker-1": "lots"}]}, "axes.cpus[0].worker-1: 'lots' is not a number of CPUs"),
    ({"mem_limit": "12kb"}, {}, "base.mem_limit: '12kb' is below Docker's minimum"),
    ({"mem_limit": "a lot"}, {}, "base.mem_limit: 'a lot' is not a size"),
    ({"links": "slow"}, {}, "base.links: unknown config field"),
])
def test_bad_cluster_values_stop_the_spec_with_file_and_path(base, axes, needle):
    with pytest.raises(SpecError) as info:
        spec_with(base=base, axes=axes)
    assert needle in str(info.value)


def test_compose_env_and_per_worker_updates():
    uniform = parse_cluster({"cpus": {"coordinator": 1.5, "worker": 0.5}, "mem_limit": "512MiB"}, {}, 2,
                            {"cpus": "cpus", "mem_limit": "mem_limit"})
    assert uniform.compose_env() == {"WIIIIIDE_COORDINATOR_CPUS": "1.5", "WIIIIIDE_WORKER_CPUS": "0.5",
                                     "WIIIIIDE_COORDINATOR_MEM_LIMIT": str(512 * 2**20),
                                     "WIIIIIDE_WORKER_MEM_LIMIT": str(512 * 2**20)}
    assert uniform.worker_updates(1) == {}  # Compose does it
    straggler = parse_cluster({"cpus": {"worker": 1, "worker-2": 0.25}, "mem_limit": {"worker-1": "256MiB"}}, {}, 2,
                              {"cpus": "cpus", "mem_limit": "mem_limit"})
    assert straggler.compose_env() == {}  # per-worker keys: every worker through the Engine API
    assert straggler.worker_updates(1) == {"cpu_period": 100_000, "cpu_quota": 100_000,
                                           "mem_limit": 256 * 2**20, "memswap_limit": 512 * 2**20}
    assert straggler.worker_updates(2) == {"cpu_period": 100_000, "cpu_quota": 25_000}
    assert ClusterSettings().is_empty and ClusterSettings().compose_env() == {}


def test_cpu_period_sets_the_workers_cfs_quota_per_that_period():
    paths = {"cpus": "cpus", "cpu_period_s": "cpu_period_s"}
    fine = parse_cluster({"cpus": {"worker-2": 0.25}, "cpu_period_s": 0.01}, {}, 2, paths)
    assert fine.worker_updates(2) == {"cpu_period": 10_000, "cpu_quota": 2_500}  # 2.5 ms in every 10 ms
    assert fine.worker_updates(1) == {}  # no limit for worker-1
    assert fine.to_dict()["cpu_period_s"] == 0.01
    role_wide = parse_cluster({"cpus": {"coordinator": 1.0, "worker": 0.5}, "cpu_period_s": 0.005}, {}, 2, paths)
    assert role_wide.compose_env() == {"WIIIIIDE_COORDINATOR_CPUS": "1.0"}  # Compose's cpus cannot take a period
    assert role_wide.worker_updates(1) == {"cpu_period": 5_000, "cpu_quota": 2_500}
    assert "cpu_period_s" not in parse_cluster({"cpus": 0.5}, {}, 2, paths).to_dict()  # Docker's 100 ms
    for bad, match in ((0.0001, "0.001..1"), (2, "0.001..1"), ("10ms", "0.001..1"), (True, "0.001..1")):
        with pytest.raises(SpecError, match=match):
            parse_cluster({"cpu_period_s": bad}, {}, 2, paths)
    with pytest.raises(SpecError, match="under the kernel's 1 ms"):  # 0.05 CPU x 10 ms = 0.5 ms
        parse_cluster({"cpus": {"worker-1": 0.05}, "cpu_period_s": 0.01}, {}, 2, paths)


def test_param_label():
    assert param_label("lan-1g") == "lan-1g" and param_label(0.5) == 0.5
    assert param_label({"all": "wan", "allow_partial": True}) == "wan (partial)"
    assert param_label({"worker-2": 0.25, "coordinator": {"rate": "1gbit"}}) == "worker-2=0.25 coordinator=inline"


def test_shipped_presets_and_the_links_experiment_run_on_a_kernel_without_netem():
    presets = load_presets()
    for name in ("lan-10g", "lan-1g", "wan-100m-20ms", "wan-10m-80ms", "lossy-wifi", "rate-100m", "rate-200m"):
        LinkProfile.from_mapping(presets[name], name)  # valid
    spec = load_spec(REPO_ROOT / "experiments" / "links.yaml")
    assert spec.param_names == ["link"] and len(spec.points) >= 6
    shaped = 0
    for point in spec.points:
        if point.cluster.link is None:
            continue
        shaped += 1
        for key in [("coordinator", None)] + [("worker", i) for i in range(1, point.config.num_workers + 1)]:
            plan = plan_shaping(point.cluster.link.profiles.for_container(*key), NO_NETEM,
                                point.cluster.link.allow_partial)  # never raises: delay only where partial
            assert plan.applied is None or plan.applied.rate_bps
    assert shaped == len(spec.points) - 1
    assert load_presets(REPO_ROOT / "experiments" / "quick.yaml") == {}


def test_presets_of_the_spec_add_to_the_shipped_ones():
    spec = spec_with(base={"link": "lan-1g"}, axes={"link": ["wan", "rate-100m"]})
    assert [p.cluster.link.profiles.for_container("worker", 1).rate_bps for p in spec.points] == [10**8, 10**8]


def test_the_local_backend_refuses_links_and_limits_before_anything_runs(tmp_path):
    spec = spec_with(axes={"link": ["slow"]})
    with pytest.raises(ClusterError, match="the local backend cannot shape links .*asked: link.*--backend docker"):
        run_sweep(spec, "local", tmp_path, progress=lambda line: None)
    assert list(tmp_path.iterdir()) == []  # no report folder: it stopped before
    with pytest.raises(ClusterError, match="asked: cpus"):
        run_point(LocalBackend(), RunConfig(), tmp_path, 10, print, cluster=spec_with(base={"cpus": 1}).points[0].cluster)
    LocalBackend().check_cluster(ClusterSettings())  # nothing asked: fine
    LocalBackend().check_cluster(None)


def test_report_table_shows_requested_applied_and_not_applied():
    containers = {
        "p_coordinator_1": {"role": "coordinator", "worker_index": None, "applied_rate_bps": 10**8,
                            "applied_profile": {"ingress": False}, "unsupported": ["delay 20 ms: this kernel has no netem"]},
        "p_worker_1": {"role": "worker", "worker_index": 1, "applied_rate_bps": 10**8,
                       "applied_profile": {"ingress": False}, "unsupported": ["delay 20 ms: this kernel has no netem"]},
    }
    stats = {"count": 1, "mean": 0.6, "stdev": 0.0, "median": 0.6, "min": 0.6, "max": 0.6}
    report = {"name": "links", "param_names": ["link"], "complete": True, "points": [
        {"index": 0, "params": {"link": "none"}, "cluster": {"link": None}, "status": "ok", "error": None,
         "repeats": [{"status": "ok", "links": {}}], "summary": {}, "unstable": []},
        {"index": 1, "params": {"link": "wan (partial)"}, "cluster": {"link": {"label": "wan"}}, "status": "ok",
         "error": None, "repeats": [{"status": "ok", "links": {"containers": containers}}],
         "summary": {"coordinator_egress_utilisation": stats, "batches_per_s": {**stats, "median": 42.0}},
         "unstable": []},
    ]}
    lines = format_table(report).splitlines()
    assert "rate applied" in lines[1] and "not applied" in lines[1] and "ps egress %" in lines[1]
    assert lines[3].split()[:5] == ["0", "none", "-", "-", "-"]
    assert "100Mbit" in lines[4] and "delay 20 ms" in lines[4] and " 60 " in lines[4] and "42" in lines[4]
    unshaped = {**report, "points": report["points"][:1]}
    assert "rate applied" not in format_table(unshaped)


def test_compose_passes_limits_with_no_limit_defaults():
    compose = yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())
    for service, prefix in (("coordinator", "COORDINATOR"), ("worker", "WORKER")):
        assert compose["services"][service]["cpus"] == f"${{WIIIIIDE_{prefix}_CPUS:-0}}"
        assert compose["services"][service]["mem_limit"] == f"${{WIIIIIDE_{prefix}_MEM_LIMIT:-0}}"
    assert compose["services"]["coordinator"]["environment"]["WIIIIIDE_START_GATE_FILE"] == "${WIIIIIDE_START_GATE_FILE:-}"


# -------------------------------------------------------------------------------- the start gate

def _gate_cfg(path: str, timeout_s: float = 30.0) -> RunConfig:
    return RunConfig(start_gate_file=path, connect_timeout_s=timeout_s, log_tier="silent")


def test_start_gate_waits_for_its_file(tmp_path):
    gate = tmp_path / "go"
    metrics = NodeMetrics("coordinator", "test")
    cfg = _gate_cfg(str(gate))
    opener = threading.Timer(0.2, gate.touch)
    opener.start()
    wait_for_start_gate(cfg, metrics, TieredLog(cfg, "coordinator"))
    assert gate.exists()
    assert [e["event"] for e in metrics.events] == ["start_gate_opened"]
    no_gate = RunConfig(log_tier="silent")
    wait_for_start_gate(no_gate, metrics, TieredLog(no_gate, "coordinator"))  # "" : returns at once
    assert len(metrics.events) == 1


def test_start_gate_gives_up_after_connect_timeout(tmp_path):
    cfg = _gate_cfg(str(tmp_path / "never"), timeout_s=0.1)
    with pytest.raises(NodeFailure, match="start gate file .*never did not appear within connect_timeout_s=0.1 s") as info:
        wait_for_start_gate(cfg, NodeMetrics("coordinator", "test"), TieredLog(cfg, "coordinator"))
    assert info.value.exit_code == 3
