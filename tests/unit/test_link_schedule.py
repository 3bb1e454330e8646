"""Links that change while training: schedules and Mahimahi traces in a spec (harness/spec/timeline.py),
trace parsing with bad traces refused (harness/links/trace.py), the rate timeline of a trace, the
commands of each change (harness/links/schedule.py), the plan on a kernel without netem, the synthetic
trace generator, and the timeline runner's records with a fake runner (no timing asserted)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from harness.errors import LinkShapingError, SpecError
from harness.links.plan import ALL_CAPABILITIES, Capabilities
from harness.links.schedule import change_commands, plan_timed_shaping
from harness.links.trace import MAX_TRACE_MS, TraceError, parse_trace, rate_steps, read_trace
from harness.links.tracegen import generate
from harness.run.link_timeline import LinkTimeline, TimelineTarget
from harness.spec.points import build_spec
from harness.spec.timeline import TimedProfile

REPO_ROOT = Path(__file__).resolve().parents[2]
NO_NETEM = Capabilities(netem=False, tbf=True, htb=True, ifb=True)
HALVES = {"schedule": [{"at": "0s", "rate": "200mbit"}, {"at": "20s", "rate": "100mbit"}]}


def profile_of(link, workers=2):
    spec = build_spec({"name": "t", "base": {"num_workers": workers}, "axes": {"link": [link]}}, "experiments/t.yaml")
    return spec.points[0].cluster.link.profiles.for_container("worker", 1)


def test_a_schedule_is_the_first_step_and_its_later_changes():
    profile = profile_of(HALVES)
    assert isinstance(profile, TimedProfile) and profile.rate_bps == 200_000_000
    assert profile.timeline == ((20.0, {"rate_bps": 100_000_000}),) and profile.period_s is None
    assert list(profile.iter_changes()) == [(20.0, {"rate_bps": 100_000_000})]


def test_steps_carry_over_what_they_do_not_set():
    profile = profile_of({"schedule": [{"at": "0s", "rate": "100mbit", "delay": "10ms"},
                                       {"at": "5s", "delay": "50ms", "loss": "1%"}, {"at": "9s", "rate": "10mbit"}]})
    assert profile.delay_ms == 10 and profile.timeline[0] == (5.0, {"delay_ms": 50.0, "loss_pct": 1.0})
    assert profile.needs_netem and profile.changed_fields() == {"delay_ms", "loss_pct", "rate_bps"}


@pytest.mark.parametrize("link, needle", [
    ({"schedule": []}, "axes.link[0].schedule: [];"),
    ({"schedule": [{"at": "2s", "rate": "1mbit"}]}, "schedule[0].at: '2s'; the first step is at 0s"),
    ({"schedule": [{"at": "0s", "rate": "1mbit"}, {"at": "3s", "rate": "2mbit"}, {"at": "3s", "rate": "3mbit"}]},
     "schedule[2].at: '3s' is not after the step before (3 s)"),
    ({"schedule": [{"at": "0s", "rate": "1mbit"}, {"at": "1s", "rate": "2mbps"}]}, "schedule[1].rate:"),
    ({"schedule": [{"at": "0s", "rate": "1mbit"}, {"at": "1s", "loss": "120%"}]}, "schedule[1].loss: 120 %; allowed: 0..100 %"),
    ({"schedule": [{"at": "0s", "rate": "1mbit"}, {"at": "1s", "delay": "20"}]}, "schedule[1].delay:"),
    ({"schedule": [{"at": "0s", "rate": "1mbit"}, {"at": "1s", "speed": "2mbit"}]}, "schedule[1].speed: unknown key"),
    ({"schedule": [{"at": "0s", "delay": "5ms"}, {"at": "1s", "rate": "2mbit"}]}, "schedule[1].rate: a rate that changes is set from the first step"),
    ({"schedule": [{"rate": "1mbit"}]}, "schedule[0]:"),
    ({"schedule": [{"at": "0s", "rate": "1mbit"}], "trace": "x"}, "trace: give a schedule or a trace, not both"),
    ({"trace": "experiments/traces/walk-1.trace", "rate": "1mbit"}, "rate: a trace sets the rate"),
    ({"trace": "experiments/traces/walk-1.trace", "window": "1ms"}, "window: 1 ms; allowed: 10ms..60s"),
    ({"trace": "experiments/traces/missing.trace"}, "trace: "),
])
def test_bad_schedules_stop_the_spec_naming_file_and_field(link, needle):
    with pytest.raises(SpecError) as err:
        profile_of(link)
    assert str(err.value).startswith("experiments/t.yaml: axes.link[0]") and needle in str(err.value), str(err.value)


@pytest.mark.parametrize("text, needle", [
    ("", "empty"),
    ("\n  \n", "empty"),
    ("1\n2\n1\n", "line 3: 1 ms comes after 2 ms"),
    ("-5\n3\n", "line 1: -5 ms is negative"),
    ("1\n2.5\n", "line 2: '2.5' is not a whole number"),
    ("1\nten\n", "line 2: 'ten' is not a whole number"),
    (f"1\n{MAX_TRACE_MS + 1}\n", "line 2: 3600001 ms; allowed: at most"),
    ("0\n0\n", "last timestamp is 0 ms"),
    ("9" * 20 + "\n", "line 1:"),
])
def test_bad_traces_are_refused_with_the_line(text, needle):
    with pytest.raises(TraceError) as err:
        parse_trace(text, "t.trace")
    assert needle in str(err.value), str(err.value)


def test_a_huge_trace_is_refused(tmp_path, monkeypatch):
    import harness.links.trace as trace
    monkeypatch.setattr(trace, "MAX_OPPORTUNITIES", 10)
    with pytest.raises(TraceError, match="more than 10 delivery opportunities"):
        parse_trace("\n".join(str(i) for i in range(1, 12)))
    monkeypatch.setattr(trace, "MAX_TRACE_BYTES", 100)
    (tmp_path / "big.trace").write_text("1\n" * 60)
    with pytest.raises(TraceError, match="120 bytes; allowed: at most 100 bytes"):
        read_trace(tmp_path / "big.trace")


def test_a_trace_becomes_a_rate_per_window():
    # 100 ms windows: 10 opportunities (1.2 Mbit/s), none (the floor), 5 in the last 50 ms (1.2 Mbit/s)
    opportunities = [5] * 10 + [250, 251, 252, 253, 250]
    opportunities = sorted(opportunities)
    steps = rate_steps(opportunities + [], 100)
    assert steps[0] == (0.0, 10 * 1500 * 8 * 10)
    assert steps[1] == (0.1, 1000)  # an outage: MIN_RATE_BPS
    assert steps[2][0] == 0.2 and steps[2][1] == round(5 * 1500 * 8 * 1000 / 53.0)  # the last window is 53 ms long
    same = rate_steps([100, 200, 300], 100)  # one per window: one step, joined
    assert same == [(0.0, 120_000)]


def test_a_trace_profile_loops_its_period():
    profile = profile_of({"trace": "experiments/traces/walk-1.trace", "window": "100ms"})
    assert profile.period_s == 30.0 and profile.source == "experiments/traces/walk-1.trace"
    changes = list(itertools.islice(profile.iter_changes(), len(profile.timeline) + 2))
    assert changes[len(profile.timeline)] == (30.0, {"rate_bps": profile.rate_bps})  # back to the start
    assert changes[len(profile.timeline) + 1][0] == 30.0 + profile.timeline[0][0]
    once = profile_of({"trace": "experiments/traces/walk-1.trace", "loop": False})
    assert len(list(once.iter_changes())) == len(once.timeline)


def test_the_shipped_traces_are_what_their_generator_makes():
    for name, kind, seed in (("walk-1", "walk", 1), ("drive-2", "drive", 2)):
        written = read_trace(REPO_ROOT / "experiments" / "traces" / f"{name}.trace")
        assert written == generate(kind, seed, 30.0), name


def test_change_commands_for_htb_tbf_netem_and_ingress():
    profile = profile_of(HALVES)
    after = profile.replace(rate_bps=100_000_000, timeline=())
    [cmd] = change_commands(after, {"rate_bps"})
    assert cmd[:10] == ["tc", "class", "change", "dev", "eth0", "parent", "1:", "classid", "1:1", "htb"]
    assert cmd[cmd.index("rate") + 1] == "100000000bit" and cmd[cmd.index("ceil") + 1] == "100000000bit"
    [tbf] = change_commands(after.replace(root_qdisc="tbf"), {"rate_bps"})
    assert tbf[:9] == ["tc", "qdisc", "change", "dev", "eth0", "root", "handle", "1:", "tbf"]
    both = change_commands(after.replace(delay_ms=50.0, ingress=True), {"delay_ms"})
    assert [c[4] for c in both] == ["eth0", "ifb0"] and all("netem" in c and "50000us" in c for c in both)
    pair = change_commands(after, {"rate_bps"}, classid="1:13", netem_handle="113:")
    assert "1:13" in pair[0]
    assert change_commands(after, {"limit_packets"}) == []


def test_a_schedule_of_delay_needs_netem_or_allow_partial():
    profile = profile_of({"schedule": [{"at": "0s", "rate": "100mbit"}, {"at": "5s", "delay": "30ms"},
                                       {"at": "9s", "rate": "50mbit"}]})
    with pytest.raises(LinkShapingError, match="a schedule that changes delay while training needs netem"):
        plan_timed_shaping(profile, NO_NETEM)
    plan = plan_timed_shaping(profile, NO_NETEM, allow_partial=True)
    assert plan.applied.timeline == ((9.0, {"rate_bps": 50_000_000}),)
    assert "a schedule that changes delay while training: this kernel has no netem" in plan.unsupported
    assert not any("netem" in c for c in plan.commands)
    with_netem = plan_timed_shaping(profile, ALL_CAPABILITIES)
    assert any("netem" in c for c in with_netem.commands)  # there from the start, changed at 5 s


class FakeRunner:
    def __init__(self, fail_on=None):
        self.ran, self.fail_on = [], fail_on

    def run(self, argv):
        self.ran.append(list(argv))
        if self.fail_on and self.fail_on in argv:
            raise LinkShapingError("tc: RTNETLINK answers: No such file or directory")
        if argv[:4] == ["tc", "-j", "-s", "qdisc"]:
            return '[{"kind": "htb", "handle": "1:", "root": true, "options": {}}]'
        if argv[:4] == ["tc", "-j", "-s", "class"]:  # iproute2 6.1 prints classes as text
            rate = next(a for a in reversed([c for c in self.ran if "change" in c]))
            return f"class htb 1:1 root prio 0 rate {rate[rate.index('rate') + 1]} ceil 1Mbit burst 16Kb cburst 16Kb\n"
        return ""


def run_two_changes(runner) -> list[dict]:
    """A schedule of two changes 10 ms apart run to its end with `runner`; its records."""
    profile = profile_of({"schedule": [{"at": "0s", "rate": "200mbit"}, {"at": "10ms", "rate": "100mbit"},
                                       {"at": "20ms", "rate": "50mbit"}]})
    records: list[dict] = []
    timeline = LinkTimeline()
    timeline.add(TimelineTarget("w1", runner, profile, records))
    timeline.start(time.monotonic())
    for _ in range(500):
        if len(records) == 2:
            break
        time.sleep(0.01)
    timeline.stop()
    return records


def test_the_timeline_runs_each_change_and_records_it():
    records = run_two_changes(FakeRunner())
    assert [r["at_s"] for r in records] == [0.01, 0.02]
    assert [r["read_back_rate_bps"] for r in records] == [100_000_000, 50_000_000]
    assert all(r["applied_at_s"] >= r["at_s"] and "error" not in r for r in records)


def test_a_failed_change_is_recorded_and_the_timeline_goes_on():
    records = run_two_changes(FakeRunner(fail_on="100000000bit"))
    assert "No such file" in records[0]["error"] and records[1]["read_back_rate_bps"] == 50_000_000


def test_the_report_table_shows_where_a_schedule_ended():
    from harness.present.links_text import applied_rates_text
    halved = {"role": "worker", "worker_index": 1, "applied_rate_bps": 2 * 10**8,
              "timeline_changes": [{"at_s": 15.0, "changes": {"rate_bps": 10**8}}]}
    assert applied_rates_text({"containers": {"w": halved}}) == "200Mbit -> 100Mbit"
    traced = {**halved, "timeline_changes": [{"changes": {"rate_bps": r}} for r in (1, 2, 3)]}
    assert applied_rates_text({"containers": {"w": traced}}) == "200Mbit (3 changes)"
