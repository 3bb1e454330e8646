"""The run stage: runs one point's configuration to its end on a cluster backend.

- `backend`: the `Backend` protocol (start / poll / stop / collect / teardown), `RunResult`,
  `PhaseClock`, judging a run from node metrics and exit codes;
- `loop`: `run_point`, the one poll / timeout / fault / judge loop every backend runs under;
- `compose` (``docker``: compose.yaml's services through the Engine API, `compose_file` reads the
  file), `local` (processes on 127.0.0.1), `swarm/` (``swarm``: one Docker Swarm stack per run,
  generated from compose.yaml; cluster, stack, tasks, backend);
- `docker_client` (the one Docker client), `image`, `shaping` + `tc_exec` (links and limits),
  `faults`, `sysctls`, `stats` (docker CLI formulas), `machine` (host and commit facts); the
  scheduler trace of ``sweep --sched-trace`` is `harness.analysis.sched_trace`.
"""
