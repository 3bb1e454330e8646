"""Error feedback for both directions of a sharded parameter server.

Each sender of a lossy direction keeps a residual per tensor: what its codec did not deliver, added
to the next value it sends (``e <- (g + e) - C(g + e)``; Seide et al. 2014, Stich et al. 2018). The
worker keeps one per partition for its pushes, the shard one per partition for its pulls, as BytePS
does for two-way compression (``docs/gradient-compression.md``: compression and error feedback on the
worker and on the server), hivemind's all-reduce compresses both its reduce and gather parts
(``hivemind/averaging/allreduce.py``) and DeepSpeed's compressed all-reduce keeps a worker and a
server error. So the sum of everything the receiver decoded plus the residual equals the sum of
every input, whatever the codec.

A shard's pulls are deltas against what the workers hold (`PullReplica`): the worker's copy is the
replica, so a lossy pull never lets it drift from the shard's parameters (the pull residual is
exactly ``params - replica``, sent with the next delta). The first `lossy_warmup_steps` steps go dense
(the kind `DENSE_KIND`, which no policy compresses lossily).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from wiiide.codecs.policy import CompressionPolicy, parse_policy_name
from wiiide.codecs.registry import codec_from_name, decoder_for
from wiiide.wire.messages import Frame, WireTensor

LOSSY_KIND = "gradients"  # the policies' lossy codecs apply to this kind only (after warm-up)
DENSE_KIND = "ps_dense"  # warm-up steps: lossless whatever the policy


def policy_may_be_lossy(cfg: Any) -> bool:
    """Whether the compression policy of `cfg` (a `wiiide.config.RunConfig`) can ever choose a lossy
    codec (then pulls are deltas)."""
    mode, codec = parse_policy_name(cfg.compression)
    if mode == "fixed":
        return not codec_from_name(codec).lossless
    return mode == "network-aware" and (cfg.allow_lossy or cfg.compression == "network-aware+lossy")


def decoded_values(frame: Frame, name: str, numel: int) -> np.ndarray:
    """The float32 values (flat, `numel`) the receiver of `frame` decodes for its one tensor `name`: the
    codec's own (`Frame.decoded`, taken: the frame, which may wait in a queue, keeps no reference), else
    the frame's payload decoded here.

    Raises:
        ProtocolError: from the codec, for a frame it cannot decode (a bug: the frame is this node's own).
    """
    if frame.decoded is not None:
        values, frame.decoded = frame.decoded, None
        return values
    parts = frame.buffers[1:]
    payload = memoryview(parts[0] if len(parts) == 1 else b"".join(parts)) if parts else memoryview(b"")
    raw = decoder_for(frame.wire_id).decode_message(payload, frame.raw_nbytes, frame.codec_params,
                                                    [("float32", numel)], None)
    return np.frombuffer(raw, dtype=np.float32, count=numel).copy()


def received_values(msg: Any) -> np.ndarray:
    """The one tensor of a received push or pull `msg` (a `wiiide.wire.messages.Message`), flat, as an array
    that outlives the connection's next read: a lossy codec's decoded array as it is (always new, see
    `wiiide.codecs.lossy`), anything else copied (an uncompressed tensor views the reader's reused buffer).
    Saves a copy of every lossy push and pull (26 MB a step per worker on the 26 MB model)."""
    array = msg.tensors[0].array.reshape(-1)
    if decoder_for(msg.codec).lossless:
        return array.copy()
    return array


class ErrorFeedback:
    """Residuals of one sending direction (`stream`: ``push`` or ``pull``), one per tensor name.

    Not thread-safe per name: one sender thread per name (each partition has one sender).
    """

    def __init__(self, stream: str) -> None:
        self.stream = stream
        self.residuals: dict[str, np.ndarray] = {}

    def residual(self, name: str) -> np.ndarray | None:
        """The residual kept for `name` (float32, flat), None when nothing is owed."""
        return self.residuals.get(name)

    def encode(self, policy: CompressionPolicy, meta: dict, name: str, values: np.ndarray, dense: bool
               ) -> tuple[Frame, np.ndarray]:
        """Encode ``values + residual`` (float32, flat) as a one-tensor frame with the policy's codec for
        `LOSSY_KIND` (or `DENSE_KIND` when `dense`), keep what did not get through as the new residual.

        Returns:
            (the frame, the float32 values the receiver will decode). For a lossless codec the latter is
            the compensated input itself (which the frame may reference: do not modify it before the
            frame is sent).

        Raises:
            ValueError: values not float32 (from the codec).
        """
        residual = self.residuals.pop(name, None)
        acc = values if residual is None else values + residual
        frame = policy.encode(DENSE_KIND if dense else LOSSY_KIND, meta, [WireTensor(name, acc)], stream=self.stream,
                              decoded_values=True)
        policy.drop_residuals(self.stream, name)  # top-k's own residual would count the error twice
        if decoder_for(frame.wire_id).lossless:
            return frame, acc
        sent = decoded_values(frame, name, acc.size)
        error = acc - sent
        if np.any(error):
            self.residuals[name] = error
        return frame, sent


def pulls_as_deltas(cfg: Any) -> bool:
    """Whether a shard's pulls travel as deltas against the workers' copy (`PullReplica`) for the policy
    of `cfg` (a `wiiide.config.RunConfig`): whenever it may compress them at all, not with ``fixed:none``.

    A lossy codec needs the replica. A lossless one gains from it too: two nearby float32 values differ
    by a value whose low mantissa bits are zero (their difference is exact when they are within a factor
    of 2, Sterbenz's lemma), so a step's delta compresses far better than the parameters themselves
    (shuffle-zstd on the digits MLP after 20 SGD steps, lr 0.1: 1.60x against 1.20x). The worker adds
    the delta in float32 as the replica does, so its copy is the replica bit for bit.
    """
    mode, codec = parse_policy_name(cfg.compression)
    return policy_may_be_lossy(cfg) or not (mode == "fixed" and codec == "none")


class PullReplica:
    """What every worker holds of one partition (float32, flat): a shard's pulls are deltas against it.

    `frame_for` sends the partition's parameters: absolute while `dense` (the lossy codecs' warm-up, and
    always with ``fixed:none``: exact, no rounding of ``replica + (p - replica)``), else the delta
    ``params - replica`` (`pulls_as_deltas`), lossy or lossless; a lossy codec's residual is the
    replica's gap.
    """

    def __init__(self, params: np.ndarray) -> None:
        self.replica = np.array(params, dtype=np.float32, copy=True)

    def frame_for(self, policy: CompressionPolicy, meta: dict, name: str, params: np.ndarray, dense: bool) -> Frame:
        """The pull frame for `params` (float32, flat, this partition's current values); meta gains ``delta``.

        Raises:
            ValueError: a shape other than the replica's.
        """
        if params.shape != self.replica.shape:
            raise ValueError(f"partition {name}: {params.shape} values, the replica holds {self.replica.shape}")
        if dense:
            self.replica = np.array(params, dtype=np.float32, copy=True)
            return policy.encode(DENSE_KIND, {**meta, "delta": False}, [WireTensor(name, self.replica.copy())])
        delta = params - self.replica
        frame = policy.encode(LOSSY_KIND, {**meta, "delta": True}, [WireTensor(name, delta)], stream="pull",
                              decoded_values=True)
        policy.drop_residuals("pull", name)
        if decoder_for(frame.wire_id).lossless:
            self.replica += delta
        else:
            self.replica += decoded_values(frame, name, delta.size)
        return frame

    def max_abs_gap(self, params: np.ndarray) -> float:
        """max |params - replica|: how far the workers' copy is from the shard's parameters right now."""
        return float(np.max(np.abs(params - self.replica))) if params.size else 0.0
