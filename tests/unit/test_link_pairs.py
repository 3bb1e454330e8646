"""Links by pair of nodes (harness/spec/pairs.py, harness/links/pairs.py): the spec's forms and their
errors (file and field named, before anything starts), which link each pair takes, the tc commands of
one node's egress, and the per-pair read-back of classes and u32 filters."""

from __future__ import annotations

import json

import pytest

from harness.errors import LinkShapingError, SpecError
from harness.links.pairs import class_minor, pair_commands, pair_records, parse_filters, plan_pairs
from harness.links.plan import ALL_CAPABILITIES, Capabilities
from harness.links.readback import parse_class_text
from harness.spec.points import build_spec

NO_NETEM = Capabilities(netem=False, tbf=True, htb=True, ifb=True)
PRESETS = {"slow": {"rate": "10mbit"}, "fast": {"rate": "1gbit"}}
IPS = {"coordinator": "172.18.0.2", "worker-1": "172.18.0.3", "worker-2": "172.18.0.4", "worker-3": "172.18.0.5"}


def topology(link, workers=3):
    spec = build_spec({"name": "t", "base": {"num_workers": workers}, "axes": {"link": [link]},
                       "link_presets": PRESETS}, "experiments/t.yaml")
    return spec.points[0].cluster.link.topology


STAR = {"pairs": [{"between": ["coordinator", "worker-3"], "profile": "slow"}], "default": "fast"}
REGIONS = {"regions": {"east": ["coordinator", "worker-1"], "west": ["worker-2", "worker-3"]},
           "lan": "fast", "wan": {"rate": "50mbit"}}


def test_a_star_with_one_slow_worker():
    topo = topology(STAR)
    assert topo.link_for("coordinator", "worker-3")[0] == "pairs[0]"
    assert topo.link_for("worker-3", "coordinator")[1].rate_bps == 10_000_000  # both directions
    assert topo.link_for("coordinator", "worker-1") == ("default", topo.default)
    assert topo.link_for("worker-1", "worker-2")[1].rate_bps == 10**9


def test_two_regions_lan_inside_wan_between():
    topo = topology(REGIONS)
    assert topo.link_for("coordinator", "worker-1")[0] == "lan"
    assert topo.link_for("worker-1", "worker-2")[0] == "wan"
    assert topo.link_for("worker-3", "coordinator")[1].rate_bps == 50_000_000


def test_exact_pairs_win_over_every_worker_and_regions():
    topo = topology({**REGIONS, "pairs": [{"between": ["coordinator", "worker"], "rate": "200mbit"},
                                          {"between": ["worker-2", "coordinator"], "profile": "none"}]})
    assert topo.link_for("coordinator", "worker-1") == ("pairs[0]", topo.pairs[0].profile)
    assert topo.link_for("coordinator", "worker-2") == ("pairs[1]", None)  # explicitly unshaped
    assert topo.link_for("worker-1", "worker-2")[0] == "wan"  # `worker` pairs only with the coordinator here


@pytest.mark.parametrize("link, needle", [
    ({"pairs": [{"between": ["coordinator", "wrker-1"], "profile": "slow"}]},
     "axes.link[0].pairs[0].between[1]: unknown node 'wrker-1'"),
    ({"pairs": [{"between": ["coordinator", "worker-4"], "profile": "slow"}]},
     "axes.link[0].pairs[0].between[1]: 'worker-4' but the point has 3 workers"),
    ({"regions": {"a": ["coordinator"], "b": ["worker-9"]}, "wan": "slow"},
     "axes.link[0].regions.b[0]: 'worker-9' but the point has 3 workers"),
    ({"pairs": [{"between": ["worker-1", "worker-1"], "profile": "slow"}]}, "pairs[0].between: 'worker-1' twice"),
    ({"pairs": [{"between": ["worker-1", "worker-2"], "profile": "slow"},
                {"between": ["worker-2", "worker-1"], "profile": "fast"}]}, "pairs[1]: the pair worker-2 and worker-1 is given twice"),
    ({"pairs": [{"between": ["coordinator", "worker-1"], "profile": "nope"}]}, "pairs[0].profile: unknown link preset 'nope'"),
    ({"pairs": [{"between": ["coordinator", "worker-1"], "rate": "10mbit", "qdisc": "tbf"}]}, "an htb class"),
    ({"pairs": [{"between": ["coordinator", "worker-1"]}]}, "pairs[0]: no profile"),
    ({"pairs": [{"between": ["coordinator", "worker-1"], "rate": "10"}]}, "pairs[0]: link profile 'inline': rate"),
    ({"regions": {"a": ["coordinator", "worker-1"], "b": ["worker-1"]}, "lan": "fast"}, "regions.b[0]: 'worker-1' is in region 'a'"),
    ({"pairs": [], "lan": "fast"}, "lan: lan is the link inside regions; give regions too"),
    ({"regions": {"a": ["coordinator"]}}, "regions need lan, wan or both"),
    ({"pairs": [], "switch": 1}, "switch: unknown key beside pairs/regions"),
])
def test_bad_pairs_stop_the_spec_naming_file_and_field(link, needle):
    with pytest.raises(SpecError) as err:
        topology(link)
    assert str(err.value).startswith("experiments/t.yaml: ") and needle in str(err.value), str(err.value)


def test_the_commands_of_one_nodes_egress():
    plan = plan_pairs(topology(STAR), "coordinator", 3, ALL_CAPABILITIES)
    assert [c.peer for c in plan.classes] == ["worker-1", "worker-2", "worker-3"]
    commands = pair_commands(plan, IPS)
    assert commands[0] == ["tc", "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "htb"]  # no default
    slow = [c for c in commands if "1:13" in c]
    assert slow[0][:10] == ["tc", "class", "replace", "dev", "eth0", "parent", "1:", "classid", "1:13", "htb"]
    assert slow[0][slow[0].index("rate") + 1] == "10000000bit"
    assert slow[1] == ["tc", "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                       "match", "ip", "dst", "172.18.0.5/32", "flowid", "1:13"]
    assert len(commands) == 1 + 2 * 3  # root, then a class and a filter per peer (no netem: rate only)


def test_a_pair_with_delay_gets_netem_under_its_class_where_the_kernel_has_it():
    topo = topology({"pairs": [{"between": ["worker-1", "worker-2"], "rate": "100mbit", "delay": "20ms"}]})
    commands = pair_commands(plan_pairs(topo, "worker-2", 3, ALL_CAPABILITIES), IPS)
    netem = [c for c in commands if "netem" in c]
    assert netem and netem[0][5:9] == ["parent", "1:11", "handle", "111:"] and "20000us" in netem[0]


def test_a_pair_delay_without_netem_fails_or_is_recorded_with_allow_partial():
    topo = topology({"pairs": [{"between": ["coordinator", "worker-1"], "rate": "100mbit", "delay": "20ms"}]})
    with pytest.raises(LinkShapingError, match="pair coordinator->worker-1: .*delay 20 ms.*no netem"):
        plan_pairs(topo, "coordinator", 3, NO_NETEM)
    plan = plan_pairs(topo, "coordinator", 3, NO_NETEM, allow_partial=True)
    assert plan.classes[0].applied.delay_ms == 0 and plan.classes[0].applied.rate_bps == 100_000_000
    assert plan.unsupported == ("pair coordinator->worker-1: delay 20 ms: this kernel has no netem",)
    assert not any("netem" in c for c in pair_commands(plan, IPS))


def test_a_node_with_no_shaped_pair_gets_no_commands_and_a_missing_address_is_refused():
    topo = topology({"pairs": [{"between": ["coordinator", "worker-1"], "profile": "slow"}]})
    assert pair_commands(plan_pairs(topo, "worker-2", 3, ALL_CAPABILITIES), IPS) == []
    with pytest.raises(LinkShapingError, match="no IPv4 address for worker-1"):
        pair_commands(plan_pairs(topo, "coordinator", 3, ALL_CAPABILITIES), {"coordinator": "172.18.0.2"})
    with pytest.raises(ValueError):
        class_minor("ps")


# what iproute2 6.1 prints for `tc -j -s filter show dev eth0` after two u32 filters (the node image)
FILTERS_JSON = json.dumps([
    {"parent": "1:", "protocol": "ip", "pref": 1, "kind": "u32", "chain": 0},
    {"parent": "1:", "protocol": "ip", "pref": 1, "kind": "u32", "chain": 0, "options": {"fh": "800:", "ht_divisor": 1}},
    {"parent": "1:", "protocol": "ip", "pref": 1, "kind": "u32", "chain": 0, "options": {
        "fh": "800::800", "order": 2048, "key_ht": "800", "bkt": "0", "flowid": "1:11", "not_in_hw": True,
        "match": {"value": "ac120003", "mask": "ffffffff", "offmask": "", "off": 16}}},
    {"parent": "1:", "protocol": "ip", "pref": 1, "kind": "u32", "chain": 0, "options": {
        "fh": "800::801", "order": 2049, "key_ht": "800", "bkt": "0", "flowid": "1:13", "not_in_hw": True,
        "match": {"value": "ac120005", "mask": "ffffffff", "offmask": "", "off": 16}}},
])
CLASSES_TEXT = """class htb 1:11 root prio 0 rate 1Gbit ceil 1Gbit burst 500000b cburst 500000b
 Sent 52000 bytes 40 pkt (dropped 0, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
class htb 1:13 root prio 0 rate 10Mbit ceil 10Mbit burst 16Kb cburst 16Kb
 Sent 1200000 bytes 800 pkt (dropped 3, overlimits 12 requeues 0)
 backlog 0b 0p requeues 0
"""


def test_filters_and_classes_are_read_back_per_pair():
    assert parse_filters(FILTERS_JSON) == {"1:11": "172.18.0.3", "1:13": "172.18.0.5"}
    plan = plan_pairs(topology({"pairs": [{"between": ["coordinator", "worker-3"], "profile": "slow"},
                                          {"between": ["coordinator", "worker-1"], "profile": "fast"}]}),
                      "coordinator", 3, ALL_CAPABILITIES)
    records = pair_records(plan, IPS, parse_class_text(CLASSES_TEXT), parse_filters(FILTERS_JSON))
    assert set(records) == {"coordinator->worker-1", "coordinator->worker-3"}
    slow = records["coordinator->worker-3"]
    assert (slow["rate_bps"], slow["sent_bytes"], slow["drops"], slow["filter_ok"]) == (10_000_000, 1_200_000, 3, True)
    assert slow["link"] == "pairs[0]" and slow["peer_ip"] == "172.18.0.5"
    wrong = pair_records(plan, {**IPS, "worker-1": "172.18.0.9"}, [], parse_filters(FILTERS_JSON))
    assert wrong["coordinator->worker-1"]["filter_ok"] is False and wrong["coordinator->worker-1"]["sent_bytes"] is None
    with pytest.raises(LinkShapingError, match="not JSON"):
        parse_filters("filter parent 1: protocol ip")


def test_the_report_table_shows_the_pairs_rates():
    from harness.present.links_text import applied_rates_text
    links = {"containers": {"c": {"role": "coordinator", "applied_rate_bps": None}},
             "pairs": {"coordinator->worker-3": {"rate_bps": 10**7}, "coordinator->worker-1": {"rate_bps": 10**9},
                       "worker-1->coordinator": {"rate_bps": 10**9}}}
    assert applied_rates_text(links) == "pairs 10Mbit/1Gbit"
