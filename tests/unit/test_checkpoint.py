"""Checkpoints (wiiide.server.checkpoint, wiiide.server.recovery): round trip, refusal of a corrupted, truncated or
mis-shaped file with the previous one used, atomic writes (a leftover temporary file is ignored),
pruning, the schedule, momentum buffers, and a coordinator's restore."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from wiiide.server.checkpoint import CheckpointError, CheckpointSchedule, CheckpointStore
from wiiide.config import RunConfig
from wiiide.errors import ProtocolError
from wiiide.log import TieredLog
from wiiide.metrics import NodeMetrics
from wiiide.training.model import FlatParams, MomentumSGD, build_mlp
from wiiide.server.recovery import (
    ServerRecovery,
    momentum_from_flat,
    momentum_to_flat,
    rejoin_hint,
    start_incarnation,
)


def _tensors(seed: int, n: int = 50) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"params": rng.standard_normal(n).astype(np.float32), "momentum": rng.standard_normal(n).astype(np.float32)}


def _store(tmp_path, errors=None, keep=3) -> CheckpointStore:
    return CheckpointStore(tmp_path / "ckpt", "coordinator", keep=keep,
                           log_error=(lambda fmt, *args: errors.append(fmt % args)) if errors is not None else None)


def test_round_trip_keeps_every_value_the_step_and_the_run_metadata(tmp_path):
    store = _store(tmp_path)
    tensors = _tensors(0)
    path = store.save(40, tensors, {"train_time_s": 1.5, "config": {"hidden_sizes": [64]}})
    assert path.name == "coordinator-step000000000040.safetensors"
    loaded = store.load_newest({"params": (50,)})
    assert loaded is not None and loaded.step == 40 and loaded.path == path
    assert loaded.run == {"train_time_s": 1.5, "config": {"hidden_sizes": [64]}}
    for name, array in tensors.items():
        assert loaded.tensors[name].dtype == np.float32
        np.testing.assert_array_equal(loaded.tensors[name], array)


def test_file_is_plain_safetensors_with_the_hash_in_its_metadata(tmp_path):
    from safetensors.numpy import load_file

    path = _store(tmp_path).save(3, _tensors(1))
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    header = json.loads(path.read_bytes()[8:8 + header_len])
    meta = header["__metadata__"]
    assert meta["format"] == "wiiide-checkpoint" and meta["step"] == "3" and len(meta["sha256"]) == 64
    assert set(load_file(str(path))) == {"params", "momentum"}  # any safetensors reader opens it


def test_newest_wins_and_only_keep_files_remain(tmp_path):
    store = _store(tmp_path, keep=2)
    for step in (10, 20, 30):
        store.save(step, _tensors(step))
    assert [p.name for p in store.files()] == ["coordinator-step000000000030.safetensors",
                                               "coordinator-step000000000020.safetensors"]
    np.testing.assert_array_equal(store.load_newest().tensors["params"], _tensors(30)["params"])


def _flip_a_tensor_byte(path):
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # inside the last tensor's bytes; the header still parses
    path.write_bytes(bytes(data))


def test_hash_mismatch_is_refused_with_a_logged_error_and_the_previous_one_is_used(tmp_path):
    errors: list[str] = []
    store = _store(tmp_path, errors)
    store.save(10, _tensors(10))
    newest = store.save(20, _tensors(20))
    _flip_a_tensor_byte(newest)
    loaded = store.load_newest({"params": (50,)})
    assert loaded.step == 10
    np.testing.assert_array_equal(loaded.tensors["params"], _tensors(10)["params"])
    assert len(errors) == 1 and "SHA-256 mismatch" in errors[0] and newest.name in errors[0]
    assert store.refused == [{"path": str(newest), "cause": store.refused[0]["cause"]}]


def test_header_claiming_another_step_fails_the_hash(tmp_path):
    store = _store(tmp_path)
    path = store.save(10, _tensors(10))
    forged = path.read_bytes().replace(b'"step":"10"', b'"step":"99"')
    assert forged != path.read_bytes()
    path.write_bytes(forged)
    assert store.load_newest() is None and "SHA-256 mismatch" in store.refused[0]["cause"]


def test_truncated_file_is_refused_and_the_previous_one_is_used(tmp_path):
    errors: list[str] = []
    store = _store(tmp_path, errors)
    store.save(10, _tensors(10))
    newest = store.save(20, _tensors(20))
    newest.write_bytes(newest.read_bytes()[:-100])
    assert store.load_newest().step == 10
    assert "unreadable" in errors[0]


def test_wrong_shape_for_the_model_is_refused(tmp_path):
    store = _store(tmp_path)
    store.save(10, {"params": np.zeros(50, np.float32)})
    store.save(20, {"params": np.zeros(60, np.float32)})  # another model's
    loaded = store.load_newest({"params": (50,)})
    assert loaded.step == 10 and "shape (60,)" in store.refused[0]["cause"]
    assert store.load_newest({"params": (70,)}) is None  # none fits: a fresh start


def test_other_run_configuration_is_refused(tmp_path):
    store = _store(tmp_path)
    store.save(10, _tensors(1), {"config": {"seed": 1}})
    assert store.load_newest(expected_run={"config": {"seed": 2}}) is None
    assert "another run configuration" in store.refused[0]["cause"]


def test_leftover_temporary_file_is_ignored_and_cleaned_by_the_next_save(tmp_path):
    store = _store(tmp_path)
    store.save(10, _tensors(10))
    leftover = store.directory / ".coordinator-step000000000020.safetensors.tmp-999"
    leftover.write_bytes(b"\x00" * 40)  # a writer killed before its rename
    assert [p.name for p in store.files()] == ["coordinator-step000000000010.safetensors"]
    assert store.load_newest().step == 10 and store.refused == []
    store.save(30, _tensors(30))
    assert not leftover.exists()


def test_failed_write_leaves_the_previous_checkpoints_intact(tmp_path, monkeypatch):
    store = _store(tmp_path)
    store.save(10, _tensors(10))

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("wiiide.metrics.os.replace", broken_replace)
    with pytest.raises(OSError):
        store.save(20, _tensors(20))
    monkeypatch.undo()
    assert [p.name for p in store.directory.iterdir()] == ["coordinator-step000000000010.safetensors"]


@pytest.mark.parametrize("tensors, needle", [
    ({}, "at least one"), ({"params": np.zeros(4, np.float64)}, "float32"),
    ({"params": np.zeros((2, 2), np.float32)}, "flat"), ({"../x": np.zeros(4, np.float32)}, "tensor name")])
def test_save_refuses_what_is_not_a_named_set_of_flat_float32_arrays(tmp_path, tensors, needle):
    with pytest.raises(CheckpointError, match=needle):
        _store(tmp_path).save(1, tensors)


def test_schedule_by_steps_and_by_time():
    by_steps = CheckpointSchedule(every_steps=10, every_s=0.0, last_step=0, last_s=0.0)
    assert [s for s in range(1, 31) if by_steps.due(s, 0.0) and by_steps.mark(s, 0.0) is None] == [10, 20, 30]
    by_time = CheckpointSchedule(every_steps=0, every_s=5.0, last_step=0, last_s=100.0)
    assert not by_time.due(3, 104.0) and by_time.due(3, 105.0)
    assert not CheckpointSchedule(0, 0.0).enabled


def test_momentum_buffers_round_trip_through_a_flat_vector():
    model = build_mlp(8, [6], 3, seed=0)
    flat = FlatParams(model)
    opt = MomentumSGD(model.parameters(), lr=0.1, momentum=0.9)
    assert momentum_to_flat(opt, flat) is None  # no buffer before the first step
    flat.grads.copy_(torch.linspace(-1, 1, flat.numel))
    opt.step()
    vector = momentum_to_flat(opt, flat)
    assert vector.shape == (flat.numel,) and vector.dtype == np.float32
    model2 = build_mlp(8, [6], 3, seed=1)
    opt2 = MomentumSGD(model2.parameters(), lr=0.1, momentum=0.9)
    momentum_from_flat(opt2, vector)
    for i in range(len(opt.params)):
        torch.testing.assert_close(opt2.momentum_buffers[i], opt.momentum_buffers[i])
    with pytest.raises(CheckpointError):
        momentum_from_flat(opt2, vector[:-1])


def test_rejoin_hint_is_checked():
    assert rejoin_hint({}) is None
    assert rejoin_hint({"rejoin": {"last_step": 7, "last_params_unix_s": 1.7e9}}) == {
        "last_step": 7, "last_params_unix_s": 1.7e9}
    for bad in ([1], {"last_step": True, "last_params_unix_s": 1.0}, {"last_step": 10**400, "last_params_unix_s": 1.0},
                {"last_step": 1, "last_params_unix_s": float("nan")}, {"last_step": -1, "last_params_unix_s": 1.0}):
        with pytest.raises(ProtocolError):
            rejoin_hint({"rejoin": bad})


def test_incarnations_keep_an_earlier_coordinator_json(tmp_path):
    assert start_incarnation(tmp_path) == 1
    (tmp_path / "coordinator.json").write_text('{"status": "failed"}')
    assert start_incarnation(tmp_path) == 2
    assert not (tmp_path / "coordinator.json").exists()
    assert json.loads((tmp_path / "incarnations" / "coordinator.1.json").read_text()) == {"status": "failed"}
    assert len((tmp_path / "coordinator.starts.jsonl").read_text().splitlines()) == 2


def _server(tmp_path, **knobs):
    cfg = RunConfig(metrics_dir=str(tmp_path / "nodes"), log_tier="silent", checkpoint_every_steps=5, momentum=0.5,
                    hidden_sizes=[6], ps_shards="1", **knobs)  # ServerRecovery: the central server's checkpoints
    metrics = NodeMetrics("coordinator", "c")
    model = build_mlp(8, [6], 3, seed=0)
    flat = FlatParams(model)
    opt = MomentumSGD(model.parameters(), lr=0.1, momentum=0.5)
    return ServerRecovery(cfg, metrics, TieredLog(cfg, "coordinator")), metrics, flat, opt


def test_server_writes_on_schedule_and_a_restart_restores_state_and_reports_the_loss(tmp_path):
    server, metrics, flat, opt = _server(tmp_path)
    assert server.restore(flat, opt) == (0, 0.0)
    for step in range(1, 13):
        flat.grads.fill_(0.01 * step)
        opt.step()
        server.after_step(step, flat, opt, train_time_s=step * 0.1)
        if step == 10:
            params_at_10, momentum_at_10 = flat.params.clone(), momentum_to_flat(opt, flat)
    assert [p.name[-18:-12] for p in server.store.files()] == ["000010", "000005"]
    assert metrics.extra["checkpoints"]["written"] == 2 and metrics.extra["checkpoints"]["last_step"] == 10
    # a restart: a new incarnation restores step 10 and learns from the rejoining workers where the old one was
    server2, metrics2, flat2, opt2 = _server(tmp_path)
    assert server2.incarnation == 2
    step, trained_s = server2.restore(flat2, opt2)
    assert (step, trained_s) == (10, pytest.approx(1.0)) and metrics2.steps == 10
    torch.testing.assert_close(flat2.params, params_at_10, rtol=0, atol=0)
    np.testing.assert_array_equal(momentum_to_flat(opt2, flat2), momentum_at_10)
    assert not torch.equal(flat2.params, flat.params)  # step 12's were not restored
    server2.note_rejoin({"last_step": 11, "last_params_unix_s": 1.0})
    server2.note_rejoin({"last_step": 12, "last_params_unix_s": 2.0})
    server2.after_step(11, flat2, opt2, 1.1)
    rec = metrics2.extra["recovery"]
    assert rec["restored_step"] == 10 and rec["steps_at_crash"] == 13 and rec["steps_lost"] == 3
    assert rec["workers_rejoined"] == 2
    # from the newest sign of life among the hints (2.0, not 1.0) to this incarnation's first step
    assert rec["recovery_s"] == pytest.approx(rec["first_step_unix_s"] - 2.0, abs=1e-5)
    assert any(e["event"] == "recovered" for e in metrics2.events)


def test_server_with_checkpoints_off_writes_and_restores_nothing(tmp_path):
    on, _, flat, opt = _server(tmp_path)
    on.after_step(5, flat, opt, 0.5)  # a checkpoint an "off" run must not restore
    metrics = NodeMetrics("coordinator", "c")
    off = ServerRecovery(on.cfg.replace(checkpoint_every_steps=0), metrics, on.log)
    assert not off.enabled and off.restore(flat, opt) == (0, 0.0)
    off.after_step(10, flat, opt, 1.0)
    assert len(off.store.files()) == 1 and "checkpoints" not in metrics.extra


def test_refused_checkpoint_is_recorded_by_the_server(tmp_path):
    server, metrics, flat, opt = _server(tmp_path)
    for step in (5, 10):
        server.after_step(step, flat, opt, 0.1)
    _flip_a_tensor_byte(server.store.files()[0])
    server2, metrics2, flat2, opt2 = _server(tmp_path)
    assert server2.restore(flat2, opt2)[0] == 5
    refused = metrics2.extra["recovery"]["refused"]
    assert len(refused) == 1 and "000010" in refused[0]["path"] and "SHA-256" in refused[0]["cause"]



# --- the chaos soak's seeded random fault schedule (harness.spec.faults.RandomSchedule) ------------
def _random_spec(**random):
    from harness.spec.points import build_spec

    schedule = {"seed": 3, "targets": ["coordinator", "worker-1", "worker-2"], "start_s": 10, "until_s": 300, **random}
    return build_spec({"name": "r", "base": {"num_workers": 2}, "faults": {"random": schedule}}, "r.yaml")


def test_random_schedule_is_seeded_paired_and_never_hits_a_target_that_is_down():
    faults = [f.to_dict() for f in _random_spec().faults]
    assert faults == [f.to_dict() for f in _random_spec().faults]  # the same seed draws the same schedule
    assert faults != [f.to_dict() for f in _random_spec(seed=4).faults]
    starts = [f for f in faults if f["action"] != "restart"]
    assert 300 // 40 <= len(starts) <= 290 // 20 + 1 and all(10 <= f["at_s"] <= 300 for f in starts)
    gaps = [b["at_s"] - a["at_s"] for a, b in zip(starts, starts[1:])]
    assert all(19.9 <= gap <= 40.1 for gap in gaps)
    for i, fault in enumerate(faults):
        if fault["action"] == "kill":  # a kill brings its restart of the same target, 3..8 s later
            restart = next(f for f in faults[i + 1:] if f["target"] == fault["target"])
            assert restart["action"] == "restart" and 3 <= restart["at_s"] - fault["at_s"] <= 8
        elif fault["action"] in ("pause", "disconnect"):
            assert 3 <= fault["duration_s"] <= 8
    assert {f["action"] for f in faults} <= {"kill", "restart", "pause", "disconnect"}


@pytest.mark.parametrize("random, needle", [
    ({"actions": ["restart"]}, "actions[0]"), ({"every_s": [5, 1]}, "every_s"), ({"targets": ["worker-9"]}, "9"),
    ({"bogus": 1}, "bogus: unknown key"), ({"until_s": 5}, "before start_s"), ({"every_s": [0.001, 1]}, "more than")])
def test_random_schedule_refuses_bad_settings_with_a_spec_error(random, needle):
    from harness.errors import SpecError

    with pytest.raises(SpecError, match="faults") as info:
        _random_spec(**random)
    assert needle in str(info.value)


def test_chaos_soak_spec_hits_the_coordinator_with_every_action():
    from harness.spec.points import load_spec
    from tests.unit.conftest import REPO_ROOT

    spec = load_spec(REPO_ROOT / "experiments" / "chaos.yaml")
    on_coordinator = {f.action for f in spec.faults if f.target == "coordinator"}
    assert on_coordinator == {"kill", "restart", "pause", "disconnect"}
    assert spec.points[0].config.num_workers == 8 and spec.points[0].config.duration_s == 600
    assert spec.points[0].config.checkpoint_every_steps > 0 and spec.points[0].config.rejoin_timeout_s > 0


def test_recovery_baseline_is_the_recovery_run_without_its_faults():
    from harness.spec.points import load_spec
    from tests.unit.conftest import REPO_ROOT

    faulted = load_spec(REPO_ROOT / "experiments" / "recovery.yaml")
    baseline = load_spec(REPO_ROOT / "experiments" / "recovery-baseline.yaml")
    assert faulted.base == baseline.base and faulted.axes == baseline.axes and baseline.faults == []
    assert [(f.action, f.target) for f in faulted.faults] == [("kill", "coordinator"), ("restart", "coordinator")]


def test_worker_that_never_joined_retries_a_silent_coordinator_until_connect_timeout(tmp_path, monkeypatch):
    """A restarted worker that meets a paused coordinator (TCP accepted by the kernel, no challenge)
    tries again rather than giving up at its first handshake timeout (seen in the chaos soak)."""
    import socket
    import threading

    from wiiide.wire.node import EXIT_PEER_LOST
    from wiiide.worker import Worker

    monkeypatch.setenv("WIIIIIDE_SECRET", "unit-tests-shared-secret-0123456789")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept_and_say_nothing():
        while not done.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept_and_say_nothing, daemon=True)
    thread.start()
    try:
        cfg = RunConfig(port=listener.getsockname()[1], coordinator_host="127.0.0.1", node_id="w",
                        metrics_dir=str(tmp_path), log_tier="silent", handshake_timeout_s=0.2, connect_timeout_s=1.0)
        code = Worker(cfg).run()
    finally:
        done.set()
        thread.join(timeout=5)
        for sock in held + [listener]:
            sock.close()
    metrics = json.loads((tmp_path / "worker-w.json").read_text())
    assert code == EXIT_PEER_LOST and "could not join within connect_timeout_s=1 s" in metrics["error"]
    assert metrics["event_counts"]["handshake_retry"] >= 2 and len(held) >= 3


def test_pace_checkpoint_restores_the_outer_momentum_and_refuses_another_outer_optimizer(tmp_path):
    from types import SimpleNamespace

    from wiiide.server.pace.checkpoints import PaceResume, checkpoint_after_update, resume_from
    from wiiide.server.pace.outer import OuterOptimizer

    server, metrics, flat, opt = _server(tmp_path, local_steps=4, outer_optimizer="nesterov")
    assert resume_from(server, None).step == 0 and server.hint_unit == ("tasks", 0)
    outer = OuterOptimizer(flat, "nesterov", 0.7, 0.9)
    for version in range(1, 6):
        outer.step(torch.full((flat.numel,), 0.01 * version))
        checkpoint_after_update(server, SimpleNamespace(outer=outer, version=version, flat=flat, optimizer=opt,
                                                        next_task=2 * version), train_time_s=version * 0.5)
    buffer_at_5, params_at_5 = outer.buffer.clone(), flat.params.clone()
    server2, _, flat2, opt2 = _server(tmp_path, local_steps=4, outer_optimizer="nesterov")
    assert server2.restore(flat2, opt2)[0] == 5
    outer2 = OuterOptimizer(flat2, "nesterov", 0.7, 0.9)
    assert resume_from(server2, outer2) == PaceResume(5, 2.5, 10) and server2.hint_unit == ("tasks", 10)
    torch.testing.assert_close(outer2.buffer, buffer_at_5, rtol=0, atol=0)
    torch.testing.assert_close(flat2.params, params_at_5, rtol=0, atol=0)
    # the next outer step goes on from the restored momentum exactly as the first server's would
    delta = torch.full((flat.numel,), 0.06)
    outer.step(delta.clone())
    outer2.step(delta.clone())
    torch.testing.assert_close(flat2.params, flat.params, rtol=0, atol=0)
    # a run with another outer optimizer (or none) does not take this state
    server3, metrics3, flat3, opt3 = _server(tmp_path, local_steps=4, outer_optimizer="avg")
    assert server3.restore(flat3, opt3) == (0, 0.0)
    assert "outer" in metrics3.extra["recovery"]["refused"][0]["cause"]


def test_a_process_age_runs_from_the_process_start():
    """`process_age_s` of a child that sleeps 0.2 s before asking: at least those 0.2 s, at most the time
    from just before the child was started to just after it answered (to a clock tick, 10 ms)."""
    import subprocess
    import sys
    import time

    code = "import time; time.sleep(0.2); from wiiide.server.recovery import process_age_s; print(process_age_s())"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    elapsed_s = time.monotonic() - t0
    age_s = float(out)
    assert 0.2 <= age_s <= elapsed_s + 0.01
