"""A worker's side of a sharded run's recovery (`wiiide.server.ps.membership` is the coordinator's).

Each worker keeps copies of the parameters at its latest steps (`StepSnapshots`); after a shard failed it
tells the coordinator and waits for its order (`await_order`), answers ``ps_recover`` with its copy of the
asked step and the momentum its old shard kept, or under on-arrival pacing with its newest copy and
its old shard's partitions (`wiiide.server.ps.paced_recovery`), and learns the next incarnation's shards
from ``ps_rehost`` (`answer_recovery`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch

from wiiide.errors import ProtocolError
from wiiide.wire.node import EXIT_PEER_LOST, Connection, NodeFailure
from wiiide.server.ps.membership import PS_RECOVER, PS_REHOST, PS_STATE, SNAPSHOTS_KEPT, momentum_at, sha256_of
from wiiide.server.ps.paced_recovery import worker_answer
from wiiide.server.ps.plan import PS_FAILED
from wiiide.wire.encode import encode_message
from wiiide.wire.messages import WireTensor


class StepSnapshots:
    """A worker's copies of the parameters at its latest `kept` steps (step t: the copy that step t's
    forward pass uses, i.e. after the pulls of step t - 1)."""

    def __init__(self, kept: int = SNAPSHOTS_KEPT) -> None:
        self.kept = kept
        self._copies: OrderedDict[int, np.ndarray] = OrderedDict()
        self.versions: list[int | None] = []

    def keep(self, step: int, params: torch.Tensor, versions: Sequence[int | None] | None = None) -> None:
        """Keep a copy of `params` as step `step`'s, the newest; `versions`: its partitions' versions (on-arrival
        pacing, `wiiide.server.ps.paced_recovery`; None: unknown), kept as ``versions``."""
        self._copies[step] = params.detach().numpy().copy()
        self.versions = list(versions) if versions is not None else []
        self._copies.move_to_end(step)
        while len(self._copies) > self.kept:
            self._copies.popitem(last=False)

    @property
    def latest(self) -> int | None:
        """The step of the copy kept last (an incarnation under on-arrival pacing counts its tasks from 0)."""
        return next(reversed(self._copies), None)

    def get(self, step: int) -> np.ndarray | None:
        return self._copies.get(step)


def await_order(conn: Connection, failure: BaseException):
    """After a shard failed: tell the coordinator (``ps_failed``) and wait for its order, passing over
    the batches handed out ahead. Returns the ``ps_recover`` message; a ``stop`` raises NodeFailure
    (exit 4) with `failure` and the stop's reason. A lost coordinator propagates (PeerClosed, ...)."""
    conn.send([encode_message(PS_FAILED, {"cause": str(failure)[:500]})])
    while True:
        msg = conn.receive(["batch", "batch_indices", "stop", PS_RECOVER])
        if msg.kind == PS_RECOVER:
            return msg
        if msg.kind == "stop":
            raise NodeFailure(f"{failure}; the coordinator stopped the sharded run: "
                              f"{str(msg.meta.get('reason'))[:400]}", EXIT_PEER_LOST) from None


def answer_recovery(conn: Connection, order, snapshots: StepSnapshots, shard, max_shards: int,
                    momentum: float) -> tuple[int, int | None]:
    """Answer the coordinator's ``ps_recover`` `order` (and any repeat) with ``ps_state`` from
    `snapshots` and the momentum (factor `momentum`) of `shard` (this worker's closed `ShardServer`, or None) until its
    ``ps_rehost``; returns the next incarnation's (shard count, the shard this worker hosts or None).

    Raises:
        ProtocolError: a bad step, shard count or shard id.
    """
    while order.kind == PS_RECOVER:
        step = order.meta.get("step")
        if type(step) is not int:  # noqa: E721
            raise ProtocolError(f"{PS_RECOVER}: step must be an integer, got {step!r:.40}")
        on_arrival = order.meta.get("on_arrival") is True  # no common step: the newest copy and the shard's state
        copy = snapshots.get(snapshots.latest if on_arrival else step)
        meta = {"step": step, "sha256": sha256_of(copy) if copy is not None else None, "latest_step": snapshots.latest}
        if on_arrival:
            tensors = worker_answer(meta, copy, snapshots.versions, shard)
        else:
            tensors = [WireTensor("params", copy)] if copy is not None and order.meta.get("send_params") is True else []
            states = momentum_at(shard.partition_states() if shard is not None else [], step, momentum)
            meta["momentum"] = [index for index, _, _ in states]
            tensors += [WireTensor(f"m{index}", values) for index, _, values in states]
        conn.send([encode_message(PS_STATE, meta, tensors)])
        order = conn.receive([PS_RECOVER, PS_REHOST, "stop"])
        if order.kind == "stop":
            raise NodeFailure(f"the coordinator stopped the sharded run: {str(order.meta.get('reason'))[:400]}",
                              EXIT_PEER_LOST)
    k, hosted = order.meta.get("ps_shards"), order.meta.get("shard")
    if type(k) is not int or not 2 <= k <= max_shards:  # noqa: E721
        raise ProtocolError(f"{PS_REHOST}: ps_shards must be an integer 2..{max_shards}, got {k!r:.40}")
    if hosted is not None and (type(hosted) is not int or not 1 <= hosted < k):  # noqa: E721
        raise ProtocolError(f"{PS_REHOST}: shard must be null or an integer 1..{k - 1}, got {hosted!r:.40}")
    return k, hosted
