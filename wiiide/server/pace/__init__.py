"""Workers at their own pace: the mechanisms any parameter server (central or sharded) can use.

- `staleness`: the stale synchronous parallel clock (Ho et al., NIPS 2013) and the staleness of an
  applied update, with its optional scaling (Zhang et al., IJCAI 2016);
- `outer`: local SGD on a worker (H local steps, then a model delta) and the server's outer step over
  the deltas (plain averaging, or Nesterov momentum as in DiLoCo, Douillard et al. 2023);
- `adaptive`: per-worker batch sizes that follow each worker's measured samples/s with the global
  batch held constant;
- `record`: what a run records of all this (staleness histogram, clock gap, per-worker samples and
  batch sizes over time);
- `feedback`: error-feedback residuals of a lossy direction (push: worker -> server, pull: server ->
  worker), kept by the sharded servers (`wiiide.server.ps`) and by the compressed pulls of `compress`;
- `server`: the central parameter server's loop when workers go at their own pace
  (`staleness_bound` != 0, `local_steps` > 1 or `adaptive_batch`).
"""
