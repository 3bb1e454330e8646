"""Local SGD's outer step compressed both ways (wiiide.server.pace.compress): frames go through a real
socket pair and frame reader, as the server and the worker read them."""

from __future__ import annotations

import socket
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from wiiide.codecs.policy import CompressionPolicy
from wiiide.errors import ProtocolError
from wiiide.server.pace.compress import PULL_KINDS, DeltaPush, ReplicaPulls, WorkerCopy
from wiiide.wire.reader import FrameReader
from wiiide.wire.send import send_frames

NUMEL = 20_000


def received(frame):
    """`frame` as the peer's reader decodes it (a Message)."""
    a, b = socket.socketpair()
    try:
        sender = threading.Thread(target=send_frames, args=(a, [frame]), daemon=True)
        sender.start()
        msg = FrameReader(b, 1 << 24).read_message()
        sender.join(timeout=30)
        return msg
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("codec", ["fixed:int8", "fixed:fp16", "fixed:topk-0.05", "fixed:none"])
def test_delta_push_sent_plus_residual_is_the_sum_of_the_deltas(codec):
    rng = np.random.default_rng(3)
    push = DeltaPush(CompressionPolicy(codec, lossy_warmup_steps=2))
    inputs_sum = np.zeros(NUMEL)
    decoded_sum = np.zeros(NUMEL)
    codecs = []
    for step in range(10):
        delta = torch.from_numpy(rng.standard_normal(NUMEL).astype(np.float32) * 0.01 * (1 + step))
        inputs_sum += delta.numpy()
        msg = received(push.frame({"step": step}, delta))
        assert msg.kind == "gradients" and [t.name for t in msg.tensors] == ["delta"]
        values = msg.tensor("delta")
        assert values.dtype == np.float32 and values.shape == (NUMEL,)
        decoded_sum += values
        codecs.append(msg.codec)
    residual = push.residual()
    assert np.allclose(decoded_sum + (0 if residual is None else residual), inputs_sum, rtol=0, atol=1e-5)
    if codec == "fixed:none":
        assert residual is None
    else:
        assert codecs[:2] == ["none", "none"] and codecs[2] != "none"  # the policy's warm-up, then the codec
        assert residual is not None and np.abs(residual).max() > 0
        assert not np.allclose(decoded_sum, inputs_sum, rtol=0, atol=1e-5)  # the residual is really owed


def _pull_into(copies, rank, pulls, version, params, dense=False):
    msg = received(pulls.frame_for(rank, version, params, dense))
    assert msg.kind in PULL_KINDS
    copies.setdefault(rank, WorkerCopy(params.size)).apply(msg)
    return msg


def _schedule(rng, steps):
    """(version, ranks pulling it): rounds (every rank) and stretches where ranks pull on their own."""
    for version in range(steps):
        yield version, [1, 2, 3] if version < steps // 2 else [r for r in (1, 2, 3) if rng.random() < 0.5]


def test_worker_copies_equal_the_servers_and_fp32_pulls_are_the_parameters():
    rng = np.random.default_rng(4)
    params = rng.standard_normal(NUMEL).astype(np.float32)
    pulls, copies = ReplicaPulls(CompressionPolicy("fixed:none")), {}
    for version, ranks in _schedule(rng, 30):
        params = params - 0.01 * rng.standard_normal(NUMEL).astype(np.float32)
        for rank in ranks:
            _pull_into(copies, rank, pulls, version, params, dense=version < 2)
            assert np.array_equal(copies[rank].values, pulls.copy_of(rank))
            assert np.allclose(copies[rank].values, params, rtol=0, atol=1e-6)  # lossless deltas: float rounding only
            if version < 2:
                assert np.array_equal(copies[rank].values, params)  # absolute pulls are exact


@pytest.mark.parametrize("codec", ["fixed:int8", "fixed:fp16"])
def test_lossy_pulls_keep_every_workers_copy_within_the_codecs_error_of_the_last_delta(codec):
    rng = np.random.default_rng(5)
    params = rng.standard_normal(NUMEL).astype(np.float32)
    pulls, copies = ReplicaPulls(CompressionPolicy(codec)), {}
    # int8: per block of 256 the scale is max|x| / 127 and a value rounds to the nearest step, so the error
    # is at most half a step (wiiide.codecs.lossy); fp16: 2^-11 relative, plus a subnormal's absolute step
    relative = 0.5 / 127 if codec == "fixed:int8" else 2.0 ** -11
    gaps = []
    for version, ranks in _schedule(rng, 40):
        params = params - 0.01 * rng.standard_normal(NUMEL).astype(np.float32)
        for rank in ranks:
            before = pulls.copy_of(rank)
            owed = None if before is None else float(np.abs(params - before).max())
            msg = _pull_into(copies, rank, pulls, version, params)
            assert msg.meta["delta"] is (before is not None)  # the first pull of a worker is absolute
            assert np.array_equal(copies[rank].values, pulls.copy_of(rank))  # the worker holds what the server tracks
            gap = float(np.abs(params - copies[rank].values).max())
            assert gap <= (0.0 if owed is None else owed * relative * 1.0001 + 1e-7)
            gaps.append(gap)
    assert max(gaps) > 0  # lossy indeed


def test_workers_on_the_same_copy_share_one_frame_and_a_rejoining_worker_pulls_absolute():
    rng = np.random.default_rng(6)
    params = rng.standard_normal(NUMEL).astype(np.float32)
    pulls, copies = ReplicaPulls(CompressionPolicy("fixed:int8")), {}
    for version in range(5):  # rounds: every rank pulls every version, one encode per version
        params = params + 0.01 * rng.standard_normal(NUMEL).astype(np.float32)
        frames = [pulls.frame_for(rank, version, params, dense=False) for rank in (1, 2, 3, 4)]
        assert all(f is frames[0] for f in frames)
        for rank in (1, 2):
            copies.setdefault(rank, WorkerCopy(NUMEL)).apply(received(frames[0]))
    assert pulls.frames_encoded == 5
    params = params + 0.02
    _pull_into(copies, 1, pulls, 5, params)  # rank 1 goes on alone; rank 2 waits until version 6
    params = params + 0.03
    for rank in (1, 2):
        msg = _pull_into(copies, rank, pulls, 6, params)
        assert msg.meta["delta"] is True
        assert np.array_equal(copies[rank].values, pulls.copy_of(rank))
    assert pulls.frames_encoded == 5 + 1 + 2  # version 6 from two different copies
    pulls.forget(2)
    msg = _pull_into({}, 2, pulls, 6, params)
    assert msg.meta["delta"] is False and np.array_equal(msg.tensor("params"), params)
    assert pulls.frames_encoded == 9


def test_a_worker_copy_refuses_malformed_pulls():
    copy = WorkerCopy(4)
    delta = SimpleNamespace(meta={"delta": True}, tensors=[SimpleNamespace(name="params", dtype="float32",
                                                                            array=np.zeros(4, np.float32))])
    with pytest.raises(ProtocolError, match="before any absolute"):
        copy.apply(delta)
    for meta, name, values in [({"delta": 1}, "params", np.zeros(4, np.float32)),
                               ({"delta": False}, "grad", np.zeros(4, np.float32)),
                               ({"delta": False}, "params", np.zeros(5, np.float32))]:
        msg = SimpleNamespace(meta=meta, tensors=[SimpleNamespace(name=name, dtype="float32", array=values)])
        with pytest.raises(ProtocolError):
            copy.apply(msg)
    assert copy.values is None
