"""harness.run.faults.FaultInjector: a target counts as the fault's from the moment its action starts,
so a node that is seen exited before the kill call returns is already the fault's effect; a failed
action leaves the target unmarked."""

from __future__ import annotations

from harness.errors import ClusterError
from harness.run.faults import MARKER, FaultInjector
from harness.spec.faults import Fault


class _Controller:
    """Records, at each kill, which targets the injector had already marked; kills of worker-3 fail."""

    def __init__(self) -> None:
        self.injector: FaultInjector | None = None
        self.marked_at_kill: list[frozenset[str]] = []

    def kill(self, target: str) -> None:
        self.marked_at_kill.append(frozenset(self.injector.affected))
        if target == "worker-3":
            raise ClusterError("no container for worker-3")

    def node_id(self, target: str) -> str:
        return f"node-{target}"


def _run(tmp_path, faults: list[Fault]) -> tuple[FaultInjector, _Controller]:
    (tmp_path / MARKER).write_text("")
    controller = _Controller()
    injector = FaultInjector(faults, controller, tmp_path, wait_s=5)
    controller.injector = injector
    injector.start()
    injector._thread.join(timeout=10)
    assert not injector._thread.is_alive()
    return injector, controller


def test_a_killed_target_is_marked_before_the_kill_runs(tmp_path):
    injector, controller = _run(tmp_path, [Fault(action="kill", target="worker-2", at_s=0)])
    assert controller.marked_at_kill == [frozenset({"worker-2"})]
    assert injector.affected == {"worker-2"} and injector.affected_node_ids == {"node-worker-2"}
    assert [(e["action"], e["target"], e["ok"]) for e in injector.events] == [("kill", "worker-2", True)]


def test_a_failed_kill_leaves_its_target_unmarked(tmp_path):
    injector, controller = _run(tmp_path, [Fault(action="kill", target="worker-3", at_s=0),
                                           Fault(action="kill", target="worker-2", at_s=0)])
    assert injector.affected == {"worker-2"} and injector.affected_node_ids == {"node-worker-2"}
    failed = [e for e in injector.events if not e["ok"]]
    assert [(e["target"], e["error"]) for e in failed] == [("worker-3", "ClusterError: no container for worker-3")]
