"""The spec stage's models (harness/spec): one style of checking, one-line messages with the file, the
field path and what is allowed, units through wiiide.units, and the shipped JSON Schema of a sweep spec."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from harness.errors import SpecError
from harness.spec import schema
from harness.spec.base import join_path
from harness.spec.cluster import parse_cluster, parse_cpus, parse_mem_bytes
from harness.spec.faults import Fault, parse_faults
from harness.spec.links import LinkProfile
from harness.spec.points import SweepSpec, build_spec, load_spec
from harness.spec.sysctls import parse_sysctls

REPO_ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted((REPO_ROOT / "experiments").glob("*.yaml"))


def _validator() -> jsonschema.Draft202012Validator:
    shipped = json.loads(schema.SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema(shipped)
    return jsonschema.Draft202012Validator(shipped)


# ----------------------------------------------------------------------------------- the schema

def test_the_shipped_schema_is_what_the_models_generate():
    assert schema.SCHEMA_FILE.read_text() == schema.schema_text(), "stale: run python -m harness.spec.schema"
    generated = schema.sweep_spec_schema()
    assert generated["$schema"] == schema.SCHEMA_DIALECT
    assert set(generated["properties"]) == {"name", "description", "repeats", "base", "axes", "reference",
                                            "timeout_s", "link_presets", "faults", "host_sysctls"}
    assert generated["additionalProperties"] is False


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.name)
def test_every_experiment_validates_against_the_schema(path):
    data = yaml.safe_load(path.read_text())
    errors = [f"{list(e.path)}: {e.message}" for e in _validator().iter_errors(data)]
    assert errors == []
    assert load_spec(path).points


@pytest.mark.parametrize("bad", [
    {"name": "x", "repeat": 2},                                            # a misspelt top-level key
    {"name": "x", "repeats": 0},
    {"name": "x y"},
    {"name": "x", "base": {"links": "lan-1g"}},                             # not a config field
    {"name": "x", "axes": {"compression": []}},
    {"name": "x", "axes": {"link": [{"rate": 100}]}},                       # a rate needs a unit
    {"name": "x", "base": {"link": {"coordinator": "lan-1g", "switch": "lan-1g"}}},
    {"name": "x", "link_presets": {"w": {"bandwidth": "1gbit"}}},
    {"name": "x", "faults": [{"action": "explode", "target": "worker-1", "at_s": 1}]},
    {"name": "x", "faults": [{"action": "kill", "target": "worker-0", "at_s": 1}]},
    {"name": "x", "host_sysctls": {"kernel.panic": 1}},
    {"name": "x", "timeout_s": 0},
])
def test_the_schema_and_the_models_refuse_the_same_mistakes(bad):
    assert list(_validator().iter_errors(bad)), bad
    with pytest.raises(SpecError):
        build_spec(bad, "x.yaml")


def test_the_schema_command_writes_and_checks(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert schema.main(["--check", "--output", str(out)]) == 1  # missing: stale
    assert schema.main(["--output", str(out)]) == 0 and out.read_text() == schema.schema_text()
    assert schema.main(["--check", "--output", str(out)]) == 0
    out.write_text("{}\n")
    assert schema.main(["--check", "--output", str(out)]) == 1
    assert "stale" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- messages

@pytest.mark.parametrize("data, message", [
    ({"name": "x", "repeat": 2}, "x.yaml: repeat: unknown key; allowed: name, description, repeats, base, axes, "),
    ({"name": "x", "repeats": 1001}, "x.yaml: repeats: 1001 must be an integer 1..1000"),
    ({"name": "x", "repeats": "3"}, "x.yaml: repeats: '3'; allowed: an integer"),
    ({"name": "x", "axes": {"link": ["lan-1g", {"all": {"rate": "1gbit", "loss": 101}}]}},
     "x.yaml: axes.link[1].all: link profile 'inline': loss: 101 %; allowed: 0..100 %"),
    ({"name": "x", "link_presets": {"w": {"rate": "1gbit", "jitter": "2ms"}}},
     "x.yaml: link_presets.w: link profile 'w': jitter: 2 ms; allowed: <= delay (0 ms)"),
    ({"name": "x", "faults": [{"action": "kill", "target": "worker-1", "at_s": 1},
                              {"action": "pause", "target": "worker-1", "at_s": 1}]},
     "x.yaml: faults[1].duration_s: pause needs a duration > 0 s"),
    ({"name": "x", "faults": [{"action": "kill", "target": "worker-3", "at_s": 1}]},
     "x.yaml: faults[0].target: worker-3 but the point has 2 workers"),
    ({"name": "x", "base": {"mem_limit": {"worker-1": "1.5 lots"}}},
     "x.yaml: base.mem_limit.worker-1: '1.5 lots' is not a size"),
    ({"name": "x", "axes": {"cpus": [{"worker": 0.5, "switch": 1}]}},
     "x.yaml: axes.cpus[0].switch: unknown key; allowed: all, coordinator, worker, worker-N"),
    ({"name": "x", "base": {"cpus": {"worker-0": 1}}}, "x.yaml: base.cpus.worker-0: workers are numbered from 1"),
])
def test_messages_name_the_file_the_path_and_what_is_allowed(data, message):
    with pytest.raises(SpecError) as info:
        build_spec(data, "x.yaml")
    text = str(info.value)
    assert text.startswith(message), text
    assert "\n" not in text and "pydantic" not in text and "Input should" not in text


def test_several_problems_give_the_first_and_a_count():
    with pytest.raises(SpecError) as info:
        build_spec({"name": "x", "repeats": 0, "timeout_s": -1, "faults": "x"}, "x.yaml")
    assert str(info.value) == "x.yaml: repeats: 0 must be an integer 1..1000 (and 2 more problems)"


def test_field_paths():
    assert join_path("axes", "link", 2, "rate") == "axes.link[2].rate"
    assert join_path("", "faults", 0) == "faults[0]" and join_path() == ""


# -------------------------------------------------------------------------------------- units

def test_sizes_go_through_wiiide_units_iec():
    assert parse_mem_bytes("1.5GiB", "m") == 1536 * 2**20 and parse_mem_bytes("512m", "m") == 512 * 2**20
    assert parse_mem_bytes(0, "m") is None and parse_mem_bytes("none", "m") is None
    assert parse_mem_bytes(64 * 2**20, "m") == 64 * 2**20
    with pytest.raises(SpecError, match=r"^m: '1.5b' is not a whole number of bytes"):
        parse_mem_bytes("1.5b", "m")
    assert parse_sysctls({"net.core.rmem_max": "32MiB", "net.core.wmem_max": 8388608}, "s.yaml") == {
        "net.core.rmem_max": 32 * 2**20, "net.core.wmem_max": 8 * 2**20}
    assert parse_cpus("none", "c") is None and parse_cpus(0.5, "c") == 0.5
    with pytest.raises(SpecError, match="^c: True CPUs; allowed: 0"):
        parse_cpus(True, "c")


def test_rates_and_times_need_units_in_yaml_not_in_python():
    assert LinkProfile.from_mapping({"rate": "2.5gbit", "delay": "500us"}).rate_bps == 2_500_000_000
    assert LinkProfile.from_mapping({"delay": "1.5s"}).delay_ms == 1500.0
    with pytest.raises(SpecError, match=r"link profile 'p': delay: 20 needs a unit"):
        LinkProfile.from_mapping({"delay": 20}, "p")
    with pytest.raises(SpecError, match=r"link profile 'p': name: unknown key; allowed: rate, delay"):
        LinkProfile.from_mapping({"name": "q", "rate": "1gbit"}, "p")
    with pytest.raises(SpecError, match=r"link profile 'p': rate_bps: unknown key"):
        LinkProfile.from_mapping({"rate_bps": 10**9}, "p")
    assert LinkProfile(rate_bps=10**8, delay_ms=20) == LinkProfile(rate_bps="100mbit", delay_ms="20ms")


# ------------------------------------------------------------------------------------- models

def test_link_profiles_are_frozen_and_replace_validates():
    profile = LinkProfile.from_mapping({"rate": "100mbit", "delay": "20ms", "jitter": "2ms"}, "wan")
    assert profile.name == "wan" and profile.to_dict()["jitter_ms"] == 2.0
    with pytest.raises(Exception):
        profile.rate_bps = 1  # frozen
    assert profile.replace(rate_bps=None).rate_bps is None and profile.replace(ingress=True).ingress is True
    with pytest.raises(SpecError, match=r"link profile 'wan': jitter: 2 ms; allowed: <= delay \(0 ms\)"):
        profile.replace(delay_ms=0.0)
    assert profile.without_netem() == LinkProfile(name="wan", rate_bps=100_000_000)
    assert hash(profile) == hash(profile.replace())


def test_faults_are_models_with_their_worker():
    kill, pause = parse_faults([{"action": "kill", "target": "worker-2", "at_s": 5},
                                {"action": "pause", "target": "coordinator", "at_s": 1, "duration_s": 2.5}], "f.yaml")
    assert kill == Fault(action="kill", target="worker-2", at_s=5.0) and kill.worker_index == 2
    assert pause.worker_index is None and pause.to_dict() == {"action": "pause", "target": "coordinator",
                                                              "at_s": 1.0, "duration_s": 2.5}
    assert parse_faults(None, "f.yaml") == []
    with pytest.raises(SpecError, match=r"^f.yaml: faults\[0\].at_s: 90000.0; allowed: seconds, 0..86400$"):
        parse_faults([{"action": "kill", "target": "worker-1", "at_s": 90_000}], "f.yaml")
    with pytest.raises(SpecError, match=r"^f.yaml: faults: 'kill'; allowed: a list$"):
        parse_faults("kill", "f.yaml")


def test_the_spec_model_holds_the_file_and_its_grid():
    spec = build_spec({"description": "d", "base": {"num_workers": 3, "cpus": {"worker-3": 0.5}},
                       "axes": {"buffer_bytes": ["1MiB", "4MiB"], "link": [{"rate": "1gbit"}]}, "repeats": 2,
                       "host_sysctls": {"net.core.rmem_max": "16MiB"}}, "experiments/grid.yaml")
    assert spec.name == "grid" and spec.source == "experiments/grid.yaml" and spec.param_names == ["buffer_bytes", "link"]
    assert [p.config.sndbuf_bytes for p in spec.points] == [2**20, 4 * 2**20]
    assert [p.index for p in spec.points] == [0, 1] and spec.points[0].params == {"buffer_bytes": "1MiB", "link": "rate=1gbit"}
    assert spec.points[1].cluster.cpus.for_container("worker", 3) == 0.5
    assert spec.points[1].cluster.link.profiles.for_container("coordinator").rate_bps == 10**9
    assert spec.to_dict()["host_sysctls"] == {"net.core.rmem_max": 16 * 2**20}
    assert spec.to_dict()["axes"]["link"] == [{"rate": "1gbit"}]  # as written
    spec.repeats = 5  # `--repeats` overrides it
    assert spec.to_dict()["repeats"] == 5
    with pytest.raises(SpecError, match="name: '' must be a non-empty string"):
        SweepSpec(repeats=1)


def test_null_sections_read_as_empty():
    spec = build_spec({"name": "n", "base": None, "axes": None, "reference": None, "faults": None,
                       "link_presets": None, "host_sysctls": None}, "n.yaml")
    assert (spec.base, spec.axes, spec.faults, spec.host_sysctls) == ({}, {}, [], {}) and len(spec.points) == 1


def test_cluster_settings_from_python_and_yaml_agree():
    settings = parse_cluster({"mem_limit": {"coordinator": "2GiB", "worker": "none"}}, {}, 2, {"mem_limit": "m"})
    assert settings.mem_limit.for_container("coordinator") == 2**31 and settings.mem_limit.for_container("worker", 1) is None
    assert settings.to_dict() == {"link": None, "cpus": None, "mem_limit_bytes": {"coordinator": 2**31, "worker": None}}
    assert parse_cluster({"cpus": {"worker": "none"}}, {}, 2, {"cpus": "c"}).is_empty  # all explicitly none


def _alias_bomb(levels: int, fanout: int) -> str:
    lines = [f"  l0: &l0 [{', '.join(['x'] * fanout)}]"]
    for i in range(1, levels):
        lines.append(f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * fanout)}]")
    return "name: bomb\nbase: {num_workers: 2}\naxes: {batch_size: [8]}\nreference:\n" + "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_before_anything_walks_it(tmp_path):
    """Nine levels of nine aliases: 9**9 nodes once expanded (the report once wrote 512 MB of it)."""
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb(9, 9))
    with pytest.raises(SpecError, match=r"bomb\.yaml: refused: its aliases expand to more than 100,000 nodes"):
        load_spec(path)


def test_a_few_aliases_are_fine_and_a_recursive_one_is_refused(tmp_path):
    ok = tmp_path / "ok.yaml"
    ok.write_text(_alias_bomb(3, 3))  # 3**3 leaves: a real spec's use of anchors
    assert load_spec(ok).reference["l2"] == [[["x"] * 3] * 3] * 3
    loop = tmp_path / "loop.yaml"
    loop.write_text("name: loop\nbase: {num_workers: 2}\naxes: {batch_size: [8]}\nreference: &r {self: *r}\n")
    with pytest.raises(SpecError, match="loop.yaml: refused: a structure that contains itself"):
        load_spec(loop)


def test_a_worker_number_of_thousands_of_digits_is_a_clear_error():
    """int() of a 5,000-digit string raises ValueError in Python 3.11: the pattern refuses it first."""
    target = "worker-" + "9" * 5000
    with pytest.raises(SpecError, match=r"target: 'worker-9+\.\.\.; allowed: coordinator"):
        parse_faults([{"action": "kill", "target": target, "at_s": 1}], "x.yaml")
    with pytest.raises(SpecError):
        build_spec({"name": "w", "base": {"num_workers": 2},
                    "axes": {"link": [{"worker-" + "9" * 5000: "rate-100m"}]}}, "x.yaml")


def test_only_keeps_the_matching_points_renumbered_and_refuses_what_selects_nothing():
    from harness.spec.points import select_points
    raw = {"name": "sel", "axes": {"engine": ["wiiide", {"label": "ddp-fp16", "engine": "ddp", "ddp_comm_hook": "fp16"},
                                              "fsdp"], "batch_size": [16, 32]}}
    spec = select_points(build_spec(raw, "sel.yaml"), ["engine=ddp-*,fsdp", "batch_size=32"])
    assert [(p.index, p.params["engine"], p.params["batch_size"]) for p in spec.points] == [(0, "ddp-fp16", 32),
                                                                                            (1, "fsdp", 32)]
    assert spec.points[0].config.ddp_comm_hook == "fp16" and "--only engine=ddp-*,fsdp" in spec.description
    for bad, why in ((["engine"], "AXIS=GLOB"), (["model=mlp"], "not an axis"), (["engine=ps*"], "matches none")):
        with pytest.raises(SpecError, match=why):
            select_points(build_spec(raw, "sel.yaml"), bad)
