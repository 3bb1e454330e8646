"""bench-handshake's pieces at a tiny size, on loopback: the attacker against a real acceptor, the
probe's admission, and the summary's pairing of attacked runs with their unattacked twins. No timing
is asserted (the benchmark measures; the tests only check that it measures the right thing)."""

from __future__ import annotations

import threading

from harness.bench.handshake import format_summary, probe_join, summarize
from harness.bench.handshake_attack import attack
from tests.unit.test_handshake import SECRET, acceptor  # noqa: F401 (the fixture)


def test_the_attacker_is_refused_and_the_probe_is_admitted_meanwhile(acceptor):  # noqa: F811
    node, port = acceptor, acceptor.cfg.port
    counts: dict[str, int] = {}
    attacker = threading.Thread(target=attack, args=("flood", port, 30, 1.5), kwargs={"counts": counts}, daemon=True)
    attacker.start()
    box: dict = {}
    probe = threading.Thread(target=lambda: box.update(zip(("sock", "reader", "joined"),
                                                           probe_join(port, SECRET, "probe", 20.0))), daemon=True)
    probe.start()
    node._admit(node._joining.get(timeout=30))
    probe.join(timeout=30)
    attacker.join(timeout=30)
    assert box["joined"]["attempts"] >= 1 and box["joined"]["admission_s"] > 0
    box["sock"].close()
    assert counts["opened"] >= 30 and counts["closed_by_peer"] >= 1
    refused = [e for e in node.metrics.events if e["event"] == "connection_refused"]
    assert refused and all(e["peer"].startswith("127.0.0.2:") for e in refused)
    joined = [e for e in node.metrics.events if e["event"] == "worker_joined"]
    assert [e["node_id"] for e in joined] == ["probe"]


def test_summary_compares_each_attacked_run_with_its_twin():
    def run(scenario, repeat, pair, rate, rss, admission=0.01):
        return {"scenario": scenario, "repeat": repeat, "pair": pair, "samples_per_s": rate,
                "peak_rss_bytes": rss, "admission_s": admission, "status": "ok", "refused": 5}

    runs = [run("none", 0, 0, 100.0, 100_000_000), run("slowloris", 0, 0, 80.0, 130_000_000),
            run("none", 0, 1, 50.0, 100_000_000), run("flood", 0, 1, 50.0, 100_000_000, admission=11.0)]
    summary = summarize(runs, handshake_timeout_s=5.0)
    assert summary["slowloris"]["samples_per_s_vs_twin"]["raw"] == [0.8]
    assert summary["slowloris"]["peak_rss_growth_mb"]["raw"] == [30.0]
    assert summary["slowloris"]["targets"] == {"admitted_within_2_timeouts": True,
                                               "samples_per_s_at_least_0.9x": False, "rss_growth_below_20_mb": False}
    assert summary["flood"]["targets"] == {"admitted_within_2_timeouts": False,
                                           "samples_per_s_at_least_0.9x": True, "rss_growth_below_20_mb": True}
    assert "slowloris" in format_summary(summary) and "0.800" in format_summary(summary)
