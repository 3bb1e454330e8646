"""netem's reorder, duplicate and Gilbert-Elliott loss: the profile keys and their errors (file and field
named, before anything starts), netem's arguments, the mechanism chosen without netem from a fake
kernel probe (the delay line, iptables TEE), the rules and the delay line's argv, links per pair
without netem matched on the peer's address, and the fidelity arithmetic against a simulated chain."""

from __future__ import annotations

import random

import pytest

from harness.errors import LinkShapingError, SpecError
from harness.links.fallback import DUP_CHAIN, FallbackCapabilities, choose_mechanisms, parse_rule_counters
from harness.links.fidelity import (
    arrival_stats,
    correlated_draw_model,
    early_count,
    gemodel_stationary,
    reorder_fraction,
)
from harness.links.pairs import pair_commands, pair_reset_commands, plan_pairs
from harness.links.plan import Capabilities, plan_shaping
from harness.links.tc import netem_args
from harness.run.tc_exec import ContainerExec, probe_with
from harness.spec.links import LinkProfile
from harness.spec.points import build_spec
from tests.unit.test_link import FakeContainer

FULL = Capabilities(netem=False, tbf=True, htb=True, ifb=True, statistic=True, nfqueue=True, tee=True,
                    errors={"netem": "Error: Specified qdisc kind is unknown."})
NO_TEE = Capabilities(netem=False, tbf=True, htb=True, ifb=True, statistic=True, nfqueue=True)
EVERYTHING = {"delay": "10ms", "reorder": "25%", "reorder_correlation": "10%", "gap": 5, "duplicate": "2%",
              "loss_gemodel": {"p": "1%", "r": "30%", "1-h": "90%", "1-k": "0.5%"}}


def test_netems_keys_become_netems_arguments_in_its_order():
    profile = LinkProfile.from_mapping(EVERYTHING)
    assert netem_args(profile)[2:] == ["delay", "10000us", "reorder", "25%", "10%", "gap", "5",
                                       "loss", "gemodel", "1%", "30%", "90%", "0.5%", "duplicate", "2%"]


def test_gemodel_takes_netems_defaults_for_what_is_left_out():
    assert LinkProfile.from_mapping({"loss_gemodel": ["2%"]}).loss_gemodel_pct == (2.0, 98.0, 100.0, 0.0)
    assert LinkProfile.from_mapping({"loss_gemodel": {"p": 1, "r": 40}}).loss_gemodel_pct == (1.0, 40.0, 100.0, 0.0)


@pytest.mark.parametrize("link, needle", [
    ({"reorder": "25%"}, "bad.yaml: base.link: link profile 'inline': reorder: 25 % needs a delay > 0"),
    ({"duplicate": "120%"}, "bad.yaml: base.link: link profile 'inline': duplicate: 120 %; allowed: 0..100 %"),
    ({"loss_gemodel": {"p": "1%", "r": "130%"}},
     "bad.yaml: base.link: link profile 'inline': loss_gemodel.r: 130 %; allowed: 0..100 % (a probability)"),
    ({"loss_gemodel": {"p": "1%", "1-h": -0.5}}, "base.link: link profile 'inline': loss_gemodel.1-h: -0.5 %"),
    ({"loss_gemodel": {"r": "1%"}}, "loss_gemodel.p: missing"),
    ({"loss_gemodel": {"p": "1%", "h": "1%"}}, "loss_gemodel.h: unknown key; allowed: p, r, 1-h, 1-k"),
    ({"loss": "1%", "loss_gemodel": ["1%"]}, "loss_gemodel: a profile has one loss model"),
    ({"delay": "5ms", "gap": 3}, "link profile 'inline': gap: 3 packets needs a reorder > 0"),
])
def test_a_bad_impairment_stops_the_spec_naming_file_and_field(link, needle):
    with pytest.raises(SpecError) as info:
        build_spec({"name": "bad", "base": {"num_workers": 1, "link": link}}, "bad.yaml")
    assert needle in str(info.value)


def test_the_mechanism_of_each_key_follows_the_probed_kernel():
    profile = LinkProfile.from_mapping({**EVERYTHING, "duplicate_correlation": "5%"})
    assert set(choose_mechanisms(profile, True, FallbackCapabilities(False, False)).values()) == {"netem"}
    assert choose_mechanisms(profile, False, FULL.fallback) == {
        "delay": "delay-line", "loss_gemodel": "delay-line", "reorder": "delay-line",
        "reorder_correlation": "delay-line", "duplicate": "delay-line", "duplicate_correlation": "delay-line"}
    # without a correlation the duplicate is the TEE rule's own draw
    plain = LinkProfile.from_mapping(EVERYTHING)
    assert choose_mechanisms(plain, False, FULL.fallback)["duplicate"] == "iptables-tee"
    assert choose_mechanisms(profile, False, NO_TEE.fallback)["duplicate"] == "unsupported"
    assert set(choose_mechanisms(profile, False, FallbackCapabilities(True, False, True)).values()) == {
        "unsupported", "iptables-tee"}


def test_probe_finds_the_tee_target_or_records_its_absence():
    assert probe_with(ContainerExec(FakeContainer())).tee is True
    caps = probe_with(ContainerExec(FakeContainer(fail_kinds=("TEE",))))
    assert caps.tee is False and caps.nfqueue is True and "tee" in caps.errors


def test_plan_without_netem_queues_to_the_delay_line_and_tees_after_it():
    plan = plan_shaping(LinkProfile.from_mapping(EVERYTHING), FULL)
    assert plan.unsupported == () and plan.mechanisms["duplicate"] == "iptables-tee"
    commands = [list(c) for c in plan.commands]
    line = next(c for c in commands if c[:2] == ["wiiide-delayline", "--queue"])
    flags = {line[i]: line[i + 1] for i in range(1, len(line) - 1, 2)}
    assert {k: flags[k] for k in ("--delay-us", "--reorder-pct", "--reorder-corr-pct", "--gap", "--ge-p-pct",
                                  "--ge-r-pct", "--ge-1h-pct", "--ge-1k-pct")} == {
        "--delay-us": "10000", "--reorder-pct": "25", "--reorder-corr-pct": "10", "--gap": "5", "--ge-p-pct": "1",
        "--ge-r-pct": "30", "--ge-1h-pct": "90", "--ge-1k-pct": "0.5"}
    tee = next(c for c in commands if "TEE" in c)
    assert tee[4:6] == ["-A", DUP_CHAIN] and tee[tee.index("--probability") + 1] == "0.02"
    assert tee[-2:] == ["--gateway", "127.0.0.1"]
    jumps = [c[4:] for c in commands if c[4:5] == ["-I"]]
    assert jumps == [["-I", "PREROUTING", "1", "-i", "eth0", "-j", "WIIIIIDE-LINK"],
                     ["-I", "INPUT", "1", "-i", "eth0", "-j", DUP_CHAIN]]
    # the delay line is bound before the jump that queues to it
    assert commands.index(line) < commands.index(["iptables", "-w", "-t", "mangle", *jumps[0]])


def test_a_correlated_duplicate_is_drawn_by_the_delay_line_and_cloned_by_a_marked_tee():
    profile = LinkProfile.from_mapping({"delay": "5ms", "duplicate": "30%", "duplicate_correlation": "50%"})
    plan = plan_shaping(profile, FULL)
    assert plan.unsupported == () and plan.mechanisms["duplicate_correlation"] == "delay-line"
    commands = [list(c) for c in plan.commands]
    line = next(c for c in commands if c[:2] == ["wiiide-delayline", "--queue"])
    flags = {line[i]: line[i + 1] for i in range(1, len(line) - 1, 2)}
    assert (flags["--duplicate-pct"], flags["--duplicate-corr-pct"]) == ("30", "50")
    tee = [c for c in commands if "TEE" in c]
    assert len(tee) == 1 and "statistic" not in tee[0]  # the delay line drew it: the rule only clones
    mark = tee[0][tee[0].index("--mark") + 1]
    assert mark == f"{int(flags['--dup-mark']):#x}/{int(flags['--dup-mark']):#x}"
    assert tee[0][4:6] == ["-A", DUP_CHAIN]


def test_a_duplicate_without_tee_fails_the_plan_or_is_left_out_with_allow_partial():
    profile = LinkProfile.from_mapping({"delay": "10ms", "duplicate": "2%"})
    with pytest.raises(LinkShapingError, match="duplicate 2 %"):
        plan_shaping(profile, NO_TEE)
    plan = plan_shaping(profile, NO_TEE, allow_partial=True)
    assert plan.applied.duplicate_pct == 0 and plan.applied.delay_ms == 10
    assert not any("TEE" in c for c in plan.commands) and plan.unsupported[0].startswith("duplicate 2 %")


def test_a_duplicate_alone_installs_only_its_chain():
    plan = plan_shaping(LinkProfile.from_mapping({"duplicate": "1%"}), FULL)
    assert [c[5] for c in plan.commands if c[4] == "-N"] == [DUP_CHAIN]


def test_duplicate_counters_read_back_from_a_listing():
    listing = """Chain WIIIIIDE-DUP (1 references)
    pkts      bytes target     prot opt in     out     source               destination
   20000   1840000            all  --  *      *       0.0.0.0/0            0.0.0.0/0            /* seen */
     203    18676 TEE        all  --  *      *       0.0.0.0/0            0.0.0.0/0            statistic mode random probability 0.01000000000 /* duplicate */ TEE gw:127.0.0.1
"""
    counters = parse_rule_counters(listing)
    assert counters["duplicated_packets"] == 203 and counters["duplicate_pct"] == pytest.approx(1.015)
    assert counters["dropped_packets"] == 0


IPS = {"coordinator": "172.18.0.2", "worker-1": "172.18.0.3", "worker-2": "172.18.0.4"}


def _topology(link):
    spec = build_spec({"name": "t", "base": {"num_workers": 2}, "axes": {"link": [link]}}, "experiments/t.yaml")
    return spec.points[0].cluster.link.topology


def test_a_pair_with_delay_and_loss_without_netem_goes_through_the_fallback_per_peer():
    topo = _topology({"pairs": [{"between": ["coordinator", "worker-1"], "rate": "100mbit", "delay": "20ms",
                                 "loss": "1%", "duplicate": "1%"}], "default": {"rate": "1gbit"}})
    plan = plan_pairs(topo, "coordinator", 2, FULL)
    slow = plan.classes[0]
    assert slow.peer == "worker-1" and not slow.netem and slow.applied.delay_ms == 20
    assert slow.mechanisms == {"delay": "delay-line", "loss": "iptables-statistic", "duplicate": "iptables-tee"}
    commands = pair_commands(plan, IPS)
    assert not any("netem" in c for c in commands)
    assert ["iptables", "-w", "-t", "mangle", "-I", "PREROUTING", "1", "-i", "eth0", "-s", "172.18.0.3/32",
            "-j", "WIIIIIDE-LINK-11"] in commands
    assert ["iptables", "-w", "-t", "mangle", "-A", "WIIIIIDE-LINK-11", "-j", "NFQUEUE", "--queue-num", "17",
            "--queue-bypass"] in commands
    line = next(c for c in commands if c[:2] == ["wiiide-delayline", "--queue"])
    assert line[2] == "17" and line[line.index("--delay-us") + 1] == "20000"
    assert ["wiiide-delayline", "--wait-ready", "--timeout-s", "5", "--queue", "17"] in commands
    assert any(c[4:6] == ["-I", "INPUT"] and "172.18.0.3/32" in c for c in commands)
    # the pair to worker-2 is a rate alone: no rule for it
    assert not any("172.18.0.4/32" in c and c[0] == "iptables" for c in commands)
    reset = pair_reset_commands(plan, IPS)
    assert ["wiiide-delayline", "--stop", "--queue", "17"] in reset
    assert ["iptables", "-w", "-t", "mangle", "-X", "WIIIIIDE-LINK-11"] in reset


def test_a_pair_key_without_any_mechanism_fails_or_is_recorded():
    topo = _topology({"pairs": [{"between": ["coordinator", "worker-1"], "delay": "20ms", "duplicate": "1%"}]})
    with pytest.raises(LinkShapingError, match="pair coordinator->worker-1: .*duplicate 1 %"):
        plan_pairs(topo, "coordinator", 2, NO_TEE)
    plan = plan_pairs(topo, "coordinator", 2, NO_TEE, allow_partial=True)
    assert plan.classes[0].applied.duplicate_pct == 0 and plan.classes[0].applied.delay_ms == 20
    assert "duplicate" not in plan.classes[0].mechanisms


# ------------------------------------------------------------------------------------------- fidelity

def _simulate_gemodel(p, r, one_minus_h, one_minus_k, packets, seed=7):
    """netem's loss_gilb_ell, step by step (an independent check of the closed forms)."""
    rng, bad, lost = random.Random(seed), False, []
    for _ in range(packets):
        if not bad:
            bad = rng.random() < p
            lost.append(rng.random() < one_minus_k)
        else:
            bad = not rng.random() < r
            lost.append(rng.random() < one_minus_h)
    runs, current = [], 0
    for x in lost:
        if x:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    return sum(lost) / packets, sum(runs) / len(runs)


def test_gemodel_stationary_values_match_a_simulated_chain():
    simple = gemodel_stationary(0.01, 0.30, 1.0, 0.0)
    assert simple["loss_rate"] == pytest.approx(0.01 / 0.31) and simple["mean_burst_packets"] == pytest.approx(1 / 0.3)
    general = gemodel_stationary(0.05, 0.4, 0.7, 0.02)
    loss, burst = _simulate_gemodel(0.05, 0.4, 0.7, 0.02, 400_000)
    assert general["loss_rate"] == pytest.approx(loss, rel=0.03)
    assert general["mean_burst_packets"] == pytest.approx(burst, rel=0.03)
    with pytest.raises(ValueError, match="1-h"):
        gemodel_stationary(0.1, 0.2, 1.5, 0)


def _netem_crandom_losses(loss_pct, corr_pct, packets, seed=3):
    """sch_netem.c's loss_event (CLG_RANDOM) over get_crandom, in its u32 arithmetic, step by step: the
    fraction of packets lost."""
    rng = random.Random(seed)
    loss = int(loss_pct / 100 * 4294967295 + 0.5)
    rho = int(corr_pct / 100 * 4294967295 + 0.5) + 1
    last, lost = rng.getrandbits(32), 0
    for _ in range(packets):
        last = (rng.getrandbits(32) * ((1 << 32) - rho) + last * rho) >> 32
        lost += loss >= last
    return lost / packets


def test_correlated_draw_model_against_netems_own_arithmetic():
    # no correlation: each packet on its own, the rate asked
    assert correlated_draw_model(0.05, 0.0)["loss_rate"] == pytest.approx(0.05, rel=0.03)
    # the filter's law is symmetric about 1/2: losing below p is keeping above 1 - p
    assert (correlated_draw_model(0.3, 0.5)["loss_rate"] + correlated_draw_model(0.7, 0.5, seed=1)["loss_rate"]
            == pytest.approx(1.0, abs=0.003))
    # full correlation: the draw never leaves 1/2
    assert correlated_draw_model(0.4, 1.0)["loss_rate"] == 0.0 and correlated_draw_model(0.6, 1.0)["loss_rate"] == 1.0
    # netem's u32 draw, step by step, loses what the model says: less than asked, in longer runs
    model = correlated_draw_model(0.3, 0.5)
    assert model["loss_rate"] == pytest.approx(_netem_crandom_losses(30, 50, 200_000), rel=0.03)
    assert model["loss_rate"] < 0.2 and model["mean_burst_packets"] > correlated_draw_model(0.3, 0.0)["mean_burst_packets"]
    with pytest.raises(ValueError, match="correlation"):
        correlated_draw_model(0.1, 1.5)


def test_reorder_fraction_with_a_gap():
    assert reorder_fraction(0.25) == 0.25
    assert reorder_fraction(0.25, gap=5) == pytest.approx(0.125)  # one per 4 + 4 packets on average
    with pytest.raises(ValueError):
        reorder_fraction(0.5, gap=0)


def test_arrival_stats_count_copies_losses_runs_and_overtakers():
    # 0..9 sent; 3 and 4 lost (one run), 8 lost; 6 overtook 5; 2 arrived twice
    arrivals = [0, 1, 2, 2, 6, 5, 7, 9]
    stats = arrival_stats(arrivals, 10)
    assert (stats["received_datagrams"], stats["duplicates"], stats["lost_datagrams"]) == (7, 1, 3)
    assert (stats["loss_bursts"], stats["mean_burst_packets"], stats["early_datagrams"]) == (2, 1.5, 1)
    assert early_count([3, 0, 1, 2]) == 1 and early_count([0, 1, 2]) == 0
    with pytest.raises(ValueError):
        arrival_stats([10], 10)


def test_each_pair_with_a_delay_gets_its_own_round_trip_probe(monkeypatch):
    from harness.links import rtt
    from harness.run.pair_shaping import probe_pair_rtts
    topo = _topology({"pairs": [{"between": ["coordinator", "worker-1"], "delay": "10ms"},
                                {"between": ["coordinator", "worker-2"], "rate": "1gbit"},
                                {"between": ["worker-1", "worker-2"], "delay": "1ms"}]})
    plans = [plan_pairs(topo, node, 2, FULL) for node in ("coordinator", "worker-1", "worker-2")]
    pairs = {f"{p.node}->{c.peer}": {} for p in plans for c in p.classes}
    asked = []
    def measure(server, client, host, count):
        asked.append((server, client, host))
        if server != "C":
            raise RuntimeError("refused")
        return [30.0] * rtt.WARMUP_SAMPLES + [20.5, 20.7, 21.0]

    monkeypatch.setattr(rtt, "measure_rtt", measure)
    probe_pair_rtts({"coordinator": "C", "worker-1": "W1", "worker-2": "W2"}, plans, IPS, pairs, lambda _: None)
    assert asked[0] == ("C", "W1", "172.18.0.2")  # from worker-1 to the coordinator's address
    probe = pairs["coordinator->worker-1"]["rtt_probe"]
    assert probe is pairs["worker-1->coordinator"]["rtt_probe"]
    assert probe["asked_rtt_ms"] == 20 and probe["median_rtt_ms"] == 20.7
    assert "rtt_probe" not in pairs["coordinator->worker-2"]  # a rate alone: nothing to probe
    assert pairs["worker-1->worker-2"]["rtt_probe"]["error"] == "refused"


def test_the_unshaped_round_trip_drops_the_warm_up_and_says_its_median_and_tail(monkeypatch):
    from harness.links import rtt
    counts, lines = [], []

    def measure(server, client, host, count):
        counts.append(count)
        return [50.0] * rtt.WARMUP_SAMPLES + [0.2] * 98 + [0.3, 4.0]

    monkeypatch.setattr(rtt, "measure_rtt", measure)
    summary = rtt.measure_unshaped("C", "W", "coordinator", 100, lines.append)
    assert counts == [100 + rtt.WARMUP_SAMPLES]
    assert (summary["samples"], summary["median_rtt_ms"], summary["p99_rtt_ms"]) == (100, 0.2, 0.3)
    assert lines == ["[bench-link] unshaped round trip: median 0.200 ms, p99 0.300 ms"]


def test_netems_new_keys_are_read_back_from_its_json():
    from harness.links.readback import parse_tc_json
    # spelled as iproute2's q_netem.c netem_print_opt prints them (fractions of 1); no kernel here has netem
    text = ('[{"kind": "netem", "handle": "10:", "root": true, "options": {"limit": 1000, '
            '"delay": {"delay": 0.01, "jitter": 0, "correlation": 0}, "reorder": {"reorder": 0.25, "correlation": 0.1}, '
            '"loss-gemodel": {"p": 0.01, "r": 0.3, "1-h": 1, "1-k": 0}, "duplicate": {"duplicate": 0.02, '
            '"correlation": 0}, "gap": 5, "ecn": false}}]')
    record = parse_tc_json(text, "qdisc", "eth0")[0]
    assert (record["reorder_pct"], record["reorder_corr_pct"], record["reorder_gap"]) == (25, 10, 5)
    assert record["loss_gemodel_pct"] == [1, 30, 100, 0] and record["duplicate_pct"] == 2
    assert "duplicate_corr_pct" not in record
