"""The ``swarm`` backend (`harness.run.swarm.backend.SwarmBackend`): the same cluster as ``compose.yaml`` describes, as a Docker Swarm stack.

One run is one stack (`stack_name`), deployed with ``docker stack deploy`` from two files generated
into the run's folder (``<out_dir>/swarm/``), never kept by hand:

- ``stack-base.yaml``: compose.yaml as the stack loader accepts it (`stack_base`). The loader checks
  the v3 schema, which refuses compose.yaml's ``cpus`` / ``mem_limit`` (they become
  ``deploy.resources.limits``) and the long form of ``depends_on`` (dropped: a stack has no start
  order, workers retry connecting for ``connect_timeout_s``); ``restart`` and ``expose`` are dropped
  (``deploy.restart_policy`` replaces the first, an overlay needs no exposed port).
- ``stack-override.yaml``: what Swarm needs on top (`stack_override`): ``deploy.replicas`` of the
  workers, ``restart_policy: none`` (a finished or killed task is never replaced), ``endpoint_mode:
  dnsrr`` (the service name resolves to the task's own address, no IPVS virtual IP in the data path),
  the worker hostname ``worker-{{.Task.Slot}}`` (Swarm's template, moby#31218), and the project
  network as an *internal* overlay (VXLAN; internal: no ``docker_gwbridge`` leg, so ``eth0`` is the
  overlay in every task and the only interface tc shapes).

``deploy.mode: replicated-job`` (docker/cli#2907) was tried first: on Engine 20.10 its tasks got slot 0
and were named by node id, so ``{{.Task.Slot}}`` could not number the workers; ``replicated`` with
``restart_policy: none`` gives the same "a finished task stays finished" with slots 1..N.

Ranks come from the coordinator as on every backend; the coordinator is found by its service name
(``coordinator``) through Swarm's DNS. The HMAC secret is a Swarm secret the stack creates from a 0600
file (`harness.run.compose_project.write_cluster_secret`) and removes with the stack. Node metrics land in the
results folder through the same bind mount as Compose (on one node; see docs/multi-host.md for several).

The swarm itself: `ensure_swarm` runs ``docker swarm init --advertise-addr 127.0.0.1`` when the engine
is in no swarm and labels the node `STARTED_LABEL` = project; `leave_swarm_if_ours` leaves it again
(and removes ``docker_gwbridge``) only when that label is there. A swarm that existed is used and left
as it was.

Several nodes: a task's container lives on the node that ran it, and only that node's engine can
exec tc in it, pause it or stream its stats. `NodeEngines` maps a node's hostname to an Engine API
endpoint (``WIIIIIDE_SWARM_ENDPOINTS="host-a=ssh://root@host-a,host-b=tcp://10.0.0.2:2376"``); the
local node needs none. Tried on one node only.
"""

from harness.run.swarm.backend import SwarmBackend, cluster_down
from harness.run.swarm.stack import stack_name

__all__ = ["SwarmBackend", "cluster_down", "stack_name"]
