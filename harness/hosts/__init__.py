"""Several Docker hosts on one machine (``wiiide-lab hosts up|down|status``): containers that each run
their own dockerd, joined into one swarm, with a registry beside them that serves the node image.

- `harness.hosts.plan`: what to create, as pure data (names, labels, each container's settings, the
  placement of a stack's tasks over the hosts), and the refusal of a bad host count.
- `harness.hosts.image`: the host image (the project's debootstrap base + Debian's docker.io and
  docker-registry), cached by a digest of its inputs.
- `harness.hosts.engines`: bringing the hosts up and down on the outer engine (docker SDK), the swarm
  between them, pushing the node image to the registry and pulling it on every host, and `attach`:
  the engines of the hosts that run, for ``--backend swarm --hosts``.
- `harness.hosts.cli`: the ``hosts`` verb.

See docs/multi-host.md ("Several hosts on one machine").
"""
