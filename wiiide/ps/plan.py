"""The ``ps_plan`` message as a worker reads it (`wiiide.ps.session`): the partitions and the shards'
addresses, checked, since they come off the network."""

from __future__ import annotations

from wiiide.errors import ProtocolError
from wiiide.ps.partition import Partition


def plan_partitions_of(meta: dict, numel: int, k: int) -> list[Partition]:
    """The plan's partitions (rows [start, stop, shard]) for a vector of `numel` values on `k` shards.

    Raises:
        ProtocolError: rows that do not tile the vector in order, or a shard outside 0..k-1.
    """
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


def plan_addresses_of(meta: dict, k: int, coordinator_host: str) -> list[tuple[str, int, str]]:
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
