"""The workloads (wiiide.training.models, wiiide.training.corpus, wiiide.codecs.rows, wiiide.server.sparse): every model builds
from its config and trains one step; the corpus is deterministic and refuses what is not there; the
rows codec round-trips and refuses ids it must not write; the sparse parameter server keeps workers
bitwise in step and moves fewer bytes than the dense one."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from wiiide.codecs.rows import RowsCodec
from wiiide.config import RunConfig
from wiiide.server.coordinator import Coordinator
from wiiide.training.corpus import (
    STDLIB_MODULES,
    load_corpus,
    stdlib_root,
    unigram_loss_nats,
    windows,
)
from wiiide.training.data import load_dataset
from wiiide.errors import ConfigError, ProtocolError
from wiiide.training.model import (
    ClassificationEval,
    FlatParams,
    LanguageModelEval,
    MomentumSGD,
    evaluate,
)
from wiiide.training.models import (
    build_model,
    check_batch,
    loss_mean,
    model_from_spec,
    model_spec,
    shard_units,
    task_of,
)
from wiiide.training.models.embedding import (
    expected_distinct_rows,
    make_zipf_data,
    zipf_probabilities,
)
from wiiide.server.sparse import SparseRows
from wiiide.wire.decode import decode_payload, parse_header
from wiiide.wire.encode import encode_message
from wiiide.wire.format import PREFIX
from wiiide.wire.messages import WireTensor
from wiiide.worker import Worker

TINY = {
    "mlp": {"model": "mlp", "hidden_sizes": (8,)},
    "cnn": {"model": "cnn", "cnn_channels": 2},
    "transformer": {"model": "transformer", "transformer_layers": 1, "transformer_width": 16, "transformer_heads": 2,
                    "transformer_context": 16},
    "embedding": {"model": "embedding", "embedding_rows": 500, "embedding_dim": 4, "embedding_fields": 3,
                  "embedding_samples": 200},
}


def tiny_batch(cfg: RunConfig, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    data = load_dataset(cfg)
    return torch.from_numpy(data.x_train[:n]), torch.from_numpy(data.y_train[:n])


@pytest.mark.parametrize("kind", list(TINY))
def test_each_model_builds_from_its_config_and_trains_one_step(kind):
    cfg = RunConfig(**TINY[kind])
    data = load_dataset(cfg)
    model = build_model(cfg, data.num_features, data.num_classes)
    again = model_from_spec(model_spec(cfg, data.num_features, data.num_classes))
    assert [p.shape for p in model.parameters()] == [p.shape for p in again.parameters()]
    x, y = tiny_batch(cfg)
    check_batch(kind, x, y)
    flat = FlatParams(model)
    before = flat.params.clone()
    loss = loss_mean(kind, model(x), y)
    loss.backward()
    assert torch.isfinite(loss) and flat.grads.abs().sum() > 0
    MomentumSGD(model.parameters(), lr=0.1).step()
    assert not torch.equal(before, flat.params)
    assert shard_units(model)  # FSDP has something to shard
    result = evaluate(model, data.x_test, data.y_test, data.task)
    if task_of(kind) == "language_model":
        assert isinstance(result, LanguageModelEval)
        assert result.perplexity == pytest.approx(np.exp(result.loss))
        assert 0 < result.tokens <= 64 * 16
    else:
        assert isinstance(result, ClassificationEval) and 0.0 <= result.accuracy <= 1.0


def test_transformer_is_causal():
    """Changing a later byte changes no earlier position's logits."""
    cfg = RunConfig(**TINY["transformer"])
    model = build_model(cfg, 16, 256)
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10] = (y[0, 10] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.equal(a[0, :10], b[0, :10]) and not torch.equal(a[0, 10:], b[0, 10:])


def test_cnn_refuses_non_square_images_and_batches_of_the_wrong_dtype():
    with pytest.raises(ValueError, match="square"):
        build_model(RunConfig(model="cnn", dataset="synthetic", synthetic_features=10), 10, 3)
    with pytest.raises(ValueError, match="int64"):
        check_batch("transformer", torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError):
        model_from_spec({"type": "embedding", "rows": 0, "dim": 4, "fields": 2})
    with pytest.raises(ValueError):
        model_from_spec({"type": "transformer", "layers": True, "width": 16, "heads": 2, "context": 8})


# --- corpus --------------------------------------------------------------------------------------
def test_corpus_is_deterministic_and_split_by_file():
    a, b = load_corpus(), load_corpus()
    assert a.train == b.train and a.validation == b.validation and a.sha256 == b.sha256
    assert a.total_bytes == 2_189_707 and len(a.train_files) + len(a.validation_files) == len(STDLIB_MODULES)
    assert not set(a.train_files) & set(a.validation_files)
    assert a.validation_files[0] == sorted(f"{m}.py" for m in STDLIB_MODULES)[9]
    x, y = windows(a.validation, 64)
    assert np.array_equal(x[0, 1:], y[0, :-1]) and x.dtype == np.int64
    # predicting by byte frequency is far better than uniform (ln 256 = 5.55 nats), far worse than a model
    assert 2.5 < unigram_loss_nats(a.train, a.validation) < 4.0


def test_corpus_refuses_missing_empty_or_changed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_corpus(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="cannot read"):
        load_corpus(tmp_path, modules=["os"], expected_sha256=None, expected_bytes=None)
    with pytest.raises(ConfigError, match="empty"):
        load_corpus(tmp_path, modules=[])
    for i in range(12):
        (tmp_path / f"m{i:02d}.py").write_bytes(b"")
    with pytest.raises(ConfigError, match="empty"):
        load_corpus(tmp_path, modules=[f"m{i:02d}" for i in range(12)], expected_sha256=None, expected_bytes=None)
    (tmp_path / "os.py").write_bytes((stdlib_root() / "os.py").read_bytes() + b"# patched\n")
    names = [m for m in STDLIB_MODULES if m != "os"]
    for m in names:
        (tmp_path / f"{m}.py").symlink_to(stdlib_root() / f"{m}.py")
    with pytest.raises(ConfigError, match="different files"):
        load_corpus(tmp_path)


# --- the rows codec --------------------------------------------------------------------------------
def rows_frame(tensors: list[WireTensor]):
    frame = encode_message("gradients", {"step": 0}, tensors, RowsCodec())
    wire = b"".join(bytes(b) for b in frame.buffers)
    return frame, wire


def decode(wire: bytes, **header_changes):
    """A frame's bytes -> its Message, as a receiver decodes it (header fields may be replaced first)."""
    _, _, _, header_len, _ = PREFIX.unpack(wire[:PREFIX.size])
    header = json.loads(wire[PREFIX.size:PREFIX.size + header_len])
    header.update(header_changes)
    header = parse_header(json.dumps(header).encode(), 1 << 30)
    return decode_payload(header, memoryview(wire[PREFIX.size + header_len:]))


def test_rows_codec_round_trips_ids_and_values_and_sends_only_touched_rows():
    table = np.zeros((10_000, 8), dtype=np.float32)
    table[[0, 17, 9_999]] = np.arange(24, dtype=np.float32).reshape(3, 8) - 5
    rest = np.random.default_rng(0).standard_normal(300).astype(np.float32)
    frame, wire = rows_frame([WireTensor("grad_rows", table), WireTensor("grad_rest", rest)])
    assert frame.payload_nbytes == 3 * (4 + 32) + rest.nbytes  # int32 ids + rows, the rest dense
    msg = decode(wire)
    assert np.array_equal(msg.tensor("grad_rows"), table) and np.array_equal(msg.tensor("grad_rest"), rest)
    empty, wire = rows_frame([WireTensor("t", np.zeros((5, 2), dtype=np.float32))])
    assert np.array_equal(decode(wire).tensor("t"), np.zeros((5, 2), dtype=np.float32))


def forged(ids: list[int], rows: int = 10, dim: int = 2) -> bytes:
    """A rows frame whose ids were rewritten after encoding (as a hostile peer could)."""
    table = np.zeros((rows, dim), dtype=np.float32)
    table[: len(ids)] = 1.0
    _, wire = rows_frame([WireTensor("t", table)])
    raw = bytearray(wire)
    head = len(wire) - len(ids) * (4 + 4 * dim)
    raw[head:head + 4 * len(ids)] = np.array(ids, dtype=np.int32).tobytes()
    return bytes(raw)


@pytest.mark.parametrize("ids, match", [([3, 10], "out of range"), ([-1, 2], "out of range"),
                                        ([4, 4], "increasing"), ([5, 2], "increasing")])
def test_rows_codec_refuses_out_of_range_and_repeated_ids(ids, match):
    with pytest.raises(ProtocolError, match=match):
        decode(forged(ids))


@pytest.mark.parametrize("params", [{"id_bytes": 2, "tensors": [[2, 1]]}, {"id_bytes": 4, "tensors": [[3, 1]]},
                                    {"id_bytes": 4, "tensors": [[2, 11]]}, {"id_bytes": 4},
                                    {"id_bytes": 4, "tensors": [[2, True]]}, {"id_bytes": 4, "tensors": []}])
def test_rows_codec_refuses_bad_params(params):
    table = np.zeros((10, 2), dtype=np.float32)
    table[3] = 1
    _, wire = rows_frame([WireTensor("t", table)])
    with pytest.raises(ProtocolError):
        decode(wire, codec_params=params)


# --- the sparse parameter server -----------------------------------------------------------------------
def test_sparse_updates_keep_the_worker_bitwise_equal_to_the_coordinator():
    cfg = RunConfig(**{**TINY["embedding"], "embedding_rows": 5000}, sparse_embedding=True)
    data = load_dataset(cfg)
    server, replica, dense = (build_model(cfg, data.num_features, data.num_classes) for _ in range(3))
    s_flat, r_flat, d_flat = FlatParams(server), FlatParams(replica), FlatParams(dense)
    s_rows, r_rows = SparseRows(server, s_flat.numel), SparseRows(replica, r_flat.numel)
    d_opt = MomentumSGD(dense.parameters(), lr=0.5)  # the dense parameter server's step, for comparison
    conn = object.__new__(type("Conn", (), {}))
    full = encode_message("params", {"step": 0}, [WireTensor("params", s_flat.params.numpy())])
    for step in range(4):
        frame = s_rows.params_frame(conn, step, s_flat.params, 0.5, full if step == 0 else None)
        wire = b"".join(bytes(b) for b in frame.buffers)
        msg = decode(wire)
        if step == 0:
            r_flat.load(torch.from_numpy(msg.tensor("params").copy()))
        else:
            assert msg.meta["update"] == "rows" and frame.payload_nbytes < s_flat.numel * 4 / 10
            assert 0 < msg.tensor("update_ids").size <= 2 * 8 * 3  # at most 2 workers x batch x fields rows changed
            r_rows.apply_update(msg, r_flat.params)
        assert torch.equal(r_flat.params, s_flat.params), step
        torch.testing.assert_close(s_flat.params, d_flat.params, rtol=1e-6, atol=1e-7)
        s_rows.begin_step()
        d_flat.grads.zero_()
        for worker in range(2):  # the replica computes both workers' pushes
            x, y = (torch.from_numpy(a[(2 * step + worker) * 8:(2 * step + worker + 1) * 8])
                    for a in (data.x_train, data.y_train))
            ids, rows_grad, loss = r_rows.gradient(replica, r_flat, x, y, 1, lambda out, t: loss_mean("embedding", out, t))
            assert torch.equal(ids, torch.unique(x)) and rows_grad.shape == (ids.numel(), 4)
            push = decode(b"".join(bytes(b) for b in r_rows.gradients_frame({"step": step}, ids, rows_grad,
                                                                             r_flat.grads).buffers))
            assert push.tensor("grad_rows").nbytes == ids.numel() * 4 * 4  # only the touched rows travel
            s_rows.add_gradients(push)
            loss_mean("embedding", dense(x), y).__mul__(0.5).backward()  # the dense gradient, averaged over 2
            assert loss == pytest.approx(loss_mean("embedding", dense(x), y).item(), rel=1e-6)
        s_rows.step(s_flat.params, s_flat.grads, 2, 0.5)
        d_opt.step()


def test_sparse_push_refuses_ids_out_of_range_or_repeated():
    cfg = RunConfig(**{**TINY["embedding"], "embedding_rows": 50}, sparse_embedding=True)
    model = build_model(cfg, 0, 2)
    rows = SparseRows(model, FlatParams(model).numel)
    rest = np.zeros(rows.rest_numel, dtype=np.float32)
    for ids in ([3, 50], [-1, 2], [4, 4], [5, 2]):
        push = encode_message("gradients", {"step": 0}, [
            WireTensor("grad_ids", np.array(ids, dtype=np.int32)), WireTensor("grad_rows", np.ones((2, 4), np.float32)),
            WireTensor("grad_rest", rest)])
        with pytest.raises(ProtocolError, match="out of range|increasing"):
            rows.add_gradients(decode(b"".join(bytes(b) for b in push.buffers)))
    with pytest.raises(IndexError, match="out of range"):
        rows.gradient(model, FlatParams(model), torch.tensor([[0, 1, 50]]), torch.tensor([0]), 1,
                      lambda out, t: loss_mean("embedding", out, t))


def test_expected_distinct_rows_matches_a_draw():
    p = zipf_probabilities(100_000, 1.1)
    ids, _ = make_zipf_data(400, 100_000, 8, 1.1, seed=3)
    distinct = [len(np.unique(ids[i:i + 32])) for i in range(0, 400, 32)][:12]
    assert np.mean(distinct) == pytest.approx(expected_distinct_rows(p, 32 * 8), rel=0.15)


def _run_in_process(tmp_path: Path, **fields) -> dict:
    """Coordinator and 2 workers in threads of this process (their `_main`: no signal handlers), on a
    port of their own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = dict(port=port, num_workers=2, max_steps=6, duration_s=60, log_tier="silent", batch_size=8,
                  connect_timeout_s=30, metrics_dir=str(tmp_path / "m"), ps_shards="1",  # the central server's bytes
                  **TINY["embedding"])
    common["embedding_rows"] = 20_000
    cfg = RunConfig(**common, **fields)
    coordinator = Coordinator(cfg)
    workers = [Worker(cfg.replace(node_id=f"w{i}")) for i in range(2)]
    threads = [threading.Thread(target=w._main, daemon=True) for w in workers]
    server = threading.Thread(target=coordinator._main, daemon=True)
    server.start()
    for t in threads:
        t.start()
    for t in [server, *threads]:
        t.join(60)
    m = coordinator.metrics
    assert m.steps == 6
    return {"bytes": m.wire_bytes_sent + m.wire_bytes_received, "loss": m.losses[-1], "extra": m.extra}


def test_sparse_embedding_moves_fewer_bytes_than_dense_on_the_parameter_server(tmp_path, monkeypatch):
    monkeypatch.setenv("WIIIIIDE_SECRET", "unit-tests-shared-secret-0123456789")
    dense = _run_in_process(tmp_path / "dense")
    sparse = _run_in_process(tmp_path / "sparse", sparse_embedding=True)
    assert sparse["bytes"] * 5 < dense["bytes"]
    assert sparse["loss"] == pytest.approx(dense["loss"], rel=1e-5)  # the same training, other bytes
    # the expected bytes of a step (wiiide.server.sparse.expected_bytes_per_step) against what the runs moved: the
    # dense server every parameter both ways; the sparse one the same after each worker's first, whole pull
    expected, steps = sparse["extra"]["comm"]["expected"], 6
    assert dense["bytes"] / steps == pytest.approx(expected["dense_total_bytes"], rel=0.02)
    assert (sparse["bytes"] - 2 * expected["param_bytes"]) / steps == pytest.approx(expected["total_bytes"], rel=0.15)
