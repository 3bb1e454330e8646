"""Local SGD's outer step compressed both ways on the central parameter server.

With ``local_steps`` H > 1 every averaging round moves a model delta in from each worker and the
parameters out to each: 2 x N x the model through the server's one link. Both directions can go
through the compression policy's codec (``compression: fixed:int8`` sends about a quarter of the
bytes) without letting the error build up, with the error-feedback machinery of the sharded servers
(`wiiide.server.pace.feedback`):

- push (worker -> server): `DeltaPush` encodes each delta plus the residual the codec did not deliver
  last time (`ErrorFeedback`), so the sum of what the server decoded plus the worker's residual is
  the sum of the worker's deltas;
- pull (server -> worker): `ReplicaPulls` sends each worker the parameters as a delta against what
  that worker holds (`PullReplica`: the server tracks the worker's copy, so the pull's residual is
  exactly ``params - copy`` and goes out with the next pull; the copy never drifts). The worker applies
  it with `WorkerCopy`, to the same float32 values the server's replica holds. The first pull to a
  worker (joining, rejoining) and the first ``lossy_warmup_steps`` versions go absolute and exact.

Compressing the outer pseudo-gradients is what low-communication training does: OpenDiLoCo
(Jaghouar et al. 2024) all-reduces them in fp16 and Streaming DiLoCo (Douillard et al. 2025) in
4 bits with no loss of quality; compressing the server's answer too, with a residual on each sender,
is DoubleSqueeze (Tang et al., ICML 2019) and BytePS's two-way compression.

Pull frames carry the kinds of the sharded servers' pulls (`LOSSY_KIND`, `DENSE_KIND`: the policies
compress only the former lossily) with one float32 tensor ``params`` and meta ``delta``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from wiiide.codecs.policy import CompressionPolicy
from wiiide.errors import ProtocolError
from wiiide.server.pace.feedback import DENSE_KIND, LOSSY_KIND, ErrorFeedback, PullReplica
from wiiide.wire.messages import Frame

PULL_KINDS = (DENSE_KIND, LOSSY_KIND)  # what a worker receives as a pull from the pace server
PULL_TENSOR = "params"
PUSH_TENSOR = "delta"


class DeltaPush:
    """A worker's model-delta pushes through its policy, with an error-feedback residual (`ErrorFeedback`).

    Args:
        policy: the worker's compression policy (its own ``lossy_warmup_steps`` count the pushes).
    """

    def __init__(self, policy: CompressionPolicy) -> None:
        self.policy = policy
        self.feedback = ErrorFeedback("push")

    def frame(self, meta: dict[str, Any], delta: torch.Tensor) -> Frame:
        """The ``gradients`` frame of `delta` (float32, flat) plus the residual owed; keeps the new residual.

        The frame may reference `delta`'s memory (lossless codecs): do not modify it before it is sent.

        Raises:
            ValueError: `delta` not float32.
        """
        return self.feedback.encode(self.policy, meta, PUSH_TENSOR, delta.detach().numpy().reshape(-1), dense=False)[0]

    def residual(self) -> np.ndarray | None:
        """What the codec still owes the server (float32, flat), None when nothing is owed."""
        return self.feedback.residual(PUSH_TENSOR)


class WorkerCopy:
    """The worker's copy of the server's parameters (float32, `numel`), kept apart from the model's
    parameters (which move during the H local steps) and updated by every pull."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.values: np.ndarray | None = None

    def apply(self, msg: Any) -> np.ndarray:
        """Apply one pull message (`PULL_KINDS`: meta ``delta`` true adds, false replaces); returns the copy.

        Raises:
            ProtocolError: not one float32 ``params`` tensor of `numel` values, ``delta`` not a boolean,
                or a delta before any absolute pull.
        """
        delta = msg.meta.get("delta")
        if not isinstance(delta, bool):
            raise ProtocolError(f"a pull's 'delta' must be true or false, got {delta!r:.40}")
        if [t.name for t in msg.tensors] != [PULL_TENSOR] or msg.tensors[0].dtype != "float32":
            raise ProtocolError(f"a pull carries one float32 tensor {PULL_TENSOR!r}")
        values = np.asarray(msg.tensors[0].array).reshape(-1)
        if values.size != self.numel:
            raise ProtocolError(f"a pull of {values.size} values, expected {self.numel}")
        if not delta:
            self.values = np.array(values, dtype=np.float32, copy=True)
        elif self.values is None:
            raise ProtocolError("a delta pull before any absolute pull")
        else:
            self.values += values  # float32 + float32: the server's replica does the same addition
        return self.values


class ReplicaPulls:
    """The pace server's pulls as deltas against each worker's copy (see the module docstring).

    Workers pulling the same versions hold the same copy, so copies are shared: a copy is a node in a
    tree whose root is an absolute pull of some version and whose children are the delta pulls of later
    versions; workers on the same node pulling the same version share one frame (in synchronous rounds
    every worker does: one encode per round). Nodes no worker holds any more are forgotten.

    Args:
        policy: the server's pull policy (built with ``lossy_warmup_steps`` 0: `dense` says when to
            send absolute values).
    """

    def __init__(self, policy: CompressionPolicy) -> None:
        self.policy = policy
        self._held: dict[int, int] = {}  # rank -> node id of the copy it holds
        self._nodes: dict[int, PullReplica] = {}  # node id -> the copy
        self._edges: dict[tuple[int | None, int], tuple[int, Frame]] = {}  # (parent node or None, version) -> (node, frame)
        self._next_node = 0
        self.frames_encoded = 0

    def frame_for(self, rank: int, version: int, params: np.ndarray, dense: bool) -> Frame:
        """The pull frame for worker `rank` of the parameters `params` (float32, flat) at `version`.

        `dense`: send absolute values (warm-up); a worker not holding a copy (new, or `forget`) always
        gets them. The frame's meta: ``step`` = version, ``delta``.
        """
        parent = None if dense else self._held.get(rank)
        key = (parent, version)
        if key not in self._edges:
            node = self._next_node
            self._next_node += 1
            if parent is None:
                replica = PullReplica(params)
                frame = replica.frame_for(self.policy, {"step": version}, PULL_TENSOR, params, dense=True)
            else:
                replica = PullReplica(self._nodes[parent].replica)
                frame = replica.frame_for(self.policy, {"step": version}, PULL_TENSOR, params, dense=False)
            self._nodes[node] = replica
            self._edges[key] = (node, frame)
            self.frames_encoded += 1
        node, frame = self._edges[key]
        self._held[rank] = node
        self._collect(version)
        return frame

    def forget(self, rank: int) -> None:
        """`rank` holds no copy any more (it left or rejoins): its next pull goes absolute."""
        self._held.pop(rank, None)

    def copy_of(self, rank: int) -> np.ndarray | None:
        """The copy worker `rank` holds (float32, flat), None when it holds none."""
        node = self._held.get(rank)
        return None if node is None else self._nodes[node].replica

    def max_abs_gap(self, params: np.ndarray) -> float:
        """max |params - copy| over the copies the workers hold (0.0 when none)."""
        return max((self._nodes[n].max_abs_gap(params) for n in set(self._held.values())), default=0.0)

    def _collect(self, version: int) -> None:
        """Keep the edges of `version` from nodes still held (others may still pull them) and the nodes
        held or reachable by such an edge; drop the rest."""
        held = set(self._held.values())
        self._edges = {k: v for k, v in self._edges.items() if k[1] == version and (k[0] is None or k[0] in held)}
        keep = held | {node for node, _ in self._edges.values()}
        self._nodes = {n: r for n, r in self._nodes.items() if n in keep}
