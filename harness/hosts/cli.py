"""``wiiide-lab hosts up --hosts N | down | status``: several Docker hosts on this machine (see
`harness.hosts`). ``up`` also builds the node image when missing and pulls it on every host from the
registry, so that ``--backend swarm --hosts`` finds it there."""

from __future__ import annotations

import argparse
import os
from typing import Callable

from harness.errors import SpecError
from harness.hosts.plan import HOSTS_ENV, MAX_HOSTS, parse_host_count

Progress = Callable[[str], None]


ON_HOSTS_VERBS = ("sweep", "up", "down")  # the verbs that take --hosts (with --backend swarm)
ON_HOSTS_HELP = "with --backend swarm: on the hosts of `wiiide-lab hosts up` (their swarm, registry and engines)"


def register(sub) -> None:
    """Add the ``hosts`` verb to the CLI's subparsers `sub` (``argparse``'s subparsers action), and
    ``--hosts`` to `ON_HOSTS_VERBS` (already there: their handlers then call `use_hosts` first)."""
    p = sub.add_parser("hosts", help="several Docker hosts on this machine: containers with their own dockerd in "
                                     "one swarm, and a registry serving them the node image (up/down/status)")
    add_arguments(p)
    p.set_defaults(func=cmd_hosts)
    for verb in ON_HOSTS_VERBS:
        parser = sub.choices[verb]
        parser.add_argument("--hosts", action="store_true", help=ON_HOSTS_HELP)
        parser.set_defaults(func=_on_hosts(parser.get_default("func")))


def _on_hosts(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        use_hosts(args)
        return func(args)
    run.__doc__ = func.__doc__
    return run


def cmd_hosts(args: argparse.Namespace) -> int:
    """``hosts up|down|status`` with SIGTERM unwinding as Ctrl-C does (a failed or interrupted ``up``
    removes what it made); log lines to stderr."""
    import signal
    import sys

    from harness.bench import sigterm_as_interrupt

    previous = signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    try:
        return main_from_args(args, lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        signal.signal(signal.SIGTERM, previous)


def use_hosts(args: argparse.Namespace) -> None:
    """``--hosts`` of sweep, up and down (with ``--backend swarm``): run on the hosts of ``hosts up``, by
    setting `harness.hosts.plan.HOSTS_ENV` for the swarm backend. Raises SpecError with another backend."""
    if getattr(args, "hosts", False) is True:
        if args.backend != "swarm":
            raise SpecError("--hosts runs a stack on the hosts of `wiiide-lab hosts up`: use it with --backend swarm")
        os.environ[HOSTS_ENV] = "1"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``hosts`` verb's arguments."""
    p.add_argument("action", choices=["up", "down", "status"],
                   help="up: start the hosts, the registry and the swarm; down: remove all of it; "
                        "status: the hosts and the swarm's nodes")
    p.add_argument("--hosts", default="3", metavar="N",
                   help=f"up: how many hosts, 1..{MAX_HOSTS} (default 3); the first is the swarm manager")
    p.add_argument("--image", metavar="REPO:TAG",
                   help="up: the node image to build if missing and pull on every host (default: $WIIIIIDE_IMAGE "
                        "or wiiide:latest)")


def main_from_args(args: argparse.Namespace, log: Progress) -> int:
    """Run ``hosts ACTION``; exit code 0. Raises SpecError (a bad --hosts) before anything starts,
    ClusterError when a step fails (``up`` has then removed what it made)."""
    from harness.hosts.engines import attach, encryption_note, hosts_down, hosts_up, leftovers

    if args.action == "down":
        hosts_down(log)
        log("hosts down: no host container, volume, network or registry of the project is left")
        return 0
    if args.action == "status":
        hosts = attach()
        from harness.run.docker_client import docker_client
        manager = docker_client(base_url=hosts.manager_url)
        for node in manager.nodes.list():
            d = node.attrs.get("Description", {})
            s = node.attrs.get("Status", {})
            print(f"{d.get('Hostname')}\t{node.attrs['Spec'].get('Role')}\t{s.get('State')}\t{s.get('Addr')}")
        print(f"registry\t{hosts.registry_address}\t(pushed to at {hosts.push_address})")
        print(encryption_note())
        return 0
    count = parse_host_count(args.hosts)  # refused before anything starts
    from harness.run.image import DEFAULT_TAG, ensure_image
    image = ensure_image(args.image or os.environ.get("WIIIIIDE_IMAGE") or DEFAULT_TAG, log=log)
    hosts = hosts_up(count, log, node_image=image)
    for name, url in hosts.urls.items():
        print(f"{name}\t{url}")
    log(f"[hosts] {encryption_note()}")
    log(f"hosts up: {count} hosts in one swarm, {image} in the registry and on each; run on them with "
        f"`--backend swarm --hosts`; `wiiide-lab hosts down` removes everything ({sum(map(len, leftovers().values()))} "
        "objects on this engine)")
    return 0
