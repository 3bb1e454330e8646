"""harness.link: units, the profile's validation, the tc argv builders (every parameter combination),
plans for kernels with and without netem, the ``tc -s qdisc/class show`` parser on real output, the
runner's errors, the probe and the report's link figures."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from harness.errors import LinkShapingError, SpecError
from harness.links.plan import ALL_CAPABILITIES, Capabilities, describe, plan_shaping
from harness.links.readback import (
    parse_class_text,
    parse_classes,
    parse_tc_json,
    rate_in_force_bps,
)
from harness.links.tc import (
    IFB_DEV,
    burst_bytes,
    htb_quantum_bytes,
    netem_args,
    netem_limit_packets,
    profile_commands,
    tbf_limit_bytes,
)
from harness.present.links_text import applied_rates_text, unsupported_text
from harness.present.table import link_cells
from harness.results.models import Point
from harness.results.totals import repeat_totals
from harness.run.tc_exec import ContainerExec, probe_with, read_back
from harness.spec.links import LinkProfile
from wiiide.units import (
    UnitError,
    format_rate,
    parse_pct,
    parse_rate_bps,
    parse_time_ms,
)

FIXTURES = Path(__file__).parent / "tc_fixtures"
NO_NETEM = Capabilities(netem=False, tbf=True, htb=True, ifb=True,
                        errors={"netem": "Error: Specified qdisc kind is unknown."})


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# ------------------------------------------------------------------------------------------ units

@pytest.mark.parametrize("text, bps", [
    ("100mbit", 100_000_000), ("100Mbit", 100_000_000), ("1gbit", 10**9), ("1Gbit/s", 10**9),
    ("500kbit", 500_000), ("2.5gbit", 2_500_000_000), ("8000bit", 8000), ("10 mbit", 10_000_000),
])
def test_rates_parse_in_si_bits(text, bps):
    assert parse_rate_bps(text) == bps


@pytest.mark.parametrize("value, needle", [
    (100, "needs a unit"), (1.5, "needs a unit"), ("100", "not a rate"), ("100mb", "not a rate"),
    ("10mbps", "ambiguous"), ("fast", "not a rate"), (True, "needs a unit"),
])
def test_bad_rates_say_why(value, needle):
    with pytest.raises(UnitError, match=needle):
        parse_rate_bps(value)


def test_times_and_percentages():
    assert parse_time_ms("20ms", "delay") == 20.0
    assert parse_time_ms("500us", "delay") == 0.5
    assert parse_time_ms("1.5s", "delay") == 1500.0
    for bad in (20, "20", "20min", None):
        with pytest.raises(UnitError, match="delay"):
            parse_time_ms(bad, "delay")
    assert parse_pct("1%", "loss") == 1.0 and parse_pct(0.5, "loss") == 0.5 and parse_pct("25", "loss") == 25.0
    for bad in ("a%", True, "-1%"):
        with pytest.raises(UnitError, match="loss"):
            parse_pct(bad, "loss")


def test_format_rate_as_tc_prints_it():
    assert [format_rate(r) for r in (10**10, 10**9, 100_000_000, 1_500_000, 500_000, 800, None)] == \
        ["10Gbit", "1Gbit", "100Mbit", "1.5Mbit", "500Kbit", "800bit", "-"]


# ----------------------------------------------------------------------------------- validation

@pytest.mark.parametrize("data, field", [
    ({"rate": "100mbit", "delay": "10ms", "jitter": "20ms"}, "jitter"),
    ({"rate": "100mbit", "jitter": "1ms"}, "jitter"),
    ({"rate": "100mbit", "loss": 101}, "loss"),
    ({"rate": "100mbit", "loss": "-1"}, "loss"),
    ({"rate": "100mbit", "loss": 1, "loss_correlation": 150}, "loss_correlation"),
    ({"rate": "100mbit", "loss_correlation": 25}, "loss_correlation"),
    ({"rate": "0mbit"}, "rate"),
    ({"rate": "200gbit"}, "rate"),
    ({"rate": "100mbit", "delay": "20ms", "jitter": "2ms", "distribution": "gaussian"}, "distribution"),
    ({"rate": "100mbit", "distribution": "normal"}, "distribution"),
    ({"rate": "100mbit", "limit_packets": 0}, "limit_packets"),
    ({"rate": "100mbit", "limit_packets": 1.5}, "limit_packets"),
    ({"rate": "100mbit", "ingress": "yes"}, "ingress"),
    ({"rate": "100mbit", "qdisc": "cake"}, "qdisc"),
    ({"delay": "90s"}, "delay"),
    ({"ingress": True}, "does nothing"),
    ({}, "does nothing"),
    ({"rate": "100mbit", "bandwidth": "1gbit"}, "bandwidth"),
])
def test_validation_names_the_field(data, field):
    with pytest.raises(SpecError) as info:
        LinkProfile.from_mapping(data, "p")
    assert field in str(info.value) and "'p'" in str(info.value)


def test_a_valid_profile_reads_every_key():
    p = LinkProfile.from_mapping({"rate": "50mbit", "delay": "5ms", "jitter": "3ms", "distribution": "paretonormal",
                                  "loss": "1%", "loss_correlation": "25%", "limit_packets": 300, "ingress": True,
                                  "qdisc": "tbf"}, "wifi")
    assert (p.name, p.rate_bps, p.delay_ms, p.jitter_ms, p.jitter_distribution) == ("wifi", 50_000_000, 5.0, 3.0,
                                                                                    "paretonormal")
    assert (p.loss_pct, p.loss_corr_pct, p.limit_packets, p.ingress, p.root_qdisc) == (1.0, 25.0, 300, True, "tbf")
    assert p.needs_netem and p.to_dict()["rate_bps"] == 50_000_000
    assert describe(p) == ("50Mbit (tbf) 5ms delay 3ms paretonormal jitter 1% loss (25% correlated) limit 300p, "
                           "both directions (ingress via ifb)")
    assert describe(None) == "not shaped"


# ---------------------------------------------------------------------------------------- sizes

def test_sizes_from_rate_and_bandwidth_delay_product():
    assert burst_bytes(10_000_000) == 16 * 1024  # 5,000 B of one tick is below the floor
    assert burst_bytes(100_000_000) == 50_000  # 12.5 MB/s / 250 Hz
    assert burst_bytes(1_000_000_000) == 500_000
    assert netem_limit_packets(LinkProfile(rate_bps=100_000_000, delay_ms=20, jitter_ms=2)) == 1000  # 275 < 1000
    assert netem_limit_packets(LinkProfile(rate_bps=10**9, delay_ms=80)) == 10_000  # 1.5 x 6,667
    assert netem_limit_packets(LinkProfile(delay_ms=20)) == 25_000  # no rate: the nominal 10 Gbit/s
    assert netem_limit_packets(LinkProfile(delay_ms=20, limit_packets=77)) == 77
    assert tbf_limit_bytes(LinkProfile(rate_bps=100_000_000, root_qdisc="tbf")) == 1_250_000 + 50_000
    assert tbf_limit_bytes(LinkProfile(rate_bps=100_000_000, root_qdisc="tbf", limit_packets=100)) == 151_400
    assert htb_quantum_bytes(100_000_000) == 200_000 and htb_quantum_bytes(100_000) == 1514
    assert htb_quantum_bytes(10_000_000) == 125_000
    with pytest.raises(LinkShapingError, match="tbf needs a rate"):
        tbf_limit_bytes(LinkProfile(name="lan", delay_ms=5, root_qdisc="tbf"))


# -------------------------------------------------------------------------------------- builders

def test_golden_commands():
    assert profile_commands(LinkProfile(rate_bps=100_000_000)) == [
        ["tc", "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1"],
        ["tc", "class", "replace", "dev", "eth0", "parent", "1:", "classid", "1:1", "htb", "rate", "100000000bit",
         "ceil", "100000000bit", "burst", "50000b", "cburst", "50000b", "quantum", "200000"],
    ]
    assert profile_commands(LinkProfile(rate_bps=10_000_000, delay_ms=80, jitter_ms=8, jitter_distribution="normal",
                                        loss_pct=0.5, loss_corr_pct=25, root_qdisc="tbf")) == [
        ["tc", "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "tbf", "rate", "10000000bit",
         "burst", "16384b", "limit", "141384b"],
        ["tc", "qdisc", "replace", "dev", "eth0", "parent", "1:1", "handle", "10:", "netem", "limit", "1000",
         "delay", "80000us", "8000us", "distribution", "normal", "loss", "0.5%", "25%"],
    ]
    assert profile_commands(LinkProfile(delay_ms=0.25), dev="eth1") == [
        ["tc", "qdisc", "replace", "dev", "eth1", "root", "handle", "10:", "netem", "limit", "1000", "delay", "250us"]]
    ingress = profile_commands(LinkProfile(rate_bps=50_000_000, ingress=True))
    assert ingress[2:6] == [
        ["ip", "link", "add", "ifb0", "type", "ifb"],
        ["ip", "link", "set", "dev", "ifb0", "txqueuelen", "1000", "up"],
        ["tc", "qdisc", "replace", "dev", "eth0", "handle", "ffff:", "ingress"],
        ["tc", "filter", "add", "dev", "eth0", "parent", "ffff:", "protocol", "all", "u32", "match", "u32", "0", "0",
         "action", "mirred", "egress", "redirect", "dev", "ifb0"],
    ]
    assert [c[:6] for c in ingress[6:]] == [["tc", "qdisc", "replace", "dev", "ifb0", "root"],
                                            ["tc", "class", "replace", "dev", "ifb0", "parent"]]


_RATES = [None, 100_000_000]
_DELAYS = [(0.0, 0.0, None), (20.0, 0.0, None), (20.0, 2.0, None), *((20.0, 2.0, d) for d in
                                                                      ("uniform", "normal", "pareto", "paretonormal"))]
_LOSSES = [(0.0, 0.0), (1.0, 0.0), (1.0, 25.0)]
COMBOS = list(itertools.product(_RATES, _DELAYS, _LOSSES, [None, 500], [False, True], ["htb", "tbf"]))


@pytest.mark.parametrize("rate, delay, loss, limit, ingress, root", COMBOS)
def test_every_parameter_combination(rate, delay, loss, limit, ingress, root):
    (delay_ms, jitter_ms, dist), (loss_pct, corr_pct) = delay, loss
    kwargs = dict(rate_bps=rate, delay_ms=delay_ms, jitter_ms=jitter_ms, jitter_distribution=dist, loss_pct=loss_pct,
                  loss_corr_pct=corr_pct, limit_packets=limit, ingress=ingress, root_qdisc=root)
    if rate is None and delay_ms == 0 and loss_pct == 0:
        with pytest.raises(SpecError, match="does nothing"):
            LinkProfile(**kwargs)
        return
    profile = LinkProfile(**kwargs)
    commands = profile_commands(profile)
    assert all(isinstance(a, str) for argv in commands for a in argv) and all(c[0] in ("tc", "ip") for c in commands)
    trees = [commands] if not ingress else [commands[:len(commands) // 2 - 2], commands[len(commands) // 2 + 2:]]
    if ingress:
        assert len(commands) % 2 == 0 and ["ip", "link", "add", IFB_DEV, "type", "ifb"] in commands
    for dev, tree in zip(["eth0", IFB_DEV], trees):
        assert all(argv[4] == dev for argv in tree if argv[0] == "tc")
        kinds = [a for argv in tree for a in argv if a in ("htb", "tbf", "netem", "pfifo")]
        netem = [argv for argv in tree if "netem" in argv]
        if rate is None:
            assert kinds == ["netem"] and netem[0][5] == "root"
        else:
            assert kinds[0] == root and any(f"{rate}bit" in argv for argv in tree)
            assert (netem[0][5:7] == ["parent", "1:1"]) if netem else True
            assert ("pfifo" in kinds) == (root == "htb" and limit is not None and not profile.needs_netem)
        assert bool(netem) == profile.needs_netem
        if netem:
            args = netem[0][netem[0].index("netem") + 1:]
            assert args[:2] == ["limit", str(limit if limit is not None else netem_limit_packets(profile))]
            assert ("delay" in args) == (delay_ms > 0) and ("loss" in args) == (loss_pct > 0)
            assert ("distribution" in args) == (dist not in (None, "uniform"))
            if jitter_ms:
                assert args[args.index("delay") + 2] == "2000us"
            if corr_pct:
                assert args[args.index("loss") + 2] == "25%"
            assert args == netem_args(profile)


# ----------------------------------------------------------------------------------------- plans

def test_plan_with_every_qdisc_is_the_whole_profile():
    profile = LinkProfile(rate_bps=100_000_000, delay_ms=20, loss_pct=1, ingress=True)
    plan = plan_shaping(profile, ALL_CAPABILITIES)
    assert plan.applied == profile and plan.unsupported == ()
    assert [list(c) for c in plan.commands] == profile_commands(profile)
    assert plan.devices == ("eth0", "ifb0")
    assert plan_shaping(None, ALL_CAPABILITIES).commands == ()


def test_delay_without_netem_fails_clearly_by_default():
    profile = LinkProfile(name="wan", rate_bps=100_000_000, delay_ms=20, jitter_ms=2, loss_pct=1)
    with pytest.raises(LinkShapingError) as info:
        plan_shaping(profile, NO_NETEM)
    message = str(info.value)
    for needle in ("'wan'", "delay 20 ms", "jitter 2 ms", "loss 1 %", "no netem", "Specified qdisc kind is unknown",
                   "allow_partial: true"):
        assert needle in message


def test_allow_partial_applies_the_rate_and_records_the_rest():
    profile = LinkProfile(rate_bps=100_000_000, delay_ms=20, jitter_ms=2, jitter_distribution="normal", loss_pct=1)
    plan = plan_shaping(profile, NO_NETEM, allow_partial=True)
    assert plan.applied == LinkProfile(rate_bps=100_000_000)
    assert [list(c) for c in plan.commands] == profile_commands(LinkProfile(rate_bps=100_000_000))
    assert len(plan.unsupported) == 1 and plan.unsupported[0].startswith("delay 20 ms, jitter 2 ms, loss 1 %: ")
    record = plan.to_dict()
    assert record["requested"]["delay_ms"] == 20 and record["applied_profile"]["delay_ms"] == 0
    assert record["summary"] == "100Mbit (htb), egress"
    delay_only = plan_shaping(LinkProfile(delay_ms=5), NO_NETEM, allow_partial=True)
    assert delay_only.commands == () and delay_only.applied is None and delay_only.unsupported


def test_missing_root_qdisc_or_ifb():
    no_htb = Capabilities(netem=True, tbf=True, htb=False, ifb=False)
    with pytest.raises(LinkShapingError, match="htb"):
        plan_shaping(LinkProfile(rate_bps=10**8), no_htb)
    assert plan_shaping(LinkProfile(rate_bps=10**8, root_qdisc="tbf"), no_htb).unsupported == ()
    partial = plan_shaping(LinkProfile(rate_bps=10**8, delay_ms=5), no_htb, allow_partial=True)
    assert partial.applied == LinkProfile(delay_ms=5) and "htb" in partial.unsupported[0]
    with pytest.raises(LinkShapingError, match="ifb"):
        plan_shaping(LinkProfile(rate_bps=10**8, ingress=True, root_qdisc="tbf"), no_htb)
    partial = plan_shaping(LinkProfile(rate_bps=10**8, ingress=True, root_qdisc="tbf"), no_htb, allow_partial=True)
    assert partial.devices == ("eth0",) and "ingress" in partial.unsupported[0]


# -------------------------------------------------------------------------------------- read-back
# Fixtures: `tc -j -s qdisc/class show` captured on this machine (tc_fixtures/README.md); every figure
# below is the one tc printed (rates x 8: iproute2's JSON prints bytes/s).

def qdiscs(name: str) -> list[dict]:
    return parse_tc_json(fixture(f"{name}.json"), "qdisc", "eth0")


def classes(name: str) -> list[dict]:
    return parse_tc_json(fixture(f"{name}.json"), "class", "eth0")


def test_read_htb_qdisc_and_class_from_json():
    assert qdiscs("htb-100mbit-qdisc-eth0") == [
        {"type": "qdisc", "kind": "htb", "handle": "1:", "parent": "root", "sent_bytes": 38784994,
         "sent_packets": 25629, "drops": 0, "overlimits": 865, "requeues": 0, "backlog_bytes": 0, "backlog_packets": 0}]
    assert classes("htb-100mbit-class-eth0") == [
        {"type": "class", "kind": "htb", "handle": "1:1", "parent": "root", "rate_bps": 100_000_000,
         "ceil_bps": 100_000_000, "burst_bytes": 50_000, "cburst_bytes": 50_000, "sent_bytes": 38784904,
         "sent_packets": 25628, "drops": 0, "overlimits": 865, "requeues": 0, "backlog_bytes": 0,
         "backlog_packets": 0}]
    assert rate_in_force_bps(qdiscs("htb-100mbit-qdisc-eth0") + classes("htb-100mbit-class-eth0")) == 100_000_000
    assert burst_bytes(100_000_000) == classes("htb-100mbit-class-eth0")[0]["burst_bytes"]  # what we asked for


def test_read_tbf_with_drops_and_a_busy_backlog():
    (tbf,) = qdiscs("tbf-10mbit-qdisc-eth0")
    # tc keeps the burst as a time and prints 16383 bytes back for the 16384 asked (text rounds to "16Kb")
    assert (tbf["kind"], tbf["rate_bps"], tbf["burst_bytes"], tbf["latency_ms"]) == ("tbf", 10**7, 16383, 100.0)
    assert (tbf["sent_bytes"], tbf["sent_packets"], tbf["drops"], tbf["overlimits"]) == (4660492, 3090, 766, 4373)
    assert "limit_packets" not in tbf  # tbf's limit is bytes, and tc does not print it
    (busy,) = qdiscs("tbf-10mbit-busy-qdisc-eth0")
    assert (busy["backlog_bytes"], busy["backlog_packets"], busy["drops"]) == (13626, 2, 766)
    assert classes("tbf-10mbit-class-eth0") == [{"type": "class", "kind": "tbf", "handle": "1:1", "parent": "1:"}]


def test_read_pfifo_ingress_ifb_and_unshaped():
    htb, pfifo = qdiscs("htb-1gbit-pfifo-qdisc-eth0")
    assert (pfifo["kind"], pfifo["handle"], pfifo["parent"], pfifo["limit_packets"]) == ("pfifo", "10:", "1:1", 500)
    assert pfifo["sent_packets"] == 249714 and htb["sent_packets"] == 249715
    (cls,) = classes("htb-1gbit-pfifo-class-eth0")
    assert (cls["rate_bps"], cls["burst_bytes"], cls["overlimits"]) == (10**9, 500_000, 5548)
    root, ingress = qdiscs("htb-50mbit-ingress-qdisc-eth0")
    assert (ingress["kind"], ingress["handle"], ingress["parent"]) == ("ingress", "ffff:", "ffff:fff1")
    assert (ingress["sent_bytes"], ingress["sent_packets"]) == (19078252, 13787)
    ifb = qdiscs("htb-50mbit-ingress-qdisc-ifb0") + classes("htb-50mbit-ingress-class-ifb0")
    assert rate_in_force_bps(ifb) == 50_000_000 and [e["sent_bytes"] for e in ifb] == [19915568, 19915568]
    (noqueue,) = qdiscs("unshaped-qdisc-eth0")
    assert (noqueue["kind"], noqueue["handle"], noqueue["parent"], noqueue["sent_bytes"]) == ("noqueue", "0:", "root", 0)
    assert classes("unshaped-class-eth0") == [] and parse_classes("", "eth0") == []
    assert rate_in_force_bps([noqueue]) is None


def test_read_netem_in_iproute2s_json():
    htb, child, root = qdiscs("netem-composed-qdisc-eth0")
    assert (child["kind"], child["parent"], child["limit_packets"]) == ("netem", "1:1", 2500)
    assert (child["delay_ms"], child["jitter_ms"], child["loss_pct"], child["loss_corr_pct"]) == (20.0, 2.0, 1.0, 25.0)
    assert (child["drops"], child["backlog_bytes"], child["backlog_packets"]) == (17, 3028, 2)
    assert (root["parent"], root["delay_ms"], root["jitter_ms"], root["loss_pct"]) == ("root", 80.0, 8.0, 0.5)
    assert "loss_corr_pct" not in root  # a zero correlation is printed in JSON, not recorded
    assert rate_in_force_bps([htb, child, root]) is None  # netem's rate is not a rate class


@pytest.mark.parametrize("name", ["htb-100mbit-class-eth0", "htb-1gbit-pfifo-class-eth0", "htb-50mbit-ingress-class-eth0",
                                  "htb-50mbit-ingress-class-ifb0", "tbf-10mbit-class-eth0", "unshaped-class-eth0"])
def test_classes_printed_as_text_by_iproute2_6_1_read_as_the_json(name):
    """iproute2 6.1 (the node image's) prints `tc -j -s class show` as text; read right after the JSON of
    iproute2 6.15 on an idle link, it gives the very same records."""
    text = fixture(f"{name}.txt")
    assert not text.lstrip().startswith("[")
    assert parse_class_text(text, "eth0") == parse_classes(text, "eth0") == classes(name)


def test_unreadable_read_back_is_an_error_naming_the_command():
    with pytest.raises(LinkShapingError, match="tc -j qdisc show dev eth0 printed no JSON"):
        parse_tc_json("qdisc noqueue 0: root refcnt 2", "qdisc", "eth0")
    with pytest.raises(LinkShapingError, match="not a list of objects"):
        parse_tc_json('{"kind": "htb"}', "qdisc", "eth0")
    with pytest.raises(LinkShapingError, match="rate is '100Mbit', expected a whole number"):
        parse_tc_json('[{"class": "htb", "handle": "1:1", "root": true, "rate": "100Mbit"}]', "class", "eth0")
    with pytest.raises(LinkShapingError, match="without kind or handle"):
        parse_tc_json('[{"handle": "1:"}]', "qdisc", "eth0")
    with pytest.raises(LinkShapingError, match="allowed: qdisc | class"):
        parse_tc_json("[]", "filter")
    with pytest.raises(LinkShapingError, match="cannot read 'class htb 1:1 root rate fast'"):
        parse_class_text("class htb 1:1 root rate fast", "eth0")


# ---------------------------------------------------------------------------------------- runner

class FakeContainer:
    """exec_run answers from a table: argv tuple -> (exit code, stdout, stderr); default success."""

    name = "fake_coordinator_1"

    def __init__(self, answers=None, fail_kinds=(), raises=None):
        self.answers, self.fail_kinds, self.raises, self.calls = answers or {}, fail_kinds, raises, []

    def exec_run(self, argv, demux=False):
        assert demux is True and isinstance(argv, list)
        self.calls.append(argv)
        if self.raises:
            raise self.raises
        if any(kind in argv for kind in self.fail_kinds):
            return 2, (None, fixture("netem-missing-stderr.txt").encode())
        code, out, err = self.answers.get(tuple(argv), (0, "", ""))
        return code, (out.encode() or None, err.encode() or None)


def test_runner_returns_stdout_and_raises_with_command_and_tcs_message():
    show = ("tc", "-j", "-s", "qdisc", "show", "dev", "eth0")
    runner = ContainerExec(FakeContainer({show: (0, fixture("unshaped-qdisc-eth0.json"), "")}, fail_kinds=("netem",)))
    assert "noqueue" in runner.run(list(show))
    with pytest.raises(LinkShapingError) as info:
        runner.run(["tc", "qdisc", "replace", "dev", "eth0", "root", "handle", "10:", "netem", "delay", "20000us"])
    assert str(info.value) == ("fake_coordinator_1: `tc qdisc replace dev eth0 root handle 10: netem delay 20000us` "
                               "failed (exit 2): Error: Specified qdisc kind is unknown.")
    with pytest.raises(LinkShapingError, match="could not run: container gone"):
        ContainerExec(FakeContainer(raises=RuntimeError("container gone"))).run(["tc", "-V"])


def test_read_back_runs_tc_json_and_takes_iproute2_6_1s_text_classes():
    def answers(class_suffix):
        return {("tc", "-j", "-s", kind, "show", "dev", dev): (0, fixture(f"htb-50mbit-ingress-{kind}-{dev}.{suffix}"), "")
                for dev in ("eth0", "ifb0") for kind, suffix in (("qdisc", "json"), ("class", class_suffix))}

    old_tc, new_tc = FakeContainer(answers("txt")), FakeContainer(answers("json"))
    records = read_back(ContainerExec(old_tc), ["eth0", "ifb0"])
    assert records == read_back(ContainerExec(new_tc), ["eth0", "ifb0"])
    assert old_tc.calls == [["tc", "-j", "-s", "qdisc", "show", "dev", "eth0"], ["tc", "-j", "-s", "class", "show", "dev", "eth0"],
                            ["tc", "-j", "-s", "qdisc", "show", "dev", "ifb0"], ["tc", "-j", "-s", "class", "show", "dev", "ifb0"]]
    assert [(e["type"], e["kind"]) for e in records["eth0"]] == [("qdisc", "htb"), ("qdisc", "ingress"), ("class", "htb")]
    assert rate_in_force_bps(records["eth0"]) == rate_in_force_bps(records["ifb0"]) == 50_000_000
    gone = FakeContainer({("tc", "-j", "-s", "qdisc", "show", "dev", "ifb0"): (1, "", 'Cannot find device "ifb0"')})
    with pytest.raises(LinkShapingError, match='Cannot find device "ifb0"'):
        read_back(ContainerExec(gone), ["ifb0"])


def test_read_back_reads_the_classes_again_when_an_htb_qdiscs_class_show_came_back_empty():
    """An htb qdisc always has its class: an empty `tc class show` is an exec whose output was lost, read
    again; a device with no htb (nothing shaped) takes the empty read as it is."""
    class LosesFirstClassShow(FakeContainer):
        def exec_run(self, argv, demux=False):
            if "class" in argv and sum("class" in call for call in self.calls) == 0:
                self.calls.append(argv)
                return 0, (None, None)
            return super().exec_run(argv, demux)

    answers = {("tc", "-j", "-s", kind, "show", "dev", "eth0"): (0, fixture(f"htb-100mbit-{kind}-eth0.json"), "")
               for kind in ("qdisc", "class")}
    flaky = LosesFirstClassShow(answers)
    records = read_back(ContainerExec(flaky), ["eth0"])
    assert rate_in_force_bps(records["eth0"]) == 100_000_000
    assert sum("class" in call for call in flaky.calls) == 2
    unshaped = FakeContainer({("tc", "-j", "-s", "qdisc", "show", "dev", "eth0"): (0, fixture("unshaped-qdisc-eth0.json"), "")})
    assert [r["type"] for r in read_back(ContainerExec(unshaped), ["eth0"])["eth0"]] == ["qdisc"]
    assert sum("class" in call for call in unshaped.calls) == 1


def test_probe_reports_what_the_kernel_lacks_and_cleans_up():
    container = FakeContainer(fail_kinds=("netem",))
    caps = probe_with(ContainerExec(container))
    assert (caps.netem, caps.tbf, caps.htb, caps.ifb) == (False, True, True, True)
    assert caps.errors == {"netem": "Error: Specified qdisc kind is unknown."}
    assert ["ip", "link", "del", "ifbprobe"] in container.calls
    assert ["iptables", "-w", "-t", "mangle", "-X", "WIIIIIDE-PROBE"] in container.calls
    assert probe_with(ContainerExec(FakeContainer())) == Capabilities(True, True, True, True, statistic=True,
                                                                      nfqueue=True, tee=True)
    # an image without the delay line (its check cannot run) probes without nfqueue, loss still applies
    no_delay_line = probe_with(ContainerExec(FakeContainer(fail_kinds=("netem", "wiiide-delayline"))))
    assert (no_delay_line.statistic, no_delay_line.nfqueue) == (True, False) and "nfqueue" in no_delay_line.errors


# ---------------------------------------------------------------------------------------- report

def _links(rates, unsupported=(), ingress=False):
    containers = {}
    for i, rate in enumerate(rates):
        role = "coordinator" if i == 0 else "worker"
        containers[f"c{i}"] = {"role": role, "worker_index": i or None, "applied_rate_bps": rate,
                               "unsupported": list(unsupported), "applied_profile": {"ingress": ingress}}
    return {"containers": containers}


def test_link_figures_for_the_report():
    nodes = {"coordinator": {"train_time_s": 10.0, "wire_bytes_sent": 100_000_000}}
    totals = repeat_totals(nodes, {}, _links([100_000_000, 100_000_000]))
    assert (totals.link_rate_bps, totals.coordinator_egress_utilisation) == (100_000_000, pytest.approx(0.8))
    unshaped = repeat_totals(nodes, {}, {})
    assert (unshaped.link_rate_bps, unshaped.coordinator_egress_utilisation) == (None, None)
    assert applied_rates_text(_links([10**8, 10**8, 10**8])) == "100Mbit"
    assert applied_rates_text(_links([10**8, 10**9, 10**7], ingress=True)) == "ps 100Mbit, w1 1Gbit, w2 10Mbit (+ingress)"
    assert applied_rates_text(_links([None, None])) == "-"
    missing = ["delay 20 ms: this kernel has no netem", "delay 20 ms: this kernel has no netem"]
    assert unsupported_text(_links([10**8, 10**8], missing)) == "delay 20 ms"
    point = Point.model_validate({
        "index": 0, "status": "ok",
        "repeats": [{"repeat": 0, "status": "ok", "links": {}},
                    {"repeat": 1, "status": "ok", "links": _links([10**8], missing)}],
        "summary": {"coordinator_egress_utilisation": {"median": 0.5, "mean": 0.5, "stdev": 0.0, "min": 0.5,
                                                       "max": 0.5, "count": 1}}})
    assert link_cells(point) == ["100Mbit", "delay 20 ms", "50"]
    unshaped = Point.model_validate({"index": 1, "status": "ok", "repeats": [{"repeat": 0, "status": "ok"}]})
    assert link_cells(unshaped) == ["-", "-", "-"]
