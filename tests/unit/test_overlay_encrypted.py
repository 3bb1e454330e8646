"""``overlay_encrypted``: from the sweep spec to the swarm stack's network, and refused where there is
no overlay. No engine needed (the stack loader check uses the docker CLI only, client side)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml

from harness.errors import ClusterError, SpecError
from harness.run.backend import refuse_cluster_settings
from harness.run.swarm.encryption import (
    EncryptionRules,
    delete_argv,
    encrypted_vnis,
    remove_rules_for,
    rules_for_vnis,
    vxlan_rules,
)
from harness.run.swarm.stack import stack_override, write_stack_files
from harness.spec.cluster import ClusterSettings
from harness.spec.points import build_spec


def network_of(folder) -> dict:
    """The project network as the generated ``stack-override.yaml`` declares it."""
    override = yaml.safe_load((folder / "stack-override.yaml").read_text())
    (network,) = override["networks"].values()
    return network


def test_axis_on_and_off_reaches_the_stack_file(tmp_path):
    spec = build_spec({"name": "o", "base": {"num_workers": 2}, "axes": {"overlay_encrypted": [False, True]}}, "o.yaml")
    plain, encrypted = spec.points
    assert (plain.params, encrypted.params) == ({"overlay_encrypted": False}, {"overlay_encrypted": True})
    assert "overlay_encrypted" not in plain.cluster.to_dict()  # reports stay as before the key
    assert encrypted.cluster.to_dict()["overlay_encrypted"] is True
    # nothing to set up inside the containers: no start gate, no tc probe
    assert plain.cluster.is_empty and encrypted.cluster.is_empty
    for point in spec.points:
        write_stack_files(tmp_path / str(point.index), 2, encrypted=point.cluster.overlay_encrypted)
    assert network_of(tmp_path / "0") == {"driver": "overlay", "internal": True}
    assert network_of(tmp_path / "1") == {"driver": "overlay", "internal": True, "driver_opts": {"encrypted": ""}}


def test_default_is_a_plain_overlay():
    assert ClusterSettings().overlay_encrypted is False
    assert "driver_opts" not in stack_override(2, "wiiide")["networks"]["wiiide"]
    assert stack_override(2, "wiiide", encrypted=True)["networks"]["wiiide"]["driver_opts"] == {"encrypted": ""}


@pytest.mark.parametrize("value", ["yes", 1, "true", None, [True]])
def test_only_a_boolean_is_accepted(value):
    with pytest.raises(SpecError, match=r"o\.yaml: .*overlay_encrypted"):
        build_spec({"name": "o", "base": {"overlay_encrypted": value}}, "o.yaml")


def test_backends_without_an_overlay_refuse_it():
    with pytest.raises(ClusterError, match="overlay_encrypted: true needs the swarm backend"):
        refuse_cluster_settings("local", ClusterSettings(overlay_encrypted=True))
    refuse_cluster_settings("local", ClusterSettings(overlay_encrypted=False))  # nothing asked: passes


@pytest.mark.skipif(shutil.which("docker") is None, reason="the docker CLI is not installed")
def test_encrypted_option_passes_the_stack_loader(tmp_path):
    """`docker stack config` (client side) keeps ``driver_opts.encrypted`` in the merged stack."""
    files = write_stack_files(tmp_path, 2, encrypted=True)
    env = {**os.environ, "WIIIIIDE_IMAGE": "img:1", "WIIIIIDE_RESULTS_DIR": "/r", "WIIIIIDE_SECRET_FILE_HOST": "/s"}
    out = subprocess.run(["docker", "stack", "config", *(x for f in files for x in ("-c", str(f)))],
                         capture_output=True, text=True, env=env, timeout=60)
    if "unknown command" in out.stderr or "is not a docker command" in out.stderr:
        pytest.skip(f"this docker CLI has no `stack config`: {out.stderr.strip()[:100]}")
    assert out.returncode == 0, out.stderr
    network = yaml.safe_load(out.stdout)["networks"]["wiiide"]
    assert network["driver"] == "overlay" and network["driver_opts"] == {"encrypted": ""}


# ---- the iptables rules libnetwork leaves behind on Engine < 24 (as iptables-save printed them here)
SAVED_BEFORE = """*mangle
:OUTPUT ACCEPT [0:0]
-A OUTPUT -p udp -m udp --dport 53 -j ACCEPT
COMMIT
*filter
:INPUT ACCEPT [0:0]
-A INPUT -p tcp -m tcp --dport 4789 -j ACCEPT
COMMIT
"""
ENCRYPTED_RULES = (
    ("mangle", '-A OUTPUT -p udp -m udp --dport 4789 -m u32 --u32 "0x0>>0x16&0x3c@0xc&0xffffff00=0x100200" '
               "-j MARK --set-xmark 0xd0c4e3/0xffffffff"),
    ("filter", "-A INPUT -p udp -m policy --dir in --pol none -m udp --dport 4789 -m u32 --u32 "
               '"0x0>>0x16&0x3c@0xc&0xffffff00=0x100200" -j DROP'),
)


def saved_after() -> str:
    mangle, filt = (line for _, line in ENCRYPTED_RULES)
    return SAVED_BEFORE.replace("COMMIT\n*filter", f"{mangle}\nCOMMIT\n*filter").replace(
        "--dport 4789 -j ACCEPT\n", f"--dport 4789 -j ACCEPT\n{filt}\n")


def test_only_rules_that_appeared_are_deleted_with_their_own_quoting():
    outputs = iter([SAVED_BEFORE, saved_after()])
    ran: list[list[str]] = []
    rules = EncryptionRules(save=lambda: next(outputs), run=lambda argv: (ran.append(argv), (0, ""))[1])
    rules.snapshot()
    assert sorted(rules.cleanup(print)) == sorted(ENCRYPTED_RULES)
    assert sorted(ran) == sorted([
        ["iptables", "-t", "mangle", "-D", "OUTPUT", "-p", "udp", "-m", "udp", "--dport", "4789", "-m", "u32", "--u32",
         "0x0>>0x16&0x3c@0xc&0xffffff00=0x100200", "-j", "MARK", "--set-xmark", "0xd0c4e3/0xffffffff"],
        ["iptables", "-t", "filter", "-D", "INPUT", "-p", "udp", "-m", "policy", "--dir", "in", "--pol", "none", "-m",
         "udp", "--dport", "4789", "-m", "u32", "--u32", "0x0>>0x16&0x3c@0xc&0xffffff00=0x100200", "-j", "DROP"]])
    # the tcp rule on 4789 that was there before the run is left alone
    assert ("filter", "-A INPUT -p tcp -m tcp --dport 4789 -j ACCEPT") in vxlan_rules(SAVED_BEFORE)


def test_unreadable_iptables_is_reported_not_raised():
    def fail() -> str:
        raise OSError("iptables-save: not found")

    lines: list[str] = []
    rules = EncryptionRules(save=fail, run=lambda argv: (1, "unused"))
    rules.snapshot()
    assert rules.cleanup(lines.append) == []
    assert "iptables-save: not found" in lines[0] and "4789" in lines[0]


def test_a_failed_delete_names_the_rule():
    outputs = iter([SAVED_BEFORE, saved_after()])
    lines: list[str] = []
    rules = EncryptionRules(save=lambda: next(outputs), run=lambda argv: (1, "iptables: Bad rule"))
    rules.snapshot()
    rules.cleanup(lines.append)
    assert "deleting 2 iptables rules on UDP 4789" in lines[0]
    assert len(lines[1:]) == 2 and all("Bad rule" in line and "4789" in line for line in lines[1:])


def test_delete_argv_refuses_what_is_not_an_appended_rule():
    with pytest.raises(ValueError, match="not an appended iptables rule"):
        delete_argv(("filter", ":INPUT ACCEPT [0:0]"))


def test_rules_of_a_removed_encrypted_network_are_found_by_its_vni():
    attrs = {"Driver": "overlay", "Options": {"com.docker.network.driver.overlay.vxlanid_list": "4098",
                                              "encrypted": ""}}
    assert encrypted_vnis(attrs) == [4098]  # 4098 << 8 = 0x100200, the VNI of ENCRYPTED_RULES
    assert encrypted_vnis({"Driver": "overlay", "Options": {"com.docker.network.driver.overlay.vxlanid_list": "4097"}}) == []
    assert encrypted_vnis({"Driver": "bridge", "Options": {"encrypted": ""}}) == []
    rules = vxlan_rules(saved_after())
    assert rules_for_vnis(rules, [4098]) == sorted(ENCRYPTED_RULES)
    assert rules_for_vnis(rules, [4097]) == []  # another network's VNI: left alone
    ran: list[list[str]] = []
    removed = remove_rules_for([4098], print, save=saved_after, run=lambda argv: (ran.append(argv), (0, ""))[1])
    assert removed == sorted(ENCRYPTED_RULES) and [argv[:5] for argv in sorted(ran)] == [
        ["iptables", "-t", "filter", "-D", "INPUT"], ["iptables", "-t", "mangle", "-D", "OUTPUT"]]
    assert remove_rules_for([], print, save=lambda: 1 / 0) == []  # no encrypted network: iptables not read
