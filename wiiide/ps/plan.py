"""What a sharded run's set-up decides and checks: the data set's fingerprint, the shard count, the
pieces a shard's range is cut into (the link probe's rule), and the worker's reading of the
coordinator's ``ps_plan`` (partitions, shard addresses, start step and momentum), and the coordinator's
one-message receive from a worker during set-up and the frame of a worker's batch. The loops that
use them are in `wiiide.ps.session` (set-up, barrier) and `wiiide.ps.paced` (workers at their own pace).
"""

from __future__ import annotations

import hashlib

import numpy as np

from wiiide.codecs.policy import fixed_lossy_ratio
from wiiide.config import RunConfig
from wiiide.data import Dataset
from wiiide.errors import ProtocolError
from wiiide.node import EXIT_PEER_LOST, Connection, NodeFailure
from wiiide.ps import link_probe
from wiiide.ps.link_probe import PieceRule
from wiiide.wire.encode import encode_message
from wiiide.wire.messages import WireTensor
from wiiide.ps.partition import PER_SHARD_FINEST_BYTES, Partition, finest_raw_bytes, resolve_shards

PS_FAILED = "ps_failed"  # worker -> coordinator: one of my shards failed ({"cause"}); the coordinator stops the run


def data_fingerprint(data: Dataset) -> str:
    """SHA-256 (first 32 hex characters) of the training split's bytes (x then y): equal on two nodes
    exactly when a batch's indices mean the same samples on both."""
    digest = hashlib.sha256()
    digest.update(np.ascontiguousarray(data.x_train).tobytes())
    digest.update(np.ascontiguousarray(data.y_train).tobytes())
    return digest.hexdigest()[:32]


def partition_finest_bytes(cfg: RunConfig, wire_bytes: int = PER_SHARD_FINEST_BYTES) -> int:
    """The smallest piece `cfg.partitions_per_shard` cuts a shard's range into (raw bytes): about
    `wire_bytes` (64 KiB; 1 MiB on a fast link, `wiiide.ps.link_probe.PieceRule`) on the wire, i.e. that
    x the fixed lossy codec's ratio under ``fixed:<lossy codec>`` (both directions use it after the
    warm-up), `wire_bytes` otherwise (`wiiide.ps.partition.finest_raw_bytes`)."""
    return finest_raw_bytes(fixed_lossy_ratio(cfg.compression, RATIO_SAMPLE_NUMEL), wire_bytes)


RATIO_SAMPLE_NUMEL = 65536  # values encoded to learn a fixed lossy codec's ratio (fixed_lossy_ratio)


def num_shards(cfg: RunConfig) -> int:
    """The shard count `cfg.ps_shards` means for this run's nodes (coordinator + workers). Raises ConfigError."""
    return resolve_shards(cfg.ps_shards, cfg.num_workers + 1)

def _piece_rule(coord, workers) -> tuple[PieceRule, dict | None]:
    """How this run cuts its shards' ranges (`wiiide.ps.link_probe.piece_rule`) and, under
    ``partitions_per_shard: auto``, the link probe's record for the report (None otherwise).
    Raises NodeFailure when a worker is lost or misbehaves during the probe."""
    cfg = coord.cfg
    if cfg.partitions_per_shard != "auto":
        return link_probe.piece_rule(cfg.partitions_per_shard, None, cfg.piece_link_s), None
    probes = []
    for w in workers:
        try:
            probes.append(link_probe.probe_link(w.conn))
        except Exception as exc:
            coord.drop(w, exc)
            raise NodeFailure(f"lost worker {w.rank} ({w.node_id}) during the link probe: {type(exc).__name__}: "
                              f"{exc}", EXIT_PEER_LOST) from None
    rate_bps = link_probe.link_rate_bps(probes)
    rule = link_probe.piece_rule("auto", rate_bps, cfg.piece_link_s)
    coord.log.info("link probe: %.0f Mbit/s (the slowest of %d workers' links): up to %d pieces per shard of "
                   "%d KiB and up on the wire (about %g ms on the link)", rate_bps / 1e6, len(probes),
                   rule.per_shard, rule.finest_wire_bytes // 1024, cfg.piece_link_s * 1e3)
    return rule, {"rate_bps": round(rate_bps), "piece_link_s": cfg.piece_link_s,
                  "probe_bytes": link_probe.PROBE_BYTES,
                  "workers": {str(w.rank): p.record() for w, p in zip(workers, probes)}}

def _plan_state(plan, numel: int) -> tuple[int, np.ndarray | None]:
    """The plan's start step and momentum (a restored checkpoint's; None on a fresh start).

    Raises:
        ProtocolError: a start step that is not an integer 0..1e15, or a momentum of another shape.
    """
    start_step = plan.meta.get("start_step", 0)
    if type(start_step) is not int or not 0 <= start_step <= 10**15:  # noqa: E721
        raise ProtocolError(f"ps_plan: start_step must be an integer 0..1e15, got {start_step!r:.40}")
    names = [t.name for t in plan.tensors]
    if "momentum" not in names:
        return start_step, None
    momentum = plan.tensor("momentum")
    if momentum.shape != (numel,) or momentum.dtype != np.float32:
        raise ProtocolError(f"ps_plan: momentum of shape {momentum.shape} {momentum.dtype}, expected ({numel},) float32")
    return start_step, momentum.copy()


def _plan_partitions(meta: dict, numel: int, k: int) -> list[Partition]:
    rows = meta.get("partitions")
    if not isinstance(rows, list) or not rows:
        raise ProtocolError("ps_plan: partitions must be a non-empty list")
    partitions, at = [], 0
    for i, row in enumerate(rows):
        if (not isinstance(row, list) or len(row) != 3 or any(type(v) is not int for v in row)  # noqa: E721
                or row[0] != at or row[1] <= row[0] or not 0 <= row[2] < k):
            raise ProtocolError(f"ps_plan: partition {i} is {row!r:.80}; partitions must tile the vector in order")
        partitions.append(Partition(i, row[0], row[1], row[2]))
        at = row[1]
    if at != numel:
        raise ProtocolError(f"ps_plan: partitions cover {at} of {numel} parameters")
    return partitions


def _plan_addresses(meta: dict, k: int, coordinator_host: str) -> list[tuple[str, int, str]]:
    """The plan's shard addresses as (host, port, TLS name): [host, port, name] rows, "" for the
    coordinator's host (`coordinator_host`) or for a name that is the host. Raises ProtocolError."""
    rows = meta.get("shards")
    if not isinstance(rows, list) or len(rows) != k:
        raise ProtocolError(f"ps_plan: shards must list {k} addresses")
    out = []
    for row in rows:
        if not (isinstance(row, list) and len(row) == 3 and all(isinstance(v, str) and len(v) <= 255 for v in row[::2])
                and type(row[1]) is int and 1 <= row[1] <= 65535):  # noqa: E721
            raise ProtocolError(f"ps_plan: bad shard address {row!r:.80}")
        out.append((row[0] or coordinator_host, row[1], row[2]))
    return out


def _seconds(value) -> float | None:
    """A worker's reported seconds (``step_done``'s ``compute_s``) when finite and >= 0, else None (a
    worker of an older version, or a bad value: the figure is left out, the step goes on)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf"):
        return float(value)
    return None


def _peer_host(conn: Connection) -> str:
    try:
        return str(conn.sock.getpeername()[0])
    except OSError as exc:
        raise ProtocolError(f"{conn.name}: no peer address: {exc}") from None


def _receive(coord, w, kind: str):
    """One message of `kind` from worker `w`; a failure drops it and raises (the run cannot go on), and so
    does a worker's ``ps_failed`` (one of its shards failed: it waits for the ``stop``)."""
    try:
        msg = w.conn.receive([kind, PS_FAILED])
    except Exception as exc:
        coord.drop(w, exc)
        raise NodeFailure(f"lost worker {w.rank} ({w.node_id}): {type(exc).__name__}: {exc}", EXIT_PEER_LOST) from None
    if msg.kind == PS_FAILED:
        raise NodeFailure(f"worker {w.rank}: {str(msg.meta.get('cause'))[:400]}", EXIT_PEER_LOST)
    return msg


def batch_frame(policy, data: Dataset, handout: str, step: int, idx: np.ndarray):
    """The frame of one worker's batch for `step`: ``batch_indices`` (int64 (b,) indices into the training
    split) when its `handout` is ``indices``, else ``batch`` with the samples (x, y), encoded by the
    coordinator's `policy` (a `wiiide.codecs.policy.CompressionPolicy`)."""
    if handout == "indices":
        return encode_message("batch_indices", {"step": step}, [WireTensor("idx", np.asarray(idx, np.int64))])
    return policy.encode("batch", {"step": step}, [WireTensor("x", data.x_train[idx]), WireTensor("y", data.y_train[idx])])
