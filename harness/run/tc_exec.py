"""Running tc inside containers: a thin runner of argv lists that raises `TcCommandError` with the
command and tc's own message, applying a `ShapingPlan`, reading back what is in force, and probing which
qdiscs the kernel has in a throwaway container.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import threading
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Mapping

from harness.errors import LinkShapingError
from harness.links.plan import Capabilities, ShapingPlan
from harness.links.readback import parse_classes, parse_tc_json, show_commands
from harness.links.delayline import check_argv, parse_stats, runs_in_background, stats_command, stats_file
from harness.links.fallback import CHAIN, TEE_GATEWAY, parse_rule_counters, rule_counters_command, rule_reset_commands
from harness.links.tc import ingress_commands, reset_commands


class TcCommandError(LinkShapingError):
    """A command run in a container failed: `argv`, `exit_code` and the tool's own `tool_message`."""

    def __init__(self, message: str, argv: list[str], exit_code: int | None, tool_message: str) -> None:
        super().__init__(message)
        self.argv, self.exit_code, self.tool_message = argv, exit_code, tool_message


# Containers a fault has frozen (docker pause), by name, and one lock per container name that an exec and
# a pause or unpause take in turn. An exec into a paused container starts a `runc init` inside the frozen
# cgroup, which freezes too; Docker 20.10's unpause then waited on it, and the container stayed paused
# for good (seen in the swarm test: the link counter sampler's exec landed in a 1 s pause).
_PAUSED: set[str] = set()
_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


@contextmanager
def exec_lock(name: str) -> Iterator[None]:
    """Hold the lock of container `name`: `ContainerExec.run` takes it around each exec, and a fault's
    pause and resume around theirs (`set_paused`), so neither starts while the other is under way."""
    with _LOCKS_GUARD:
        lock = _LOCKS.setdefault(name, threading.Lock())
    with lock:
        yield


def set_paused(name: str, paused: bool) -> None:
    """Record that container `name` is frozen (True, after a pause) or not (after an unpause); call it
    under `exec_lock(name)`. `ContainerExec.run` refuses to exec into a paused container."""
    if paused:
        _PAUSED.add(name)
    else:
        _PAUSED.discard(name)


def set_container_paused(container, paused: bool) -> None:
    """Pause (freeze) or unpause a container (a docker SDK Container) under its `exec_lock`, and record it
    (`set_paused`), so no exec of the harness starts in it while it is frozen.

    Raises:
        docker.errors.APIError: from the engine (the container is gone, or already in that state).
    """
    with exec_lock(container.name):
        if paused:
            container.pause()
        else:
            container.unpause()
        set_paused(container.name, paused)


def _still_paused(container) -> bool:
    """Whether a container marked paused is so in the engine: a run that ended before its fault's resume
    leaves the mark, and a new container of the same name must not inherit it (the mark is dropped)."""
    try:
        container.reload()
        paused = container.status == "paused"
    except Exception:  # docker.errors.NotFound and friends: gone, so not paused
        paused = False
    if not paused:
        _PAUSED.discard(getattr(container, "name", "container"))
    return paused


class ContainerExec:
    """Runs argv lists in a running container through the Engine API (``exec_run``, no shell).

    `container` is a docker SDK container (or anything with ``name`` and ``exec_run(argv, demux=True)``).
    """

    def __init__(self, container) -> None:
        self.container = container

    def run(self, argv: Iterable[str]) -> str:
        """Run `argv`; return its stdout.

        Raises:
            LinkShapingError: with the container, the command and tc's own message, when it exits
            non-zero or the container cannot run it (e.g. it has exited, or a fault paused it).
        """
        argv = list(argv)
        where = getattr(self.container, "name", "container")
        with exec_lock(where):
            if where in _PAUSED and _still_paused(self.container):  # see _PAUSED: an exec would freeze
                raise TcCommandError(f"{where}: `{shlex.join(argv)}` not run: the container is paused", argv, None,
                                     "paused")
            try:
                code, output = self.container.exec_run(argv, demux=True)
            except Exception as exc:  # docker.errors.APIError and friends: the container is not running
                raise TcCommandError(f"{where}: `{shlex.join(argv)}` could not run: {exc}", argv, None,
                                     str(exc)) from None
        out, err = output if isinstance(output, tuple) else (output, b"")
        return _checked_stdout(where, argv, code, out, err)

    def start(self, argv: Iterable[str]) -> None:
        """Start `argv` detached (an exec that goes on as its own process, e.g. the delay line); its
        readiness is the next command's to check.

        Raises:
            LinkShapingError: the container cannot run it (it has exited, or a fault paused it).
        """
        argv = list(argv)
        where = getattr(self.container, "name", "container")
        with exec_lock(where):
            if where in _PAUSED and _still_paused(self.container):
                raise TcCommandError(f"{where}: `{shlex.join(argv)}` not started: the container is paused", argv,
                                     None, "paused")
            try:
                self.container.exec_run(argv, detach=True)
            except Exception as exc:  # docker.errors.APIError and friends
                raise TcCommandError(f"{where}: `{shlex.join(argv)}` could not start: {exc}", argv, None,
                                     str(exc)) from None

    def container_path(self, path: str) -> str:
        """A path inside the container as this runner's commands see it: the same path."""
        return path


def _checked_stdout(where: str, argv: list[str], code: int | None, out: bytes | None, err: bytes | None) -> str:
    """A finished command's stdout, decoded; raises `TcCommandError` with the tool's own message (its
    stderr, else its stdout) when it exited non-zero."""
    stdout = (out or b"").decode(errors="replace")
    if code != 0:
        message = (err or b"").decode(errors="replace").strip() or stdout.strip() or "no message"
        raise TcCommandError(f"{where}: `{shlex.join(argv)}` failed (exit {code}): {message}", argv, code, message)
    return stdout


NETNS_TIMEOUT_S = 10.0  # one tc read-back in a container's network namespace from the host


class HostNetnsExec:
    """Runs argv lists (tc's read-backs) on the harness's host inside a container's network namespace
    (``nsenter --net=/proc/PID/ns/net``): a fork and an exec on the host, where an Engine API exec
    (`ContainerExec`) goes through dockerd, containerd, a shim and runc. The link counters are read
    this way every `harness.run.shaping.COUNTER_INTERVAL_S` seconds in every shaped container; by exec
    that took about a quarter of a 2-core machine during runs of 1+8 containers (docs/getting-started.md, "The
    harness's own cost per run"; CHANGELOG.md).

    Made by `host_netns_runner`, which checks that it can be used. The namespace is the one the
    container's first process had when this was made (its inode): once that process is gone, or its
    PID belongs to another namespace, `run` raises instead of reading another namespace's qdiscs.
    """

    def __init__(self, name: str, pid: int, netns_inode: int) -> None:
        self.name, self.pid, self.netns_inode = name, pid, netns_inode

    def run(self, argv: Iterable[str]) -> str:
        """Run `argv` in the container's network namespace; return its stdout.

        Raises:
            LinkShapingError (`TcCommandError`): the container's process is gone or in another
            namespace, or the command failed or did not end within `NETNS_TIMEOUT_S`.
        """
        argv = list(argv)
        path = f"/proc/{self.pid}/ns/net"
        try:
            same = os.stat(path).st_ino == self.netns_inode
        except OSError:
            same = False
        if not same:
            raise TcCommandError(f"{self.name}: `{shlex.join(argv)}` not run: its process {self.pid} is gone",
                                 argv, None, "gone")
        try:
            done = subprocess.run(["nsenter", f"--net={path}", "--", *argv], capture_output=True,
                                  timeout=NETNS_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise TcCommandError(f"{self.name}: `{shlex.join(argv)}` could not run: {exc}", argv, None,
                                 str(exc)) from None
        return _checked_stdout(self.name, argv, done.returncode, done.stdout, done.stderr)

    def container_path(self, path: str) -> str:
        """A path inside the container as seen from the host: through its first process's root."""
        return f"/proc/{self.pid}/root{path}"


def host_netns_runner(container, local_engine: bool) -> HostNetnsExec | None:
    """A `HostNetnsExec` for `container` (a docker SDK container, reloaded) when the harness can enter its
    network namespace: the engine runs on this host (`local_engine`), the harness is root, ``nsenter``
    and ``tc`` are on its PATH and the container's first process is visible here. None otherwise (a
    remote engine, a rootless run): the caller keeps `ContainerExec`. Raises nothing."""
    pid = ((getattr(container, "attrs", None) or {}).get("State") or {}).get("Pid")
    if (not local_engine or not isinstance(pid, int) or pid <= 0 or os.geteuid() != 0
            or shutil.which("nsenter") is None or shutil.which("tc") is None):
        return None
    try:
        inode = os.stat(f"/proc/{pid}/ns/net").st_ino
        if inode == os.stat("/proc/self/ns/net").st_ino:
            return None  # host networking: the harness's own namespace, nothing to enter
    except OSError:
        return None
    return HostNetnsExec(getattr(container, "name", "container"), pid, inode)


def reset_links(runner: ContainerExec) -> None:
    """Remove any shaping from the container's interface (`harness.links.tc.reset_commands`): nothing
    there is fine. Makes shaping a reused container idempotent: its qdiscs live in its network
    namespace and outlive the run that made them. Raises nothing."""
    for argv in [*reset_commands(), *rule_reset_commands()]:
        try:
            runner.run(argv)
        except LinkShapingError:
            pass  # nothing to remove, or the container has gone (the shaping that follows says so)


# `tc class show` read empty on a device whose htb qdisc has a class: an exec whose output the engine lost
# (seen on Docker 20.10 with 9 and 13 containers on 2 cores: some workers' rate read back as "-")
CLASS_SHOW_RETRIES = 2


def read_back(runner: ContainerExec, devices: Iterable[str]) -> dict[str, list[dict[str, Any]]]:
    """What tc has in force on each of `devices` in the container: ``{dev: [qdiscs..., classes...]}``,
    read with ``tc -j -s qdisc show`` and ``tc -j -s class show`` (records: `harness.links.readback`;
    rates in bit/s, sizes in bytes, times in ms, counters since the qdisc was made).

    Raises:
        LinkShapingError: a show command failed (the device is gone, the container has exited) or
        printed something that is not tc's read-back.
    """
    records: dict[str, list[dict[str, Any]]] = {}
    for dev in devices:
        commands = show_commands(dev)
        qdiscs = parse_tc_json(runner.run(commands["qdisc"]), "qdisc", dev)
        classes = parse_classes(runner.run(commands["class"]), dev)
        for _ in range(CLASS_SHOW_RETRIES):  # an htb qdisc always has its class: an empty read lost its output
            if classes or not any(q.get("kind") == "htb" for q in qdiscs):
                break
            classes = parse_classes(runner.run(commands["class"]), dev)
        records[dev] = [*qdiscs, *classes]
    return records


def read_fallback_counters(runner: ContainerExec, chain: str | None = CHAIN, dup_chain: str | None = None) -> dict[str, Any]:
    """The fallback's own loss count in the container (`harness.links.fallback.parse_rule_counters`:
    ``seen_packets``, ``dropped_packets``, ``loss_pct``), read from its iptables chain `chain`; with
    `dup_chain` (the duplicate rules were installed), its ``duplicate`` record too (``seen_packets``,
    ``duplicated_packets``, ``duplicate_pct``); `chain` None: the duplicate chain alone was installed.

    Raises:
        LinkShapingError: the listing failed (no chain, no iptables, the container has exited) or a
        counter was not a number.
    """
    try:
        out = parse_rule_counters(runner.run(rule_counters_command(chain))) if chain else {}
        if dup_chain is not None:
            dup = parse_rule_counters(runner.run(rule_counters_command(dup_chain)))
            out["duplicate"] = {k: dup.get(k) for k in ("seen_packets", "duplicated_packets", "duplicate_pct")}
        return out
    except ValueError as exc:
        raise LinkShapingError(f"cannot read the fallback's counters: {exc}") from None


def read_delay_line_stats(runner: ContainerExec | HostNetnsExec, queue_num: int = 0) -> dict[str, Any]:
    """The delay line's own account in the container (`harness.links.delayline.parse_stats`: packets,
    lateness in microseconds, ``cpu_s``), read from its stats file.

    Raises:
        LinkShapingError: no stats file (never started, or the container has exited) or not its stats.
    """
    text = runner.run(stats_command(runner.container_path(stats_file(queue_num))))
    try:
        return parse_stats(text)
    except ValueError as exc:
        raise LinkShapingError(f"cannot read the delay line's stats: {exc}") from None


def apply_plan(runner: ContainerExec, plan: ShapingPlan) -> dict[str, list[dict[str, Any]]]:
    """Run the plan's commands in order in the container, then read back every shaped device
    (`read_back`: ``{dev: [records]}``, rates in bit/s, sizes in bytes, times in ms). The delay line's
    own run is started detached (`harness.links.delayline.runs_in_background`); the plan's next command
    waits until it is bound.

    Raises:
        LinkShapingError: at the first command that fails (with the command and tc's message), or
        when the read-back fails.
    """
    for argv in plan.commands:
        if runs_in_background(argv):
            runner.start(argv)
        else:
            runner.run(argv)
    return read_back(runner, plan.devices)


PROBE_DEV = "lo"  # the probe container has no network: only its own loopback


PROBE_IFB = "ifbprobe"


PROBE_CHAIN = "WIIIIIDE-PROBE"


PROBES: dict[str, list[list[str]]] = {
    "netem": [["tc", "qdisc", "add", "dev", PROBE_DEV, "root", "handle", "1:", "netem", "delay", "1ms"]],
    "tbf": [["tc", "qdisc", "add", "dev", PROBE_DEV, "root", "handle", "1:", "tbf", "rate", "1mbit",
             "burst", "16kb", "limit", "32kb"]],
    "htb": [["tc", "qdisc", "add", "dev", PROBE_DEV, "root", "handle", "1:", "htb", "default", "1"],
            ["tc", "class", "add", "dev", PROBE_DEV, "parent", "1:", "classid", "1:1", "htb", "rate", "1mbit"]],
    "ifb": ingress_commands(PROBE_DEV, PROBE_IFB),
    # the fallback's loss (harness.links.fallback): iptables in the image and the statistic match in the kernel
    "statistic": [["iptables", "-w", "-t", "mangle", "-N", PROBE_CHAIN],
                  ["iptables", "-w", "-t", "mangle", "-A", PROBE_CHAIN, "-m", "statistic", "--mode", "random",
                   "--probability", "0.5", "-j", "DROP"]],
    # the fallback's delay (harness.links.delayline): the NFQUEUE target, and a consumer that binds a queue
    "nfqueue": [["iptables", "-w", "-t", "mangle", "-N", PROBE_CHAIN],
                ["iptables", "-w", "-t", "mangle", "-A", PROBE_CHAIN, "-j", "NFQUEUE", "--queue-num", "0",
                 "--queue-bypass"], check_argv(0)],
    # the fallback's duplicate (harness.links.fallback): the TEE target (xt_TEE) in the mangle table
    "tee": [["iptables", "-w", "-t", "mangle", "-N", PROBE_CHAIN],
            ["iptables", "-w", "-t", "mangle", "-A", PROBE_CHAIN, "-j", "TEE", "--gateway", TEE_GATEWAY]],
}


PROBE_CLEANUP = [["tc", "qdisc", "del", "dev", PROBE_DEV, "root"], ["tc", "qdisc", "del", "dev", PROBE_DEV, "ingress"],
                 ["ip", "link", "del", PROBE_IFB], ["iptables", "-w", "-t", "mangle", "-F", PROBE_CHAIN],
                 ["iptables", "-w", "-t", "mangle", "-X", PROBE_CHAIN]]


def probe_with(runner: ContainerExec) -> Capabilities:
    """Try each qdisc kind (`PROBES`) on the container's loopback; a kind is present when all its
    commands work, and tc's message is kept for each missing one. Everything tried is removed again.
    Raises nothing: a container that cannot run commands shows as a kernel without any, with the reason
    in `Capabilities.errors`.
    """
    found: dict[str, bool] = {}
    errors: dict[str, str] = {}
    for kind, commands in PROBES.items():
        try:
            for argv in commands:
                runner.run(argv)
            found[kind] = True
        except TcCommandError as exc:
            found[kind] = False
            errors[kind] = exc.tool_message
        for argv in PROBE_CLEANUP:
            try:
                runner.run(argv)
            except TcCommandError:
                pass  # nothing of that kind was left to remove
    return Capabilities(errors=errors, **found)


_probe_cache: dict[str, Capabilities] = {}


def probe_capabilities(client, image: str, labels: Mapping[str, str] | None = None) -> Capabilities:
    """What this kernel has, tried in a throwaway container of `image` (NET_ADMIN, no network); cached
    per image id for the life of the process (once per sweep).

    Raises:
        LinkShapingError: the probe container cannot be started.
    """
    try:
        image_id = client.images.get(image).id
    except Exception as exc:
        raise LinkShapingError(f"cannot probe the kernel's qdiscs: image {image} not found: {exc}") from None
    if image_id in _probe_cache:
        return _probe_cache[image_id]
    try:
        container = client.containers.run(image, ["sleep", "120"], detach=True, cap_add=["NET_ADMIN"],
                                          network_mode="none", labels=dict(labels or {}))
    except Exception as exc:
        raise LinkShapingError(f"cannot start a probe container of {image}: {exc}") from None
    try:
        caps = probe_with(ContainerExec(container))
    finally:
        container.remove(force=True)
    _probe_cache[image_id] = caps
    return caps
