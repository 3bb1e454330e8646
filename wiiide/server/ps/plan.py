"""What a sharded run's set-up decides and checks: the data set's fingerprint, the shard count, the
pieces a shard's range is cut into (the link probe's rule), and the worker's reading of the
coordinator's ``ps_plan`` (partitions, shard addresses, start step and momentum, the incarnation's
workers), the coordinator's one-message receive from a worker during set-up, the frame of a worker's
batch, a restarted coordinator's restore of the newest step complete on every shard (`_restore`) and
the plan's record (`plan_record`). The loops that use them are in `wiiide.server.ps.session` (set-up,
barrier) and `wiiide.server.ps.paced` (workers at their own pace).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from wiiide.codecs.policy import fixed_lossy_ratio
from wiiide.config import RunConfig
from wiiide.training.data import Dataset
from wiiide.errors import ProtocolError
from wiiide.training.model import FlatParams
from wiiide.wire.node import EXIT_PEER_LOST, Connection, NodeFailure
from wiiide.server.ps import link_probe
from wiiide.server.ps.checkpoints import ShardsRestored, restore_shards
from wiiide.server.ps.digest import params_digest
from wiiide.server.ps.link_probe import PieceRule
from wiiide.wire.encode import encode_message
from wiiide.wire.messages import WireTensor
from wiiide.server.ps.partition import PER_SHARD_FINEST_BYTES, Partition, finest_raw_bytes, resolve_shards, shard_loads_bytes

PS_FAILED = "ps_failed"  # worker -> coordinator: one of my shards failed ({"cause"}); the coordinator orders what next


def data_fingerprint(data: Dataset) -> str:
    """SHA-256 (first 32 hex characters) of the training split's bytes (x then y): equal on two nodes
    exactly when a batch's indices mean the same samples on both."""
    digest = hashlib.sha256()
    digest.update(np.ascontiguousarray(data.x_train).tobytes())
    digest.update(np.ascontiguousarray(data.y_train).tobytes())
    return digest.hexdigest()[:32]


def partition_finest_bytes(cfg: RunConfig, wire_bytes: int = PER_SHARD_FINEST_BYTES) -> int:
    """The smallest piece `cfg.partitions_per_shard` cuts a shard's range into (raw bytes): about
    `wire_bytes` (64 KiB; 1 MiB on a fast link, `wiiide.server.ps.link_probe.PieceRule`) on the wire, i.e. that
    x the fixed lossy codec's ratio under ``fixed:<lossy codec>`` (both directions use it after the
    warm-up), `wire_bytes` otherwise (`wiiide.server.ps.partition.finest_raw_bytes`)."""
    return finest_raw_bytes(fixed_lossy_ratio(cfg.compression, RATIO_SAMPLE_NUMEL), wire_bytes)


RATIO_SAMPLE_NUMEL = 65536  # values encoded to learn a fixed lossy codec's ratio (fixed_lossy_ratio)


def num_shards(cfg: RunConfig) -> int:
    """The shard count `cfg.ps_shards` means for this run's nodes (coordinator + workers). Raises ConfigError."""
    return resolve_shards(cfg.ps_shards, cfg.num_workers + 1)

def _piece_rule(coord, workers) -> tuple[PieceRule, dict | None]:
    """How this run cuts its shards' ranges (`wiiide.server.ps.link_probe.piece_rule`) and, under
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


def _restore(coord, plans: list[tuple[PieceRule, list[Partition]]], k: int,
             flat: FlatParams) -> tuple[ShardsRestored | None, PieceRule, list[Partition]]:
    """With checkpoints on: the newest step complete and verified on every shard
    (`wiiide.server.ps.checkpoints.restore_shards`) into `flat`, recorded in the coordinator's ``recovery``.

    `plans` are (piece rule, partitions): the run's own first, then the others ``auto`` may pick, tried
    in turn when the first's checkpoints do not restore. Returns the restored state (None: a fresh
    start) and the plan to run with: the one that restored, else the first. Files refused are those of
    the plan that restored, else of the first."""
    cfg, recovery = coord.cfg, coord.recovery
    rule, partitions = plans[0]
    if recovery is None or not recovery.enabled:
        return None, rule, partitions
    restored, refused = restore_shards(cfg, partitions, k, flat.numel, coord.log)
    tried = [partitions]
    for other_rule, other in plans[1:] if restored is None else []:
        if other in tried:  # another rule, the same pieces (a small model's ranges)
            continue
        tried.append(other)
        found, other_refused = restore_shards(cfg, other, k, flat.numel, coord.log)
        if found is not None:
            restored, refused, rule, partitions = found, other_refused, other_rule, other
            coord.log.info("restored with the plan its checkpoints were written with: up to %d pieces per shard "
                           "of %d KiB and up on the wire", rule.per_shard, rule.finest_wire_bytes // 1024)
            break
    recovery.store.refused.extend(refused)  # the coordinator's ``recovery.refused``
    if restored is None:
        if refused:
            coord.log.error("no sharded checkpoint is complete and verified on all %d shards (%d files refused); "
                            "starting from step 0", k, len(refused))
        return None, rule, partitions
    flat.load(torch.from_numpy(restored.params))
    recovery.restored_run = restored.run  # shard 0's run metadata: a paced run's handout (wiiide.server.ps.paced_checkpoints)
    recovery.mark_restored(restored.step, restored.paths[0], restored_files=restored.paths, restored_shards=k,
                           restored_params_sha256=params_digest(restored.params)["sha256"])
    return restored, rule, partitions


def read_workers(meta: dict, num_workers: int) -> list[int]:
    """The plan's worker ranks (``workers``: the incarnation's, `wiiide.server.ps.membership`); all of
    1..`num_workers` when it names none. Raises ProtocolError for a list that is not distinct ranks."""
    ranks = meta.get("workers")
    if ranks is None:
        return list(range(1, num_workers + 1))
    if (not isinstance(ranks, list) or not ranks or len(set(ranks)) != len(ranks)
            or any(type(r) is not int or not 1 <= r <= num_workers for r in ranks)):  # noqa: E721
        raise ProtocolError(f"ps_plan: workers must be distinct ranks 1..{num_workers}, got {ranks!r:.80}")
    return ranks


def plan_record(cfg: RunConfig, k: int, partitions: list[Partition], rule: PieceRule, probe: dict | None,
                addresses: list[tuple[str, int, str]], handout: dict[int, str], incarnation: int) -> dict:
    """The coordinator's ``ps`` record of the plan an incarnation runs with."""
    return {"ps_shards": k, "partitions": len(partitions), "partition_bytes": cfg.partition_bytes,
            "partitions_per_shard": rule.per_shard,
            "partition_finest_bytes": partition_finest_bytes(cfg, rule.finest_wire_bytes),
            "partitions_per_shard_setting": cfg.partitions_per_shard, "link_probe": probe,
            "partition_balance": cfg.partition_balance, "partition_placement": cfg.partition_placement,
            "shard_loads_bytes": shard_loads_bytes(partitions, k),
            "shard_hosts": [f"{h or 'coordinator'}:{p}" for h, p, _ in addresses],
            "batch_handout": {str(r): h for r, h in handout.items()}, "incarnation": incarnation}
