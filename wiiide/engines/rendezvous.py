"""Rendezvous and ranks of the torch engines (`wiiide.engines.torch_dist`).

The coordinator is rank 0. It hosts the rendezvous, a `torch.distributed.TCPStore` on ``bind_host:port``
(workers connect to ``coordinator_host:port``), and touches ``ready_file`` once it listens (the
container healthcheck). A worker does not know its index (Compose ``--scale`` does not tell it), so it
takes the next rank from an atomic counter in the store (`claim_rank`): 1..num_workers, in the order
workers arrive. Gloo then connects every pair of ranks; in containers ``GLOO_SOCKET_IFNAME=eth0``
(compose.yaml) puts it on the cluster's bridge, and when the coordinator is a loopback address and the
variable is unset, the loopback interface is chosen (`loopback_interface`). When the harness shapes
links it gates the start (``start_gate_file``): rank 0 waits for the gate before it joins the process
group, so the other ranks wait too and no training traffic leaves unshaped.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import psutil

from wiiide.wire.node import EXIT_CONNECT, NodeFailure

RANK_KEY = "wiiide/next_rank"


def claim_rank(store: Any, role: str, num_workers: int) -> int:
    """Rank of this node: 0 for the coordinator; a worker takes the next value of the store's counter.

    `store` needs ``add(key, amount) -> int`` (atomic, as `torch.distributed.TCPStore` provides).
    Raises NodeFailure when more workers arrive than ``num_workers``.
    """
    if role == "coordinator":
        return 0
    rank = int(store.add(RANK_KEY, 1))
    if not 1 <= rank <= num_workers:
        raise NodeFailure(f"this worker drew rank {rank} but the cluster has num_workers={num_workers}: "
                          "more workers joined than the coordinator expects", EXIT_CONNECT)
    return rank


def rank_slices(total: int, parts: int) -> list[slice]:
    """`parts` contiguous slices of ``range(total)``, sizes differing by at most one (larger first).

    Raises ValueError when a part would be empty (total < parts) or parts < 1.
    """
    if parts < 1 or total < parts:
        raise ValueError(f"cannot split {total} samples into {parts} non-empty parts")
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(slice(start, start + size))
        start += size
    return out


def loopback_interface() -> str | None:
    """Name of the interface holding 127.0.0.1 (``lo`` on Linux), None if there is none."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs):
            return name
    return None


def is_loopback_host(host: str) -> bool:
    """True when `host` resolves to a loopback address; False when it does not or does not resolve."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False
