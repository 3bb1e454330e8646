"""The host iptables rules an encrypted overlay leaves behind, and removing them.

For each encrypted overlay network, libnetwork (``drivers/overlay/encryption.go``, ``programMangle`` and
``programInput``) adds rules on VXLAN's UDP port 4789 matching the network's VNI with ``-m u32``: in
``mangle OUTPUT`` a MARK that sends the VXLAN packets to the IPsec policy, and in ``filter INPUT`` a DROP of
VXLAN packets of that VNI that did not come through IPsec (and, before Engine 24, an ACCEPT of those that
did). Before moby/moby#45343 (Engine 24) deleting the network did not remove them: on Engine 20.10 they
stay after the network, the stack and the swarm are gone. `EncryptionRules` notes the port-4789 rules
before a run and deletes, after it, exactly those that appeared meanwhile, so the host is left as found.
Only possible where the harness runs as root on the engine's own host; elsewhere it says which to delete.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from typing import Callable

VXLAN_PORT_MATCH = "--dport 4789"  # libnetwork's VXLAN port (overlayutils.VXLANUDPPort, default 4789)
_VNI_MATCH = re.compile(r"&0xffffff00=0x([0-9a-fA-F]+)\b")  # libnetwork's u32 match on the VXLAN header's VNI
Rule = tuple[str, str]  # (table, the rule as iptables-save prints it: "-A CHAIN ...")


def vxlan_rules(save_text: str) -> set[Rule]:
    """The rules on VXLAN's port in an ``iptables-save`` output, with their table. Pure."""
    rules, table = set(), ""
    for line in save_text.splitlines():
        if line.startswith("*"):
            table = line[1:].strip()
        elif line.startswith("-A ") and VXLAN_PORT_MATCH in line:
            rules.add((table, line.strip()))
    return rules


def delete_argv(rule: Rule) -> list[str]:
    """The ``iptables -t TABLE -D CHAIN ...`` argv that deletes `rule` (iptables-save's own quoting). Pure.

    Raises:
        ValueError: `rule` is not an ``-A CHAIN ...`` line (or its quoting is broken).
    """
    table, line = rule
    words = shlex.split(line)
    if len(words) < 2 or words[0] != "-A":
        raise ValueError(f"not an appended iptables rule: {line!r}")
    return ["iptables", "-t", table, "-D", *words[1:]]


VXLAN_IDS_OPTION = "com.docker.network.driver.overlay.vxlanid_list"  # a network's VNIs, comma-separated


def encrypted_vnis(network_attrs: dict) -> list[int]:
    """The VNIs of an encrypted overlay network (``docker network inspect``'s attrs); [] for any other. Pure."""
    options = network_attrs.get("Options") or {}
    if network_attrs.get("Driver") != "overlay" or "encrypted" not in options:
        return []
    return [int(v) for v in str(options.get(VXLAN_IDS_OPTION) or "").split(",") if v.strip().isdigit()]


def rules_for_vnis(rules: set[Rule], vnis: list[int]) -> list[Rule]:
    """The rules of `rules` whose ``-m u32`` match is libnetwork's for one of `vnis`: the VNI shifted
    left by 8 under the mask 0xffffff00 (iptables-save prints ``...&0xffffff00=0x100100`` for VNI 4097). Pure."""
    wanted = set(vnis)
    found = []
    for rule in rules:
        match = _VNI_MATCH.search(rule[1])
        if match and int(match.group(1), 16) >> 8 in wanted:
            found.append(rule)
    return sorted(found)


def remove_rules_for(vnis: list[int], progress: Callable[[str], None],
                     save: Callable[[], str] | None = None,
                     run: Callable[[list[str]], tuple[int, str]] | None = None) -> list[Rule]:
    """Delete the port-4789 rules libnetwork made for the encrypted overlays of `vnis` (after those
    networks were removed); return them. Failures are reported through `progress`, never raised."""
    if not vnis:
        return []
    try:
        found = rules_for_vnis(vxlan_rules((save or _save)()), vnis)
    except OSError as exc:
        progress(f"    swarm: cannot read iptables ({exc}); the encrypted overlay (VNI {vnis}) may have left rules "
                 "on UDP 4789 (`iptables-save | grep 4789`) to delete by hand")
        return []
    _delete(found, run or _run, progress)
    return found


def _delete(rules: list[Rule], run: Callable[[list[str]], tuple[int, str]], progress: Callable[[str], None]) -> None:
    if rules:
        progress(f"    swarm: deleting {len(rules)} iptables rules on UDP 4789 the encrypted overlay left (moby#45343)")
    for rule in rules:
        code, message = run(delete_argv(rule))
        if code != 0:
            progress(f"    swarm: could not delete the encrypted overlay's rule `{rule[1]}` (table {rule[0]}): {message}")


def _save() -> str:
    out = subprocess.run(["iptables-save"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise OSError(f"iptables-save exit {out.returncode}: {out.stderr.strip()[:200]}")
    return out.stdout


class EncryptionRules:
    """`snapshot` before an encrypted overlay is created, `cleanup` after it was removed.

    `save`: returns ``iptables-save``'s output (raises OSError when it cannot run: not root, no
    iptables, another host's engine). `run`: runs one argv, returns (exit code, message).
    """

    def __init__(self, save: Callable[[], str] = _save,
                 run: Callable[[list[str]], tuple[int, str]] | None = None) -> None:
        self._save = save
        self._run = run or _run
        self.before: set[Rule] | None = None
        self.error = ""

    def snapshot(self) -> None:
        """Note the port-4789 rules now (once; later calls keep the first snapshot). Never raises."""
        if self.before is not None:
            return
        try:
            self.before = vxlan_rules(self._save())
        except OSError as exc:
            self.error = str(exc)

    def cleanup(self, progress: Callable[[str], None]) -> list[Rule]:
        """Delete the port-4789 rules that appeared since `snapshot`; return them. What cannot be
        read or deleted is reported through `progress` with the rule, never raised."""
        if self.before is None:
            if self.error:
                progress(f"    swarm: cannot read iptables ({self.error}); an encrypted overlay on Engine < 24 leaves "
                         "rules on UDP 4789 (`iptables-save | grep 4789`) to delete by hand")
            return []
        try:
            added = sorted(vxlan_rules(self._save()) - self.before)
        except OSError as exc:
            progress(f"    swarm: cannot read iptables after the run ({exc}); check `iptables-save | grep 4789`")
            return []
        _delete(added, self._run, progress)
        self.before = None
        return added


def _run(argv: list[str]) -> tuple[int, str]:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except OSError as exc:
        return 1, str(exc)
    return out.returncode, out.stderr.strip()
