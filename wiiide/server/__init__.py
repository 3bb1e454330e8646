"""The parameter server: the coordinator and everything a server side keeps.

- `coordinator`: the central parameter server (rank 0), `joining`: its membership (join, admission,
  loss of a worker), `recovery` and `checkpoint`: its checkpoints and restart, `sparse`: sparse
  embedding rows (push touched rows, pull changed rows);
- `pace/`: workers at their own pace (staleness, local SGD, adaptive batches, error feedback);
- `ps/`: sharded servers colocated with the workers (``ps_shards`` > 1).

It imports the wire (`wiiide.wire`), the codecs, the training pieces (`wiiide.training`) and the shared
modules at the top of `wiiide`; the worker (`wiiide.worker`) imports it, never the other way.
"""
