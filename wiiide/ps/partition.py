"""Partitions of the flat parameter vector, and their assignment to server shards.

Like ps-lite (``src/postoffice.cc``: ``Postoffice::GetServerKeyRanges`` cuts the key space into one
contiguous range per server) a shard owns ranges of the flat float32 vector; like BytePS
(``docs/architecture.md``: tensors are partitioned into ``BYTEPS_PARTITION_BYTES`` pieces, 4 MB by
default, spread over the servers) big tensors are split and the pieces balanced by bytes over the
shards. Partitions here are contiguous slices of `wiiide.model.FlatParams` (``model.parameters()``
order), so small tensors next to each other are grouped into one partition and a partition may span
several tensors. Assignment: greedy, largest partition first, onto the shard with the fewest bytes so
far (LPT scheduling; its imbalance is at most one partition's size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from wiiide.errors import ConfigError

FLOAT32_BYTES = 4


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


def partition_flat(numel: int, num_shards: int, partition_bytes: int) -> list[Partition]:
    """Cut ``[0, numel)`` into partitions of at most `partition_bytes` (float32) and at least `num_shards`
    of them (so a small model spreads over every shard too), near-equal in size, and assign them to shards.

    Args:
        numel: elements of the flat float32 vector (>= 1).
        num_shards: shards (>= 1).
        partition_bytes: the largest partition in bytes (>= 4).

    Returns:
        Partitions in vector order (``index`` 0..P-1), covering every element exactly once; P =
        max(num_shards, ceil(numel * 4 / partition_bytes)), at most numel.

    Raises:
        ValueError: a count or size below its minimum.
    """
    if numel < 1 or num_shards < 1 or partition_bytes < FLOAT32_BYTES:
        raise ValueError(f"numel {numel}, num_shards {num_shards}, partition_bytes {partition_bytes}: "
                         "each must be >= 1 (partition_bytes >= 4)")
    count = min(numel, max(num_shards, math.ceil(numel * FLOAT32_BYTES / partition_bytes)))
    bounds = [numel * i // count for i in range(count + 1)]
    shards = assign_by_bytes([(bounds[i + 1] - bounds[i]) * FLOAT32_BYTES for i in range(count)], num_shards)
    return [Partition(i, bounds[i], bounds[i + 1], shards[i]) for i in range(count)]


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
