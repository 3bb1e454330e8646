"""A worker lost under async or a staleness bound on the sharded servers: the state the next incarnation starts from.

In synchronous rounds (and rounds of adaptive batches) every worker's copy at the barrier's step is the
same, so the next incarnation starts from one survivor's copy (`wiiide.server.ps.membership`). When every push
is applied as it arrives (``staleness_bound`` s >= 1 or ``async``, `wiiide.server.ps.shard_pacing`) there
is no such step: each worker's copy holds what its own last pulls brought, and the newest state of a
partition is on the shard that owns it. So the coordinator assembles the state partition by
partition (`assemble`):

- a partition whose shard survived (the coordinator's own, or the old shard of a worker still
  connected, which sends its partitions with its answer, `worker_answer`) starts from that shard's
  values and momentum: nothing it applied is lost;
- a partition whose shard was lost starts from the newest copy of it a survivor holds: every pull
  carries the partition's ``version`` (its updates so far), each worker keeps the versions of its
  newest copy (`wiiide.server.ps.survivor.StepSnapshots`, ``versions``), and the highest wins (ties: the
  lowest rank). What is lost are the updates of that partition after that pull (how many, only the
  lost shard knew; the record gives the version each such partition restarts from) and its momentum,
  which restarts at zero, as the error-feedback residuals do.

This is the asynchronous server's own reading of a lost push: under async SGD (Dean et al. 2012) a
push that never arrived is as if that worker had been slower, so the run loses only the lost shard's
updates since the freshest pull, never a whole round. The next incarnation's shards and every worker
start from the assembled vector, so their digests agree as in rounds (`Membership.check`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from wiiide.server.ps.digest import params_digest
from wiiide.server.ps.partition import Partition
from wiiide.wire.messages import WireTensor

MAX_VERSION = 2**53  # a version above this is malformed


def worker_answer(meta: dict, copy: np.ndarray | None, versions: Sequence[int | None], shard) -> list[WireTensor]:
    """Fill `meta` (a ``ps_state``'s) for an on-arrival recovery and return its tensors: the worker's newest
    copy (`copy`, float32 (numel,), tensor ``params``; None: sent without), ``versions`` (the copy's
    partition versions), and its closed `shard`'s partitions (`wiiide.server.ps.shard.ShardServer`, or
    None): ``owned`` lists [index, version] with tensor ``s<index>`` (float32, the partition's numel) and,
    with a momentum buffer, ``m<index>`` (``momentum`` lists those indices)."""
    tensors = [WireTensor("params", copy)] if copy is not None else []
    meta["versions"] = list(versions)
    meta["owned"], meta["momentum"] = [], []
    for index, version, buffer, _, values in (shard.partition_states() if shard is not None else []):
        meta["owned"].append([index, version])
        tensors.append(WireTensor(f"s{index}", values))
        if buffer is not None:
            meta["momentum"].append(index)
            tensors.append(WireTensor(f"m{index}", buffer))
    return tensors


@dataclass
class _Source:
    version: int
    values: np.ndarray
    momentum: np.ndarray | None


def _int(value) -> int | None:
    return value if type(value) is int and 0 <= value <= MAX_VERSION else None  # noqa: E721


def _shard_sources(meta: dict, msg, partitions: Sequence[Partition]) -> dict[int, _Source]:
    """The partitions a survivor's old shard sent (malformed entries left out)."""
    names = {t.name for t in msg.tensors}
    momentum = set(meta.get("momentum") or []) if isinstance(meta.get("momentum"), list) else set()
    out = {}
    for entry in meta.get("owned") or []:
        if not (isinstance(entry, list) and len(entry) == 2 and _int(entry[0]) is not None
                and entry[0] < len(partitions) and _int(entry[1]) is not None and f"s{entry[0]}" in names):
            continue
        index, version = entry
        values = msg.tensor(f"s{index}")
        if values.shape != (partitions[index].numel,) or values.dtype != np.float32:
            continue
        buffer = msg.tensor(f"m{index}") if index in momentum and f"m{index}" in names else None
        if buffer is not None and (buffer.shape != values.shape or buffer.dtype != np.float32):
            buffer = None
        out[index] = _Source(version, values.copy(), None if buffer is None else buffer.copy())
    return out


def assemble(partitions: Sequence[Partition], numel: int, own: list, answers: dict[int, tuple[dict, object]],
             with_momentum: bool) -> tuple[np.ndarray, np.ndarray | None, dict]:
    """The next incarnation's state (module docstring).

    Args:
        partitions: the lost incarnation's partitions; numel: the flat vector's length.
        own: the coordinator's closed shard's `partition_states` (index, version, momentum or None, the
            last gradient, values).
        answers: rank -> (``ps_state`` meta, message) of every survivor that answered.
        with_momentum: the run keeps momentum (``momentum`` > 0): return a momentum vector.

    Returns:
        (params float32 (numel,), momentum float32 (numel,) or None, the record: the count of partitions
        from shards, for each partition from a copy the rank and the version it restarts from, and
        ``momentum_kept``: the partitions whose momentum a surviving shard kept).

    Raises:
        ValueError: a partition that no shard kept and no survivor's copy holds.
    """
    sources: dict[int, _Source] = {}
    for index, version, buffer, _, values in own:
        sources[index] = _Source(version, values, buffer)
    for rank in sorted(answers):
        meta, msg = answers[rank]
        for index, source in _shard_sources(meta, msg, partitions).items():
            if index not in sources or source.version > sources[index].version:
                sources[index] = source
    from_shards = set(sources)
    copies = {}
    for rank in sorted(answers):
        meta, msg = answers[rank]
        versions = meta.get("versions")
        if "params" not in {t.name for t in msg.tensors} or not isinstance(versions, list) or len(versions) != len(partitions):
            continue
        params = msg.tensor("params")
        if params.shape == (numel,) and params.dtype == np.float32 and params_digest(params)["sha256"] == meta.get("sha256"):
            copies[rank] = (params, [_int(v) for v in versions])
    record = {"from_shards": len(from_shards), "from_copies": {}}
    for part in partitions:
        if part.index in from_shards:
            continue
        held = [(v[part.index], rank) for rank, (_, v) in copies.items() if v[part.index] is not None]
        if not held:
            raise ValueError(f"partition {part.index}: its shard was lost and no survivor's copy holds it")
        version, rank = max(held, key=lambda h: (h[0], -h[1]))
        sources[part.index] = _Source(version, copies[rank][0][part.start:part.stop].copy(), None)
        record["from_copies"][str(part.index)] = {"rank": rank, "version": version}
    params = np.empty(numel, np.float32)
    momentum = np.zeros(numel, np.float32) if with_momentum else None
    for part in partitions:
        source = sources[part.index]
        params[part.start:part.stop] = source.values
        if momentum is not None and source.momentum is not None:
            momentum[part.start:part.stop] = source.momentum
    record["momentum_kept"] = sum(1 for s in sources.values() if s.momentum is not None) if with_momentum else 0
    return params, momentum, record
