"""harness.run.tc_exec: no exec of the harness runs in a container a fault has paused."""

from __future__ import annotations

import threading

import pytest

from harness.errors import LinkShapingError
from harness.run.compose_file import NUMBER_LABEL, SERVICE_LABEL
from harness.run.faults import ContainerController
from harness.run.tc_exec import ContainerExec


class _Container:
    """A docker SDK container's pause, unpause and exec_run, recording what ran."""

    def __init__(self, name: str) -> None:
        self.name, self.labels, self.calls = name, {SERVICE_LABEL: "worker", NUMBER_LABEL: "2"}, []
        self.status = "running"

    def reload(self) -> None:
        pass

    def pause(self) -> None:
        self.calls.append("pause")
        self.status = "paused"

    def unpause(self) -> None:
        self.calls.append("unpause")
        self.status = "running"

    def exec_run(self, argv, demux=True):
        self.calls.append(argv[0])
        return 0, (b"ok", b"")


def test_no_exec_while_a_fault_holds_the_container_paused():
    """An exec into a frozen container freezes its `runc init` too, and Docker 20.10's unpause then
    hung: between a pause and its resume the harness's execs (the link counter reads) are refused."""
    container = _Container("wiiide-stack_worker.2")
    controller, runner = ContainerController([container]), ContainerExec(container)
    assert runner.run(["tc"]) == "ok"
    controller.pause("worker-2")
    with pytest.raises(LinkShapingError, match="paused"):
        runner.run(["tc"])
    controller.resume("worker-2")
    assert runner.run(["tc"]) == "ok"
    assert container.calls == ["tc", "pause", "unpause", "tc"]


def test_a_pause_waits_for_an_exec_under_way():
    started, release = threading.Event(), threading.Event()

    class Slow(_Container):
        def exec_run(self, argv, demux=True):
            started.set()
            release.wait(5)
            return super().exec_run(argv, demux)

    container = Slow("wiiide-stack_worker.2")
    controller = ContainerController([container])
    worker = threading.Thread(target=ContainerExec(container).run, args=(["tc"],))
    worker.start()
    assert started.wait(5)
    pauser = threading.Thread(target=controller.pause, args=("worker-2",))
    pauser.start()
    pauser.join(0.2)
    assert pauser.is_alive() and container.calls == []  # the pause waits for the exec to finish
    release.set()
    worker.join(5)
    pauser.join(5)
    assert container.calls == ["tc", "pause"]
    controller.resume("worker-2")


def test_a_pause_left_by_an_ended_run_does_not_bar_a_new_container_of_that_name():
    """A run stopped before its fault's resume leaves the name marked paused; the next run's container
    of the same name (running) still gets its execs."""
    old = _Container("wiiide_worker_2")
    ContainerController([old]).pause("worker-2")  # no resume: the run ended
    new = _Container("wiiide_worker_2")
    assert ContainerExec(new).run(["tc"]) == "ok"
    assert ContainerExec(new).run(["tc"]) == "ok" and new.calls == ["tc", "tc"]
