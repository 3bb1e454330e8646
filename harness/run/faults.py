"""Fault injection during a run: kill, restart, pause or disconnect a node at a time after training
starts, through a backend's `Controller`, recording what was done and when.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from harness.errors import ClusterError
from harness.run.compose_file import NUMBER_LABEL, SERVICE_LABEL
from harness.run.tc_exec import set_container_paused
from harness.spec.faults import Fault

MARKER = "coordinator.training"


class Controller(Protocol):
    """What a backend offers the injector, by target name (``coordinator``, ``worker-N``)."""

    def kill(self, target: str) -> None:
        """SIGKILL the node. Raises ClusterError when there is no such node or it has exited."""
        ...

    def restart(self, target: str) -> None:
        """Start a killed node again with the same identity. Raises ClusterError if it still runs."""
        ...

    def pause(self, target: str) -> None:
        """Freeze the node (SIGSTOP / cgroup freezer) until `resume`. Raises ClusterError."""
        ...

    def resume(self, target: str) -> None:
        """Thaw a paused node. Raises ClusterError."""
        ...

    def disconnect(self, target: str) -> None:
        """Cut the node's link (its connections stay open) until `reconnect`. Raises ClusterError."""
        ...

    def reconnect(self, target: str) -> None:
        """Restore a cut link. Raises ClusterError."""
        ...

    def node_id(self, target: str) -> str:
        """The node id the target writes in its metrics file (to judge a run the fault hit)."""
        ...


class FaultInjector:
    """Runs `faults` against a `Controller` on a daemon thread, timed from the training marker."""

    def __init__(self, faults: list[Fault], controller: Controller, nodes_dir: Path, wait_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.faults = sorted(faults, key=lambda f: f.at_s)
        self.controller = controller
        self.marker = Path(nodes_dir) / MARKER
        self.wait_s = wait_s
        self.events: list[dict[str, Any]] = []
        # every target a fault hit: its own exit (killed, or gave up after a cut) is the fault's effect,
        # not a failure of the run; the coordinator's outcome decides (harness.run.backend.judge)
        self.affected: set[str] = set()
        self.affected_node_ids: set[str] = set()  # the same, as the node ids in their metrics files
        self._clock = clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="faults", daemon=True)

    def start(self) -> "FaultInjector":
        """Start the injector's thread (none when there are no faults); returns self."""
        if self.faults:
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop injecting (faults not yet due are dropped); waits up to 10 s for the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _record(self, t_s: float, action: str, target: str, error: str | None = None) -> None:
        self.events.append({"t_s": round(t_s, 3), "action": action, "target": target,
                            "ok": error is None, "error": error})

    def _run(self) -> None:
        deadline = self._clock() + self.wait_s
        while not self.marker.exists():
            if self._stop.wait(0.05) or self._clock() > deadline:
                self._record(0.0, "wait", "coordinator", f"training never started ({self.marker} absent)")
                return
        t0 = self._clock()
        plan: list[tuple[float, str, Fault]] = []
        for fault in self.faults:
            plan.append((fault.at_s, fault.action, fault))
            if fault.action == "pause":
                plan.append((fault.at_s + fault.duration_s, "resume", fault))
            elif fault.action == "disconnect":
                plan.append((fault.at_s + fault.duration_s, "reconnect", fault))
        plan.sort(key=lambda item: item[0])
        for at_s, action, fault in plan:
            if self._stop.wait(max(0.0, t0 + at_s - self._clock())):
                return
            # marked before the action: a killed node can be seen exited (by the run's poll, on another
            # thread) before the action returns, and its exit must already read as the fault's
            hit_before = fault.target in self.affected
            self.affected.add(fault.target)
            try:
                getattr(self.controller, action)(fault.target)
            except Exception as exc:  # a failed injection is recorded, never fatal to the run
                if not hit_before:
                    self.affected.discard(fault.target)
                self._record(self._clock() - t0, action, fault.target, f"{type(exc).__name__}: {exc}")
                continue
            try:
                self.affected_node_ids.add(self.controller.node_id(fault.target))
            except Exception:  # the node id only serves judging; a target without one is judged by name
                pass
            self._record(self._clock() - t0, action, fault.target)


class ContainerController:
    """Fault actions on Compose-labelled containers (a `Controller`), through the Engine API; used by
    the docker and swarm backends. Targets are ``coordinator`` and ``worker-N`` (N: the container
    number label).

    `disconnect` sets the target's eth0 down inside it (``ip link``, NET_ADMIN) and `reconnect` up
    again: the address and its connected route stay, so TCP connections survive a cut shorter than
    io_timeout_s and are declared lost after it. `on_action(action, target)`, if given, is called
    before each action (the docker backend marks reused containers as no longer clean).
    """

    def __init__(self, containers: list, on_action: Callable[[str, str], None] | None = None) -> None:
        self._by_target = {}
        self._on_action = on_action
        for c in containers:
            service = c.labels.get(SERVICE_LABEL)
            number = c.labels.get(NUMBER_LABEL, "1")
            self._by_target["coordinator" if service == "coordinator" else f"worker-{number}"] = c

    def _get(self, target: str, action: str | None = None):
        try:
            container = self._by_target[target]
        except KeyError:
            raise ClusterError(f"no container for {target}; have {sorted(self._by_target)}") from None
        if action is not None and self._on_action is not None:
            self._on_action(action, target)
        return container

    def kill(self, target: str) -> None:
        """SIGKILL the target's container."""
        self._get(target, "kill").kill()

    def restart(self, target: str) -> None:
        """Start the target's (killed) container again."""
        self._get(target, "restart").start()

    def pause(self, target: str) -> None:
        """Freeze the target's container (cgroup freezer); no exec of the harness runs in it until `resume`
        (`harness.run.tc_exec.exec_lock`)."""
        set_container_paused(self._get(target, "pause"), True)

    def resume(self, target: str) -> None:
        """Thaw the target's container."""
        set_container_paused(self._get(target, "resume"), False)

    def _link(self, target: str, state: str) -> None:
        code, out = self._get(target, f"link {state}").exec_run(["ip", "link", "set", "eth0", state])
        if code != 0:
            raise ClusterError(f"`ip link set eth0 {state}` in {target} failed ({code}): {out.decode(errors='replace')[:300]}")

    def node_id(self, target: str) -> str:
        """The target's node id: its container's hostname."""
        return self._get(target).attrs["Config"]["Hostname"]  # a worker's node id is its hostname

    def disconnect(self, target: str) -> None:
        """Set the target's eth0 down (ClusterError when `ip` fails)."""
        self._link(target, "down")

    def reconnect(self, target: str) -> None:
        """Set the target's eth0 up again (ClusterError when `ip` fails)."""
        self._link(target, "up")
