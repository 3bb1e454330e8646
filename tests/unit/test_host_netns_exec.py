"""harness.run.tc_exec.HostNetnsExec: tc's read-backs run from the host in a container's network namespace
(no Engine API exec), and the checks that keep it from reading another namespace."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from harness.errors import LinkShapingError
from harness.run import shaping
from harness.run.tc_exec import HostNetnsExec, TcCommandError, host_netns_runner

needs_root_nsenter = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("nsenter") is None,
                                        reason="nsenter into a namespace needs root and util-linux's nsenter")


def _container(pid: int, base_url: str = "http+docker://localhost", name: str = "c1"):
    return SimpleNamespace(name=name, attrs={"State": {"Pid": pid}},
                           client=SimpleNamespace(api=SimpleNamespace(base_url=base_url)))


@pytest.fixture()
def other_netns_pid():
    """A process in a network namespace of its own (``unshare --net``), as a container's first process."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a new network namespace needs root and util-linux's unshare")
    proc = subprocess.Popen(["unshare", "--net", "--", sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for _ in range(100):  # until unshare has exec'd into the namespace
            if os.stat(f"/proc/{proc.pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino:
                break
            time.sleep(0.02)
        yield proc
    finally:
        proc.kill()
        proc.wait()


@needs_root_nsenter
def test_it_reads_the_containers_namespace_and_stops_once_its_process_is_gone(other_netns_pid):
    runner = host_netns_runner(_container(other_netns_pid.pid), local_engine=True)
    assert isinstance(runner, HostNetnsExec)
    # the new namespace has only its loopback: what `ip` lists there is not the host's interfaces
    assert [line.split(":")[1].strip() for line in runner.run(["ip", "-o", "link", "show"]).splitlines()] == ["lo"]
    with pytest.raises(TcCommandError) as failed:
        runner.run(["tc", "-j", "-s", "qdisc", "show", "dev", "eth9"])  # no such device there
    assert failed.value.exit_code not in (None, 0) and "eth9" in str(failed.value.argv)
    other_netns_pid.kill()
    other_netns_pid.wait()
    with pytest.raises(LinkShapingError, match="is gone"):
        runner.run(["ip", "-o", "link", "show"])


def test_a_pid_now_in_another_namespace_is_refused_before_anything_runs():
    runner = HostNetnsExec("c1", os.getpid(), netns_inode=os.stat("/proc/self/ns/net").st_ino + 1)
    with pytest.raises(TcCommandError, match="is gone"):
        runner.run(["ip", "-o", "link", "show"])


def test_no_runner_for_a_remote_engine_host_networking_or_an_unknown_pid():
    assert host_netns_runner(_container(os.getpid()), local_engine=False) is None
    assert host_netns_runner(_container(os.getpid()), local_engine=True) is None  # the harness's own namespace
    assert host_netns_runner(_container(0), local_engine=True) is None
    assert host_netns_runner(SimpleNamespace(name="c", attrs={}), local_engine=True) is None
    assert shaping._engine_is_local(_container(1))
    assert not shaping._engine_is_local(_container(1, base_url="ssh://me@node2"))
    assert not shaping._engine_is_local(_container(1, base_url="https://10.0.0.2:2376"))


def test_the_host_reader_is_kept_only_when_it_reads_what_the_exec_read(monkeypatch):
    applied = {"eth0": [{"type": "qdisc", "kind": "htb", "handle": "1:", "parent": "root", "sent_bytes": 0},
                        {"type": "class", "kind": "htb", "handle": "1:1", "parent": "root", "sent_bytes": 0}]}
    later = {"eth0": [dict(r, sent_bytes=5000) for r in applied["eth0"]]}  # counters move, the shape does not
    runner = HostNetnsExec("c1", 1, 1)
    monkeypatch.setattr(shaping, "host_netns_runner", lambda c, local: runner)
    monkeypatch.setattr(shaping, "read_back", lambda r, devices: later)
    assert shaping._host_counter_reader(_container(1), ("eth0",), applied) is runner
    other = {"eth0": [dict(applied["eth0"][0], kind="pfifo_fast")]}  # not the qdiscs the harness made
    monkeypatch.setattr(shaping, "read_back", lambda r, devices: other)
    assert shaping._host_counter_reader(_container(1), ("eth0",), applied) is None

    def fails(r, devices):
        raise TcCommandError("c1: gone", ["tc"], None, "gone")
    monkeypatch.setattr(shaping, "read_back", fails)
    assert shaping._host_counter_reader(_container(1), ("eth0",), applied) is None
    monkeypatch.setattr(shaping, "host_netns_runner", lambda c, local: None)
    assert shaping._host_counter_reader(_container(1), ("eth0",), applied) is None
