"""Partitions of the flat parameter vector, and their assignment to server shards.

Like ps-lite (``src/postoffice.cc``: ``Postoffice::GetServerKeyRanges`` cuts the key space into one
contiguous range per server) a shard owns ranges of the flat float32 vector; like BytePS
(``docs/architecture.md``: tensors are partitioned into ``BYTEPS_PARTITION_BYTES`` pieces, 4 MB by
default, spread over the servers) big tensors are split and the pieces balanced by bytes over the
shards. Partitions here are contiguous slices of `wiiide.training.model.FlatParams` (``model.parameters()``
order), so small tensors next to each other are grouped into one partition and a partition may span
several tensors. Assignment: greedy, largest partition first, onto the shard with the fewest bytes so
far (LPT scheduling; its imbalance is at most one partition's size).

Equal bytes per shard are not equal work per link, though: the coordinator's shard pushes nothing
(the coordinator is not a worker), so its link carries only its pulls, while a worker's carries its
pushes to every other shard too. `egress_shard_weights` gives each shard the share that levels every
node's egress (the link model below), and ``partition_flat(..., weights=...)`` cuts the vector into one
contiguous range per shard of exactly that share (ps-lite's key range per server), each range into
partitions of at most `partition_bytes`. `pipeline_shard_weights` (the default layout) adds the one
dependency the egress model leaves out, that a shard pulls only once its pushes are in, and puts the
coordinator's range at the tail of the vector (``order``), which backward reaches first. Measured at 8 workers and 100 Mbit/s (studies/ps-vs-ddp-cc/): with equal bytes, 19 partitions of 64 KiB over 9 shards left one worker with 3 and it carried
2.34 MB a step against the others' 1.96 MB, which set the step.

``partition_placement: interleaved`` keeps every shard's share and pieces but deals the pieces into the
vector in turns (shard 1's first, shard 2's first, ..., then every shard's second), as BytePS spreads a
tensor's partitions over its servers: backward's consecutive pieces then go to different shards, which
is what ordered pushes (``push_schedule: ordered``) need, since every worker pushes the same piece at
about the same time and that piece's shard alone sends its pulls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from wiiide.errors import ConfigError

FLOAT32_BYTES = 4
# `partitions_per_shard` cuts a shard's range no finer than this: pieces of about 64 KiB and up. Measured
# (studies/partitions-per-shard/): the digits model at 8 workers in 33 KB pieces (4 per shard) ran 0.87x DDP
# with ordered pushes on CUBIC where 64 KiB pieces had run 1.10x; at 4 workers 4 pieces of 55 KB ran 1.10x.
PER_SHARD_FINEST_BYTES = 64 * 1024


def range_partition_count(nbytes: float, partition_bytes: float, per_shard: int = 1,
                          finest_bytes: float = PER_SHARD_FINEST_BYTES) -> int:
    """Partitions a shard's range of `nbytes` is cut into: enough that none exceeds `partition_bytes`, and
    at least `per_shard` while each piece stays about `finest_bytes` or more (at least one; default
    `PER_SHARD_FINEST_BYTES`; under a lossy codec `finest_raw_bytes`). The caller caps it at the range's
    elements."""
    return max(1, math.ceil(nbytes / partition_bytes), min(per_shard, math.ceil(nbytes / finest_bytes)))


def finest_raw_bytes(wire_ratio: float | None, wire_bytes: int = PER_SHARD_FINEST_BYTES) -> int:
    """The finest piece `partitions_per_shard` cuts a range into, in raw float32 bytes, for pieces of about
    `wire_bytes` on the wire (default `PER_SHARD_FINEST_BYTES`; 1 MiB on a fast link,
    `wiiide.server.ps.link_probe`): that size x `wire_ratio` (raw / sent bytes of the run's fixed lossy codec,
    `wiiide.codecs.policy.fixed_lossy_ratio`; None or below 1: 1, the pieces' raw bytes).

    Why on the wire: a piece pays a frame each way on every node it passes through (a codec call, a
    header, a hand-off between threads; on this machine the sum over the nodes came to about 0.3 ms of
    CPU a piece, studies/lossy-partitions/), and what it buys, a shard answering
    one piece while the next is still on its way, scales with the piece's time on the link, i.e. its
    bytes on the wire. lloyd2 (15x) on the digits model makes a shard's 0.24 MB range one piece.
    """
    return max(wire_bytes, round(wire_bytes * (wire_ratio or 1.0)))


@dataclass(frozen=True)
class Partition:
    """One contiguous slice ``[start, stop)`` (elements, not bytes) of the flat float32 vector, owned by `shard`."""

    index: int
    start: int
    stop: int
    shard: int

    @property
    def numel(self) -> int:
        """Elements in the partition."""
        return self.stop - self.start

    @property
    def nbytes(self) -> int:
        """Bytes of the partition as float32."""
        return self.numel * FLOAT32_BYTES


def resolve_shards(ps_shards: str | int, num_nodes: int) -> int:
    """The number of shards `ps_shards` means with `num_nodes` nodes (coordinator + workers).

    ``"all"`` is `num_nodes`; an integer k (or its text) must be in 1..num_nodes.

    Raises:
        ConfigError: anything else, naming what is allowed.
    """
    if isinstance(ps_shards, str) and ps_shards.strip().lower() == "all":
        return num_nodes
    try:
        k = int(ps_shards)
    except (TypeError, ValueError):
        k = 0
    if isinstance(ps_shards, bool) or not 1 <= k <= num_nodes:
        raise ConfigError(f"config field 'ps_shards': bad value {ps_shards!r}; allowed: 1, all, or an integer "
                          f"1..{num_nodes} (the nodes: coordinator + workers)")
    return k


def partition_flat(numel: int, num_shards: int, partition_bytes: int,
                   weights: Sequence[float] | None = None, order: Sequence[int] | None = None,
                   per_shard: int = 1, interleaved: bool = False,
                   finest_bytes: float = PER_SHARD_FINEST_BYTES) -> list[Partition]:
    """Cut ``[0, numel)`` into partitions of at most `partition_bytes` (float32) and at least `num_shards`
    of them (so a small model spreads over every shard too), `per_shard` x `num_shards` while they stay
    about `finest_bytes` or more (pieces a shard can answer one after the other), near-equal in
    size, and assign them to shards.

    Args:
        numel: elements of the flat float32 vector (>= 1).
        num_shards: shards (>= 1).
        partition_bytes: the largest partition in bytes (>= 4).
        weights: `num_shards` shares (`egress_shard_weights`, `pipeline_shard_weights`): cut by
            `partition_by_weights` instead, when there is at least one element per shard; None: equal
            bytes (LPT).
        order: with `weights`, the shards' ranges in vector order (`partition_by_weights`).
        per_shard: the fewest partitions per shard (>= 1; ``partitions_per_shard``).
        interleaved: deal the partitions to the shards in turns (``partition_placement: interleaved``):
            with `weights` as `partition_by_weights` does; with equal bytes partition i goes to shard
            i mod `num_shards` instead of by LPT.
        finest_bytes: the smallest piece `per_shard` cuts down to (raw bytes; `finest_raw_bytes`).

    Returns:
        Partitions in vector order (``index`` 0..P-1), covering every element exactly once; P =
        max(num_shards, `range_partition_count` of the whole vector with per_shard x num_shards), at most
        numel (with `weights`: per shard's range, `partition_by_weights`).

    Raises:
        ValueError: a count or size below its minimum.
    """
    if numel < 1 or num_shards < 1 or partition_bytes < FLOAT32_BYTES or per_shard < 1:
        raise ValueError(f"numel {numel}, num_shards {num_shards}, partition_bytes {partition_bytes}, per_shard "
                         f"{per_shard}: each must be >= 1 (partition_bytes >= 4)")
    if weights is not None and numel >= num_shards:
        if len(weights) != num_shards:
            raise ValueError(f"{len(weights)} weights for {num_shards} shards")
        return partition_by_weights(numel, weights, partition_bytes, order, per_shard, interleaved, finest_bytes)
    count = min(numel, max(num_shards, range_partition_count(numel * FLOAT32_BYTES, partition_bytes,
                                                             num_shards * per_shard, finest_bytes)))
    bounds = [numel * i // count for i in range(count + 1)]
    shards = ([i % num_shards for i in range(count)] if interleaved else
              assign_by_bytes([(bounds[i + 1] - bounds[i]) * FLOAT32_BYTES for i in range(count)], num_shards))
    return [Partition(i, bounds[i], bounds[i + 1], shards[i]) for i in range(count)]


def egress_shard_weights(num_shards: int, num_workers: int) -> list[float]:
    """Relative share of the parameters for each shard (shard 0 on the coordinator, shard s on worker s)
    that levels the bytes every node sends per step (its egress; ingress is symmetric).

    Link model, per step, M the model's bytes, W workers, k shards, s_j shard j's bytes, one's own shard
    on loopback (free): a worker with a shard sends (M - s_j) of pushes and (W - 1) s_j of pulls,
    M + (W - 2) s_j; a worker without one sends M; the coordinator sends W s_0. Equal worker shares s_w
    and W s_0 = M + (W - 2) s_w with s_0 + (k - 1) s_w = M give s_0 / s_w = (k + W - 3) / (W - 1):
    2 with a shard on every node (``ps_shards: all``), so each worker sends 2WM / (W + 2) instead of
    (2W - 1)M / (W + 1) with equal shares (1.60 M against 1.67 M at W = 8; ring all-reduce: 2(W-1)/W M).
    With one worker every split costs the same (weights 1).

    Returns:
        `num_shards` weights (float > 0): shard 0's first, then 1.0 for each worker's shard.
    Raises:
        ValueError: num_shards < 1 or num_workers < 1.
    """
    if num_shards < 1 or num_workers < 1:
        raise ValueError(f"num_shards {num_shards}, num_workers {num_workers}: each must be >= 1")
    w0 = (num_shards + num_workers - 3) / (num_workers - 1) if num_workers >= 2 else 1.0
    return [max(w0, 1e-3)] + [1.0] * (num_shards - 1)


def pipeline_shard_weights(num_shards: int, num_workers: int, model_bytes: float = 0.0,
                           partition_bytes: float = 0.0, per_shard: int = 1,
                           finest_bytes: float = PER_SHARD_FINEST_BYTES) -> list[float]:
    """Shares like `egress_shard_weights`, for the layout that puts the coordinator's range at the tail
    of the vector (``partition_balance: pipeline``), with the one dependency that model leaves out: a
    shard pulls a partition only once every push for it is in.

    Backward produces the last layers' gradients first, so every worker pushes the coordinator's
    partitions first on its connection to the coordinator; but it pushes to every shard at once (one
    connection and one sender thread per shard), and its link gives each of its k - 1 busy connections
    R / (k - 1) (TCP's fair share). The coordinator's first partition, m bytes, is in after
    (k - 1) m / R; from then on its pulls keep its link busy (its later partitions arrive at W R / (k - 1)
    >= R while it sends each W times), and it is done after ((k - 1) m + W s_0) / R. A worker with a shard
    sends M + (W - 2) s_w, pushes and pulls back to back. Levelling the two, with s_0 + (k - 1) s_w = M
    and the coordinator's range cut into c partitions of m = s_0 / c (c = `range_partition_count` of s_0):
    with a = W + (k - 1) / c, s_w = (a - 1) M / (a (k - 1) + W - 2). With a shard on every node at 8
    workers and the digits model in 64 KiB partitions (c = 3): s_0 / s_w = 1.44, every node done after
    1.62 M / R. With m -> 0 (`partition_bytes` 0) these are the egress shares, (k + W - 3) / (W - 1).
    The earlier form, (k + W - 3) / W (1.75 at W = 8), assumed the coordinator's partitions in after
    s_0 / R, as if the pushes went one shard after the other. These weights give the shortest round of
    the fluid model of the links (`harness.analysis.round_model.sharded_round_s`; a unit test checks it);
    measured (docs/engines.md, "Sharded servers"), they ran level with the earlier ones with 64 KiB
    partitions and 3 % faster for the 26 MB model in 4 MiB partitions, where the model said 9 % and 15 %.

    Args:
        num_shards: k >= 1; num_workers: W >= 1.
        model_bytes: M, the flat vector's bytes; partition_bytes: the largest partition (bytes; 0: m -> 0).
        per_shard: the fewest partitions per shard (`partition_flat`); finest_bytes: their smallest size.
    Returns:
        `num_shards` weights (float > 0): shard 0's first, then 1.0 for each worker's shard.
    Raises:
        ValueError: num_shards < 1 or num_workers < 1.
    """
    if num_shards < 1 or num_workers < 1:
        raise ValueError(f"num_shards {num_shards}, num_workers {num_workers}: each must be >= 1")
    if num_shards == 1:
        return [1.0]
    if num_workers < 2:
        return [1.0] * num_shards
    if model_bytes <= 0 or partition_bytes <= 0:
        return egress_shard_weights(num_shards, num_workers)
    k, w, m_bytes = num_shards, num_workers, float(model_bytes)
    count = 1
    while True:  # the fewest partitions of the coordinator's range that its own size agrees with
        a = w + (k - 1) / count
        s_w = (a - 1) * m_bytes / (a * (k - 1) + w - 2)
        s_0 = m_bytes - (k - 1) * s_w
        wanted = range_partition_count(s_0, partition_bytes, per_shard, finest_bytes) if s_0 > 0 else count
        if wanted <= count:
            break
        count = wanted
    return [max(s_0 / s_w, 1e-3)] + [1.0] * (k - 1)


def partition_by_weights(numel: int, weights: Sequence[float], partition_bytes: int,
                         order: Sequence[int] | None = None, per_shard: int = 1,
                         interleaved: bool = False, finest_bytes: float = PER_SHARD_FINEST_BYTES) -> list[Partition]:
    """One contiguous range of ``[0, numel)`` per shard, of ``numel x weight / sum`` elements (rounded;
    every shard at least one element), each range cut into the fewest near-equal partitions of at most
    `partition_bytes` (float32), and at least `per_shard` while the pieces stay about
    `finest_bytes` or more (`range_partition_count`; never more than the range's elements).
    `order`: the shards in vector order (a permutation of their ids; None: 0, 1, ...), e.g.
    ``[1, .., k - 1, 0]`` puts shard 0's range at the tail.

    `interleaved` (``partition_placement: interleaved``): the same pieces, of the same sizes per shard, are
    dealt into the vector in turns instead of one range per shard: every shard's first piece (in `order`),
    then every shard's second, and so on (a shard with fewer pieces drops out of the later turns). BytePS
    spreads a tensor's partitions over the servers the same way (``docs/architecture.md``), so that the
    pieces backward makes one after the other go to different servers: with ordered pushes every worker
    sends to one shard at a time, and in contiguous ranges that shard's link alone carries the pulls
    that follow.

    Returns partitions in vector order (``index`` 0..P-1) covering every element exactly once.
    Raises:
        ValueError: numel < len(weights), a weight <= 0, partition_bytes < 4, or `order` not a
            permutation of the shard ids.
    """
    if (numel < len(weights) or not weights or min(weights) <= 0 or partition_bytes < FLOAT32_BYTES
            or per_shard < 1):
        raise ValueError(f"numel {numel} (>= one per shard), weights {list(weights)} (> 0), partition_bytes "
                         f"{partition_bytes} (>= 4), per_shard {per_shard} (>= 1)")
    order = list(range(len(weights))) if order is None else list(order)
    if sorted(order) != list(range(len(weights))):
        raise ValueError(f"order {order}: a permutation of 0..{len(weights) - 1}")
    total, acc, ends = float(sum(weights)), 0.0, []
    for shard in order:
        acc += weights[shard]
        ends.append(round(numel * acc / total))
    ends[-1] = numel
    for i in range(len(ends)):  # at least one element per shard, and room for the shards after it
        low = (ends[i - 1] if i else 0) + 1
        ends[i] = min(max(ends[i], low), numel - (len(ends) - 1 - i))
    pieces: list[list[int]] = []  # per shard in `order`: its pieces' element counts
    start = 0
    for stop in ends:
        n = stop - start
        count = min(n, range_partition_count(n * FLOAT32_BYTES, partition_bytes, per_shard, finest_bytes))
        pieces.append([n * (j + 1) // count - n * j // count for j in range(count)])
        start = stop
    if interleaved:
        turns = [(shard, sizes[j]) for j in range(max(map(len, pieces)))
                 for shard, sizes in zip(order, pieces) if j < len(sizes)]
    else:
        turns = [(shard, size) for shard, sizes in zip(order, pieces) for size in sizes]
    out: list[Partition] = []
    start = 0
    for shard, size in turns:
        out.append(Partition(len(out), start, start + size, shard))
        start += size
    return out


def plan_partitions(numel: int, num_shards: int, num_workers: int, partition_bytes: int,
                    balance: str = "pipeline", per_shard: int = 1, placement: str = "contiguous",
                    finest_bytes: float = PER_SHARD_FINEST_BYTES,
                    table: tuple[int, int] | None = None) -> list[Partition]:
    """The partitions a sharded run uses (`partition_flat`) for the config's ``partition_balance``:
    ``pipeline`` (`pipeline_shard_weights`, the coordinator's range at the tail), ``egress``
    (`egress_shard_weights`) or ``bytes`` (equal bytes, LPT), at least `per_shard` per shard
    (``partitions_per_shard``), and ``partition_placement``: ``contiguous`` (one range per shard) or
    ``interleaved`` (dealt in turns, `partition_by_weights`), pieces no finer than `finest_bytes`
    (`finest_raw_bytes`). `table`: (rows, dim) of an embedding table at the head of the vector whose
    rows travel sparse (`wiiide.server.ps.sparse_rows`): the cuts are then moved to its row boundaries
    (`align_to_rows`), in contiguous ranges whatever `placement` (interleaving deals a backward's dense
    pieces to different shards; a row partition's push is its touched rows, and one range per shard
    makes it one row partition, two frames a step instead of two a piece).

    Raises:
        ValueError: an unknown `balance` or `placement`, or a count or size `partition_flat` refuses.
    """
    if table is not None:
        return align_to_rows(plan_partitions(numel, num_shards, num_workers, partition_bytes, balance, per_shard,
                                             "contiguous", finest_bytes), table[0] * table[1], table[1])
    if placement not in ("contiguous", "interleaved"):
        raise ValueError(f"partition_placement {placement!r}: one of contiguous, interleaved")
    interleaved = placement == "interleaved"
    if balance == "pipeline":
        weights = pipeline_shard_weights(num_shards, num_workers, numel * FLOAT32_BYTES, partition_bytes, per_shard,
                                         finest_bytes)
        return partition_flat(numel, num_shards, partition_bytes, weights, [*range(1, num_shards), 0], per_shard,
                              interleaved, finest_bytes)
    if balance == "egress":
        return partition_flat(numel, num_shards, partition_bytes, egress_shard_weights(num_shards, num_workers),
                              per_shard=per_shard, interleaved=interleaved, finest_bytes=finest_bytes)
    if balance == "bytes":
        return partition_flat(numel, num_shards, partition_bytes, per_shard=per_shard, interleaved=interleaved,
                              finest_bytes=finest_bytes)
    raise ValueError(f"partition_balance {balance!r}: one of pipeline, egress, bytes")


def align_to_rows(partitions: Sequence[Partition], table_numel: int, row_numel: int) -> list[Partition]:
    """`partitions` (in vector order, tiling it) with every cut inside a table of `table_numel` values at
    the head of the vector moved to the nearest row boundary (a multiple of `row_numel`), and a cut at
    the table's end, so that each partition is whole rows of the table or lies after it. A partition
    that shrinks to nothing is dropped; the others keep their shard, and are numbered again. Neighbours
    in the table owned by one shard are merged: a row partition's push and pull are its touched rows
    (a few KB however many rows it has), so cutting a range buys no overlap and costs two frames a step.

    Raises:
        ValueError: the table does not fit the vector or is not whole rows, or a shard that owned a
            partition owns none after the cuts move (its share was under one row).
    """
    numel = partitions[-1].stop if partitions else 0
    if row_numel < 1 or table_numel % row_numel or not 0 < table_numel <= numel:
        raise ValueError(f"a table of {table_numel} values in rows of {row_numel} does not fit {numel} values")
    pieces: list[tuple[int, int, int]] = []  # (start, stop, shard) after the cuts move

    def add(start: int, stop: int, shard: int) -> None:
        if stop <= table_numel and pieces and pieces[-1][2] == shard:  # the same shard's rows: one partition
            pieces[-1] = (pieces[-1][0], stop, shard)
        else:
            pieces.append((start, stop, shard))

    start = 0
    for p in partitions:
        stop = p.stop if p.stop >= table_numel else min(round(p.stop / row_numel) * row_numel, table_numel)
        if start < table_numel < stop:  # the table's end cuts this one
            add(start, table_numel, p.shard)
            start = table_numel
        if stop > start:
            add(start, stop, p.shard)
            start = stop
    lost = {p.shard for p in partitions} - {shard for _, _, shard in pieces}
    if lost:
        raise ValueError(f"shards {sorted(lost)} own less than one {row_numel}-value row of the table: fewer "
                         "shards, or a larger table")
    return [Partition(i, a, b, shard) for i, (a, b, shard) in enumerate(pieces)]


def assign_by_bytes(sizes_bytes: Sequence[int], num_shards: int) -> list[int]:
    """Shard of each item: largest first onto the least-loaded shard (ties: the lower shard id).

    Every shard gets an item when there are at least `num_shards` items. The loads differ by at most
    the largest item (Graham's LPT bound).
    """
    loads = [0] * num_shards
    out = [0] * len(sizes_bytes)
    for i in sorted(range(len(sizes_bytes)), key=lambda i: (-sizes_bytes[i], i)):
        shard = min(range(num_shards), key=lambda s: (loads[s], s))
        out[i] = shard
        loads[shard] += sizes_bytes[i]
    return out


def shard_loads_bytes(partitions: Sequence[Partition], num_shards: int) -> list[int]:
    """Bytes owned by each shard."""
    loads = [0] * num_shards
    for p in partitions:
        loads[p.shard] += p.nbytes
    return loads
