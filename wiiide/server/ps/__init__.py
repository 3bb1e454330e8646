"""Sharded parameter servers colocated with the workers (``ps_shards`` > 1).

- `partition`: cut the flat parameter vector into partitions and assign them to shards by bytes.
- `shard`: the shard server a node runs for the partitions it owns (averages pushes, owns their optimizer slice).
- `client`: a worker's (or the coordinator's) connections to every shard: pushes from backward hooks, pulls.
- `session`: the sharded training loop of the coordinator and of a worker (``ps_shards`` > 1).
- `membership`: a worker lost mid-run or back: the next incarnation over the nodes there, from a peer's copy.
- `links`: the sender loop of a shard link (both ends).
- `checkpoints`: a shard's checkpoint files and the restore of the newest step complete on every shard.

``ps_shards: 1`` never reaches this package: it is the central server of `wiiide.server.coordinator`.
"""
