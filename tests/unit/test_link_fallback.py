"""harness.links.fallback: the mechanism chosen for each impairment key from a probed kernel, the
fallback's iptables rules and their read-back (a listing this kernel printed), the delay line's argv,
and bad impairment values refused in a spec before anything starts, naming the file and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.errors import SpecError
from harness.links.fallback import (
    CHAIN,
    DELAY_LINE,
    DUP_CHAIN,
    FallbackCapabilities,
    choose_mechanisms,
    delay_line_argv,
    parse_rule_counters,
    rule_commands,
    rule_counters_command,
    rule_reset_commands,
)
from harness.links.delayline import parse_stats, runs_in_background
from harness.links.tc import netem_args, netem_limit_packets
from harness.spec.links import LinkProfile
from harness.spec.points import build_spec

FIXTURES = Path(__file__).parent / "tc_fixtures"
BOTH = FallbackCapabilities(statistic=True, nfqueue=True)
WAN = LinkProfile(rate_bps=100_000_000, delay_ms=20, jitter_ms=2, jitter_distribution="normal", loss_pct=1,
                  loss_corr_pct=25)


def test_netem_applies_every_key_where_the_kernel_has_it():
    assert choose_mechanisms(WAN, netem=True, fallback=BOTH) == {
        "delay": "netem", "jitter": "netem", "loss": "netem", "loss_correlation": "netem"}


@pytest.mark.parametrize("fallback, expected", [
    # a correlated loss is netem's correlated draw, which only the delay line makes
    (BOTH, {"delay": "delay-line", "jitter": "delay-line", "loss": "delay-line", "loss_correlation": "delay-line"}),
    (FallbackCapabilities(statistic=True, nfqueue=False),
     {"delay": "unsupported", "jitter": "unsupported", "loss": "iptables-statistic", "loss_correlation": "unsupported"}),
    (FallbackCapabilities(statistic=False, nfqueue=False),
     {"delay": "unsupported", "jitter": "unsupported", "loss": "unsupported", "loss_correlation": "unsupported"}),
])
def test_without_netem_each_key_takes_what_the_kernel_has(fallback, expected):
    assert choose_mechanisms(WAN, netem=False, fallback=fallback) == expected


def test_a_rate_alone_needs_no_impairment_mechanism():
    assert choose_mechanisms(LinkProfile(rate_bps=10**9), netem=False, fallback=BOTH) == {}
    assert rule_commands(LinkProfile(rate_bps=10**9), {}) == []


def test_rules_count_then_drop_then_queue_on_arrival():
    profile = LinkProfile(delay_ms=10, loss_pct=5)
    commands = rule_commands(profile, choose_mechanisms(profile, False, BOTH), dev="eth0", queue_num=3)
    assert all(c[:4] == ["iptables", "-w", "-t", "mangle"] for c in commands if c[0] != DELAY_LINE)
    assert commands[0][4:] == ["-N", CHAIN]
    assert commands[1][4:] == ["-A", CHAIN, "-m", "comment", "--comment", "seen"]
    assert commands[2][4:] == ["-A", CHAIN, "-m", "statistic", "--mode", "random", "--probability", "0.05",
                               "-m", "comment", "--comment", "loss", "-j", "DROP"]
    assert commands[3][4:] == ["-A", CHAIN, "-j", "NFQUEUE", "--queue-num", "3", "--queue-bypass"]
    # the delay line starts (detached) on queue 3 and is bound before the jump puts the chain in the path
    assert commands[4][:3] == [DELAY_LINE, "--queue", "3"] and runs_in_background(commands[4])
    assert commands[5][:2] == [DELAY_LINE, "--wait-ready"] and not runs_in_background(commands[5])
    assert commands[-1][4:] == ["-I", "PREROUTING", "1", "-i", "eth0", "-j", CHAIN]  # the jump last: all or nothing
    assert not any("OUTPUT" in c for c in commands)  # a DROP on OUTPUT fails the sender's send, not the network


def test_a_correlated_loss_is_drawn_by_the_delay_line_and_not_by_a_rule():
    profile = LinkProfile(loss_pct=2, loss_corr_pct=50)  # no delay: the delay line still runs, for the loss
    mechanisms = choose_mechanisms(profile, False, BOTH)
    assert mechanisms == {"loss": "delay-line", "loss_correlation": "delay-line"}
    commands = rule_commands(profile, mechanisms)
    assert not any(c[-1] == "DROP" for c in commands)  # statistic draws each packet alone: not used
    line = next(c for c in commands if c[:2] == [DELAY_LINE, "--queue"])
    assert line[line.index("--loss-pct") + 1] == "2" and line[line.index("--loss-corr-pct") + 1] == "50"
    assert line[line.index("--delay-us") + 1] == "0"
    # uncorrelated, the loss stays an in-kernel rule and the delay line draws none
    plain = LinkProfile(delay_ms=5, loss_pct=2)
    assert "--loss-pct" not in delay_line_argv(plain)
    assert choose_mechanisms(plain, False, BOTH)["loss"] == "iptables-statistic"


def test_small_loss_probabilities_keep_their_digits_and_ingress_drops_twice():
    profile = LinkProfile(loss_pct=0.1, ingress=True)
    commands = rule_commands(profile, choose_mechanisms(profile, False, BOTH))
    drops = [c for c in commands if c[-1] == "DROP"]
    assert len(drops) == 2 and all(c[c.index("--probability") + 1] == "0.001" for c in drops)
    assert not any("NFQUEUE" in c for c in commands)  # no delay asked: no queue, no delay line


def test_loss_without_statistic_installs_no_rule():
    profile = LinkProfile(loss_pct=1)
    assert rule_commands(profile, choose_mechanisms(profile, False, FallbackCapabilities(False, True))) == []


def test_reset_removes_the_jump_then_stops_the_delay_line_then_the_chain():
    commands = rule_reset_commands("eth0")
    assert commands[0][4:] == ["-D", "PREROUTING", "-i", "eth0", "-j", CHAIN]
    assert commands[1][4:] == ["-D", "INPUT", "-i", "eth0", "-j", DUP_CHAIN]
    assert commands[2] == [DELAY_LINE, "--stop"]  # nothing queued any more: what it holds goes out, then it exits
    assert [c[4:] for c in commands[3:]] == [["-F", CHAIN], ["-X", CHAIN], ["-F", DUP_CHAIN], ["-X", DUP_CHAIN]]
    assert rule_counters_command()[4:] == ["-L", CHAIN, "-v", "-x", "-n"]


def test_counters_read_back_from_a_real_listing():
    counters = parse_rule_counters((FIXTURES / "iptables_fallback_chain.txt").read_text())
    assert counters == {"seen_packets": 388, "dropped_packets": 20, "loss_pct": pytest.approx(20 / 388 * 100)}
    assert parse_rule_counters("Chain WIIIIIDE-LINK (1 references)\n")["loss_pct"] is None


def test_delay_line_argv_in_microseconds_with_netems_distribution():
    assert delay_line_argv(WAN, queue_num=0, limit_packets=2500) == [
        DELAY_LINE, "--queue", "0", "--delay-us", "20000", "--jitter-us", "2000", "--distribution", "normal",
        "--draws", "1", "--max-len", "2500", "--loss-pct", "1", "--loss-corr-pct", "25"]
    argv = delay_line_argv(LinkProfile(delay_ms=0.25, ingress=True))
    assert argv[argv.index("--delay-us") + 1] == "250" and argv[argv.index("--distribution") + 1] == "uniform"
    assert argv[argv.index("--draws") + 1] == "2"
    # by default the delay line holds as many packets as netem's limit for the profile (1.5 x BDP, >= 1000)
    fat = LinkProfile(rate_bps=10**9, delay_ms=25)
    limit = delay_line_argv(fat)[-1]
    assert limit == str(netem_limit_packets(fat)) and int(limit) > 3000


def test_netem_builder_keeps_the_same_keys():
    assert netem_args(WAN)[2:] == ["delay", "20000us", "2000us", "distribution", "normal", "loss", "1%", "25%"]


@pytest.mark.parametrize("link, needle", [
    ({"delay": 20}, "bad.yaml: base.link: link profile 'inline': delay: 20 needs a unit"),
    ({"loss": "120%"}, "bad.yaml: base.link: link profile 'inline': loss: 120 %; allowed: 0..100 %"),
    ({"delay": "5ms", "jitter": "9ms"}, "bad.yaml: base.link: link profile 'inline': jitter: 9 ms"),
])
def test_a_bad_impairment_stops_the_spec_naming_file_and_field(link, needle):
    with pytest.raises(SpecError) as info:
        build_spec({"name": "bad", "base": {"num_workers": 1, "link": link}}, "bad.yaml")
    assert needle in str(info.value)


# ------------------------------------------------------------------------------- the plan without netem

def _caps(statistic: bool, nfqueue: bool = False):
    from harness.links.plan import Capabilities
    return Capabilities(netem=False, tbf=True, htb=True, ifb=True, statistic=statistic, nfqueue=nfqueue,
                        errors={"netem": "Error: Specified qdisc kind is unknown."})


def test_plan_applies_loss_through_the_fallback_and_records_the_mechanism():
    from harness.links.plan import plan_shaping
    plan = plan_shaping(LinkProfile(rate_bps=100_000_000, loss_pct=1), _caps(statistic=True))
    assert plan.mechanisms == {"loss": "iptables-statistic"} and plan.unsupported == ()
    assert plan.applied.loss_pct == 1.0 and plan.to_dict()["mechanisms"] == {"loss": "iptables-statistic"}
    assert not any("netem" in c for c in plan.commands)  # tc gets the rate alone
    assert plan.commands[0][:3] == ("tc", "qdisc", "replace") and plan.commands[-1][:4] == ("iptables", "-w", "-t", "mangle")
    assert plan.devices == ("eth0",)


def test_plan_without_a_delay_line_fails_naming_only_the_delay_or_records_it():
    from harness.errors import LinkShapingError
    from harness.links.plan import plan_shaping
    profile = LinkProfile(delay_ms=20, loss_pct=1)
    with pytest.raises(LinkShapingError, match=r"asks for delay 20 ms but this kernel has no netem"):
        plan_shaping(profile, _caps(statistic=True))
    plan = plan_shaping(profile, _caps(statistic=True), allow_partial=True)
    assert plan.unsupported[0].startswith("delay 20 ms: this kernel has no netem")
    assert plan.mechanisms == {"loss": "iptables-statistic"}
    assert (plan.applied.delay_ms, plan.applied.loss_pct) == (0.0, 1.0)
    assert [c[4:6] for c in plan.commands] == [("-N", CHAIN), ("-A", CHAIN), ("-A", CHAIN), ("-I", "PREROUTING")]


def test_plan_without_statistic_keeps_todays_partial_shaping():
    from harness.links.plan import plan_shaping
    plan = plan_shaping(LinkProfile(rate_bps=10**8, loss_pct=1, loss_corr_pct=25), _caps(statistic=False),
                        allow_partial=True)
    assert plan.unsupported == ("loss 1 %: this kernel has no netem (tc: Error: Specified qdisc kind is unknown.)",)
    assert plan.mechanisms == {} and plan.applied.loss_pct == 0.0
    assert all(c[0] != "iptables" for c in plan.commands)


class _Runner:
    """Answers the fallback's listing with a listing this kernel printed; records every command."""

    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail

    def run(self, argv):
        from harness.run.tc_exec import TcCommandError
        self.calls.append(list(argv))
        if self.fail:
            raise TcCommandError("iptables failed: No chain/target/match by that name.", list(argv), 1, "iptables: No chain/target/match by that name.")
        return (FIXTURES / "iptables_fallback_chain.txt").read_text()


def test_the_mechanisms_own_loss_count_is_read_and_reset_removes_the_rules():
    from harness.errors import LinkShapingError
    from harness.run.tc_exec import read_fallback_counters, reset_links
    runner = _Runner()
    assert read_fallback_counters(runner)["dropped_packets"] == 20
    assert runner.calls == [rule_counters_command()]
    with pytest.raises(LinkShapingError, match="No chain"):
        read_fallback_counters(_Runner(fail=True))
    gone = _Runner(fail=True)
    reset_links(gone)  # nothing to remove is fine
    assert all(c in gone.calls for c in rule_reset_commands())


# ------------------------------------------------------------------------------- the delay line

STATS = ('{"pid": 41, "running": true, "realtime": false, "nice": 0, "slice_us": 100, "queue": 0, "delay_us": 5000, "jitter_us": 0, '
         '"distribution": "uniform", "draws": 1, "max_len_packets": 1000, "queued_packets": 509, '
         '"accepted_packets": 509, "held_packets": 0, "max_held_packets": 2, "dropped_full_packets": 0, '
         '"kernel_queue_dropped_packets": 0, "kernel_user_dropped_packets": 0, "late_mean_us": 461.8, '
         '"late_max_us": 30415.1, "late_p99_us": 2010.0, "stamped_packets": 509, '
         '"read_wait_mean_us": 41.5, "read_wait_max_us": 388.0, "early_max_us": 96.0, "wake_lead_us": 131.5, '
         '"cpu_user_s": 0.003011, "cpu_system_s": 0.062916, "reorder_pct": 25.000000, '
         '"reorder_corr_pct": 0.000000, "gap": 1, "reordered_packets": 131, "gemodel": true, "ge_p_pct": 1.000000, '
         '"ge_r_pct": 30.000000, "ge_1h_pct": 100.000000, "ge_1k_pct": 0.000000, "loss_pct": 0.000000, "loss_corr_pct": 0.000000, '
         '"duplicate_pct": 0.000000, "duplicate_corr_pct": 0.000000, "duplicated_packets": 0, '
         '"loss_dropped_packets": 17, '
         '"loss_bursts": 12, "ge_bad_entries": 12}\n')


def test_the_delay_lines_stats_are_read_and_a_bad_file_refused():
    stats = parse_stats(STATS)  # as the binary wrote it (docker/delayline/wiiide-delayline.c, write_stats)
    assert stats["accepted_packets"] == 509 and stats["cpu_s"] == pytest.approx(0.065927)
    for bad in ("", "[1]", STATS.replace('"queued_packets": 509', '"queued_packets": "509"'),
                STATS.replace('"running": true', '"running": 1'), STATS.replace('"pid": 41, ', "")):
        with pytest.raises(ValueError, match="delay line's stats"):
            parse_stats(bad)


def test_plan_with_a_delay_line_starts_it_detached_and_keeps_the_delay():
    from harness.links.plan import plan_shaping
    from harness.run.tc_exec import ContainerExec, apply_plan
    profile = LinkProfile(rate_bps=10**9, delay_ms=12.5, jitter_ms=1, jitter_distribution="pareto")
    plan = plan_shaping(profile, _caps(statistic=True, nfqueue=True))
    assert plan.mechanisms == {"delay": "delay-line", "jitter": "delay-line"} and plan.unsupported == ()
    assert (plan.applied.delay_ms, plan.applied.jitter_distribution) == (12.5, "pareto")
    assert not any("netem" in c for c in plan.commands)

    class Container:
        name = "c"

        def __init__(self):
            self.calls = []

        def exec_run(self, argv, demux=False, detach=False):
            self.calls.append((list(argv), detach))
            return (None, None) if detach else (0, (b"[]" if argv[0] == "tc" else b"", None))

    container = Container()
    apply_plan(ContainerExec(container), plan)
    detached = [argv for argv, detach in container.calls if detach]
    assert detached == [delay_line_argv(profile)]  # only the delay line's own run goes on in the background
    order = [argv[0] if argv[0] != "iptables" else argv[5] for argv, _ in container.calls]
    assert order.index(DELAY_LINE) < order.index("PREROUTING")  # bound before the chain is in the path


def test_round_trips_summarised_beside_what_was_asked():
    from harness.links.rtt import WARMUP_SAMPLES, asked_rtt_ms, parse_ping_output, probe_count, summarize
    assert asked_rtt_ms(LinkProfile(delay_ms=5), LinkProfile(delay_ms=20, ingress=True)) == 45
    assert asked_rtt_ms(LinkProfile(delay_ms=5), None) == 5
    samples = [50.0] * WARMUP_SAMPLES + [10.0 + i / 100 for i in range(100)]  # 10.00 .. 10.99 ms
    out = summarize(samples, asked_ms=10)
    assert (out["samples"], out["min_rtt_ms"], out["max_rtt_ms"]) == (100, 10.0, 10.99)  # warm-up left out
    assert out["median_rtt_ms"] == pytest.approx(10.495) and out["p99_rtt_ms"] == pytest.approx(10.98)
    assert 20 < probe_count(100) < probe_count(2) <= 200 + WARMUP_SAMPLES
    assert parse_ping_output('{"rtt_ms": [1.5, 2]}\n') == [1.5, 2.0]
    for bad in ("", "Traceback", '{"rtt_ms": ["1"]}', '{"rtt": []}'):
        with pytest.raises(ValueError, match="round-trip probe"):
            parse_ping_output(bad)
    with pytest.raises(ValueError):
        summarize([1.0] * WARMUP_SAMPLES)


def test_a_run_records_the_measured_round_trip_beside_the_one_asked():
    from harness.links.plan import plan_shaping
    from harness.links.rtt import PING
    from harness.run.shaping import ClusterConditions

    class Container:
        def __init__(self, name, service, number, answer):
            self.name, self.answer = name, answer
            self.labels = {"com.docker.compose.service": service, "com.docker.compose.container-number": number}
            self.attrs = {"Config": {"Hostname": service}}

        def exec_run(self, argv, demux=False):
            return self.answer if argv[2] == PING else (0, (b"", None))  # the echo just ends

    pings = json.dumps({"rtt_ms": [9.0] * 3 + [5.1, 5.2, 5.3]}).encode()
    caps = _caps(statistic=True, nfqueue=True)
    conditions = ClusterConditions(None, probe=lambda: caps)
    conditions.plans = {("coordinator", None): plan_shaping(LinkProfile(delay_ms=2), caps),
                        ("worker", 1): plan_shaping(LinkProfile(delay_ms=3), caps)}
    lines = []
    coordinator = Container("c", "coordinator", "1", None)
    conditions._probe_rtt([coordinator, Container("w1", "worker", "1", (0, (pings, None)))], lines.append)
    probe = conditions.links["rtt_probe"]
    assert (probe["asked_rtt_ms"], probe["median_rtt_ms"], probe["samples"], probe["between"]) == (5, 5.2, 3, ["w1", "c"])
    assert "median 5.200 ms" in lines[0]
    conditions._probe_rtt([coordinator, Container("w1", "worker", "1", (1, (b"", b"refused")))], lines.append)
    assert "refused" in conditions.links["rtt_probe"]["error"] and "NOT MEASURED" in lines[-1]
