"""Compression policies: which codec encodes a given message.

Policy names (the config's ``compression``):

- ``fixed:<codec>``: always that codec (a name of `wiiide.codecs.CODEC_NAME_FORMS`, e.g. ``fixed:zstd-1``).
  A lossy codec applies to float32 gradient messages only, after `lossy_warmup_steps` gradient
  messages sent uncompressed; every other message then goes uncompressed.
- ``none`` and ``zlib-N``: the old names of ``fixed:none`` and ``fixed:zlib-N``.
- ``seed`` (old name ``adaptive``): the seeds' rule (seeds 001/004, "Adaptive Compression Strategy"):
  gradient messages larger than `threshold_bytes` (1 MiB) at zlib level 1, smaller gradient messages
  uncompressed, every other message at zlib level 9.
- ``network-aware`` (``network-aware+lossy``: the same with ``allow_lossy`` on, so one sweep axis can
  hold both): per message, the codec minimising the estimated time to encode, send and
  decode it::

      t(codec) = raw / encode_speed + (raw / ratio) * 8 / link_bps + raw / decode_speed

  the ratio (a moving average, weight `ema_alpha`) and the speeds are measured on this node's own
  messages, per message kind and codec; `link_bps` is the config's ``link_bandwidth_bps`` or, when that is
  0, this node's own uplink as its peers measured it: every receiver measures the rate at which each
  message it reads arrived (payload bytes over the time from the end of its header to its last byte)
  and reports it in the meta of its next message to that sender (`FEEDBACK_META_KEY`,
  `CompressionPolicy.feedback_meta`); the sender folds the reports into `uplink`
  (`CompressionPolicy.observe_received`). Until a report arrives, the rate this node measured on
  what it received stands in (the symmetric-link assumption, wrong by 4x at a parameter server that
  sends to N workers through one uplink; see `LinkEstimate`). Every candidate is tried `FIRST_TRIES` times first; then, every
  `probe_every`-th message of a kind, the candidate tried longest ago among those estimated within
  `PROBE_WITHIN` of the best (or measured only once) is probed, so estimates follow changes.
  Speeds are the fastest of the last `SPEED_WINDOW` samples (load on a shared machine only slows a
  codec down; one slow sample must not keep it out). The probe interval doubles (up
  to `PROBE_BACKOFF_MAX` x) while the best stays the same, so probing costs little on a steady link,
  and starts again from `probe_every` when the choice moves. On first tries and probes the sender
  also decodes its own payload to measure the decode speed (the receiver's figure is not sent back).
  Candidates: the lossless set, plus the lossy set for
  float32 gradient messages when ``allow_lossy`` is on and warm-up is over. Messages under
  `MIN_COMPRESS_BYTES` go uncompressed. Every choice is counted per kind, codec and reason, and the
  first decisions and every change of choice are kept with the estimates that made them, in the node's
  metrics (``compression_policy``).

Large lossless payloads are encoded in parallel chunks on `codec_threads` threads (`chunked`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np

from wiiide.codecs.base import Codec, NoCodec
from wiiide.codecs.chunked import CodecPool, default_threads
from wiiide.codecs.link_estimate import LINK_MIN_BYTES, LinkEstimate
from wiiide.codecs.lossless import ZlibCodec, _blosc2
from wiiide.codecs.registry import codec_from_name, decoder_for
from wiiide.wire.encode import encode_message
from wiiide.wire.messages import Frame, Message, WireTensor

GRADIENT_KINDS = frozenset({"gradients"})
LOSSLESS_CANDIDATES = ("none", "lz4", "zstd-1", "shuffle-lz4", "shuffle-zstd")
LOSSY_CANDIDATES = ("fp16", "bf16", "int8")  # + topk-<topk_fraction>
POLICY_NAME_FORMS = ("fixed:<codec>", "none", "zlib-1..9", "seed", "adaptive", "network-aware",
                     "network-aware+lossy")
MIN_COMPRESS_BYTES = 4096
ASSUMED_LINK_BPS = 1e9  # network-aware, before the first measurement when no bandwidth is configured
MAX_DECISIONS_KEPT = 200
FIRST_TRIES = 2  # network-aware tries every candidate twice before choosing
SPEED_WINDOW = 5  # a codec's speed: the fastest of its last 5 samples
PROBE_WITHIN = 1.5  # probe only codecs estimated at most 1.5x the best
PROBE_BACKOFF_MAX = 16  # the probe interval doubles up to 16 x probe_every while the best stays the same
FEEDBACK_META_KEY = "rx_bps"  # in a message's meta: the rate (bit/s) its sender's messages arrived at here


def parse_policy_name(name: str) -> tuple[str, str | None]:
    """(mode, codec name): mode is ``fixed``, ``seed`` or ``network-aware``.

    Raises:
        ValueError: an unknown policy or codec name.
    """
    if not isinstance(name, str):
        raise ValueError(f"compression policy must be a string, got {name!r}")
    if name in ("seed", "adaptive"):
        return "seed", None
    if name in ("network-aware", "network-aware+lossy"):
        return "network-aware", None
    codec_name = name[len("fixed:"):] if name.startswith("fixed:") else name
    if codec_name != name or codec_name == "none" or codec_name.startswith("zlib-"):
        codec_from_name(codec_name)  # raises ValueError for a bad codec
        return "fixed", codec_name
    raise ValueError(f"unknown compression policy {name!r}; forms: {', '.join(POLICY_NAME_FORMS)}")


def fixed_lossy_ratio(name: str, numel: int) -> float | None:
    """Raw / payload bytes of `numel` float32 values (one tensor) under policy `name`'s codec, when it is a
    fixed lossy one (``fixed:int8``, ``fixed:lloyd2``, ``fixed:topk-0.01``, ...); None for a lossless codec,
    the ``seed`` and ``network-aware`` policies, a bad name or `numel` < 1. Measured by encoding standard
    normal values with a fresh codec (top-k keeps a residual per stream): a lossy codec's payload size
    depends on the element count only, except int3z's (entropy-coded, so here an estimate: about 14x, where
    the project's real gradients gave 14.6-15.6x). About 1 ms for lloyd2 at 65,536 values (`timeit`)."""
    try:
        mode, codec_name = parse_policy_name(name)
        codec = codec_from_name(codec_name) if mode == "fixed" else None
    except ValueError:
        return None
    if codec is None or codec.lossless or numel < 1:
        return None
    values = np.random.default_rng(0).standard_normal(numel).astype(np.float32)
    parts, _ = codec.encode_message([values], ["p"], "ratio")
    sent = sum(memoryview(part).nbytes for part in parts)
    return numel * 4 / sent if sent else None


def check_policy_name(name: str) -> str | None:
    """None when `name` is a valid policy, else why not (for config validation)."""
    try:
        parse_policy_name(name)
    except ValueError as exc:
        return str(exc)
    return None


class CompressionPolicy:
    """Chooses a codec per message from its kind, size and (network-aware) measured costs.

    Args:
        name: a policy name (`POLICY_NAME_FORMS`).
        threshold_bytes: the seed rule's gradient threshold (``adaptive_threshold_bytes``).
        allow_lossy: network-aware may pick lossy codecs for float32 gradients.
        lossy_warmup_steps: gradient messages sent uncompressed before any lossy codec is used.
        topk_fraction: the fraction of top-k among network-aware's lossy candidates.
        link_bandwidth_bps: the link's rate for network-aware; 0: measured online.
        codec_threads, chunk_bytes: parallel chunked compression (1 thread: none).
        probe_every: network-aware probes another codec every this many messages of a kind.
        ema_alpha: weight of the newest sample in the moving averages.
        clock: time source (seconds), replaceable in tests.
        record: a dict (e.g. the node's ``metrics.extra``) that receives ``compression_policy``.
        link_min_bytes: the smallest received payload whose arrival rate counts for the link estimate
            (`LinkEstimate`; `LINK_MIN_BYTES` unless the messages are smaller, as sharded partitions are).

    Raises:
        ValueError: a bad name or parameter.
    """

    def __init__(self, name: str, threshold_bytes: int = 1024 * 1024, *, allow_lossy: bool = False,
                 lossy_warmup_steps: int = 0, topk_fraction: float = 0.01, link_bandwidth_bps: float = 0,
                 codec_threads: int = 1, chunk_bytes: int = 1024 * 1024, probe_every: int = 20,
                 ema_alpha: float = 0.2, clock: Callable[[], float] = time.perf_counter,
                 record: dict[str, Any] | None = None, link_min_bytes: int = LINK_MIN_BYTES) -> None:
        self.name = name
        self.mode, codec_name = parse_policy_name(name)
        if probe_every < 2:
            raise ValueError(f"probe_every must be >= 2, got {probe_every}")
        self.threshold_bytes = threshold_bytes
        self.allow_lossy = allow_lossy or name == "network-aware+lossy"
        self.lossy_warmup_steps = lossy_warmup_steps
        self.link_bandwidth_bps = float(link_bandwidth_bps)
        self.probe_every, self.ema_alpha, self.clock = probe_every, ema_alpha, clock
        # The node hands this pool to its frame readers (`FrameReader(pool=policy.pool)`), so received
        # chunks are decoded on the same threads.
        self.pool = CodecPool(codec_threads, chunk_bytes)
        self.link = LinkEstimate(min_bytes=link_min_bytes)  # what arrives here (the symmetric stand-in for the uplink)
        self.uplink = LinkEstimate()  # this node's uplink: the rates its peers reported (FEEDBACK_META_KEY)
        self._rx_by_peer: dict[Any, LinkEstimate] = {}  # what arrived here from each peer, reported back to it
        self.gradient_messages = 0
        self._none = NoCodec()
        self._fixed: Codec | None = codec_from_name(codec_name) if self.mode == "fixed" else None
        self._fast, self._best = ZlibCodec(1), ZlibCodec(9)
        names = list(LOSSLESS_CANDIDATES)
        self._lossy_names = [*LOSSY_CANDIDATES, f"topk-{topk_fraction:g}"]
        self._codecs: dict[str, Codec] = {n: codec_from_name(n) for n in names + self._lossy_names}
        self._lossless_names = names
        if self.mode == "network-aware":
            _blosc2()  # import now (about 0.6 s), not inside the first message timed with a shuffle codec
        self._stats: dict[str, dict[str, dict[str, Any]]] = {}  # kind -> codec -> moving averages
        self._count: dict[str, int] = {}  # messages per kind (network-aware)
        self._last_choice: dict[str, str] = {}
        self._best_choice: dict[str, str] = {}  # kind -> codec of lowest estimate last time
        self._probe_interval: dict[str, int] = {}  # kind -> messages between probes (backs off)
        self._next_probe: dict[str, int] = {}  # kind -> message count at the last probe
        self.record: dict[str, Any] = {
            "policy": name, "mode": self.mode, "codec_threads": codec_threads, "chunk_bytes": self.pool.chunk_bytes,
            "allow_lossy": self.allow_lossy, "lossy_warmup_steps": lossy_warmup_steps,
            "link_bandwidth_bps_config": self.link_bandwidth_bps or None, "link_bandwidth_bps_measured": None,
            "uplink_bps_reported": None,
            "choices": {}, "reasons": {}, "estimates": self._stats, "decisions": [],
        }
        if record is not None:
            record["compression_policy"] = self.record

    @classmethod
    def from_config(cls, cfg: Any, record: dict[str, Any] | None = None) -> "CompressionPolicy":
        """The policy a `wiiide.config.RunConfig` describes, recording into `record` (metrics.extra).

        ``codec_threads`` 0 becomes `default_threads()` (the cores, at most 4); the link estimate counts
        payloads of half a ``partition_bytes`` and up when that is below `LINK_MIN_BYTES` (a sharded
        run's pulls and pushes are partitions). Raises `ValueError` as the constructor does (a config
        that validated never does).
        """
        return cls(cfg.compression, cfg.adaptive_threshold_bytes, allow_lossy=cfg.allow_lossy,
                   lossy_warmup_steps=cfg.lossy_warmup_steps, topk_fraction=cfg.topk_fraction,
                   link_bandwidth_bps=cfg.link_bandwidth_bps,
                   codec_threads=cfg.codec_threads or default_threads(), chunk_bytes=cfg.codec_chunk_bytes,
                   probe_every=cfg.codec_probe_every, record=record,
                   link_min_bytes=min(LINK_MIN_BYTES, max(MIN_COMPRESS_BYTES, cfg.partition_bytes // 2)))

    # ------------------------------------------------------------------------------------------
    def choose(self, kind: str, raw_nbytes: int, arrays: Sequence[np.ndarray] | None = None) -> Codec:
        """Codec for a message of `kind` (e.g. ``gradients``, ``params``) with `raw_nbytes` of tensors.

        `arrays` (the message's tensors) lets lossy codecs be checked against their dtypes; without
        it a float32 payload is assumed. Counts gradient messages for the lossy warm-up.
        """
        codec, _ = self._choose(kind, raw_nbytes, arrays)
        return codec

    def _lossy_ready(self, kind: str, arrays: Sequence[np.ndarray] | None) -> bool:
        if kind not in GRADIENT_KINDS or self.gradient_messages <= self.lossy_warmup_steps:
            return False
        return arrays is None or (bool(arrays) and all(a.dtype == np.float32 for a in arrays))

    def _choose(self, kind: str, raw_nbytes: int, arrays: Sequence[np.ndarray] | None
                ) -> tuple[Codec, dict[str, Any] | None]:
        if kind in GRADIENT_KINDS:
            self.gradient_messages += 1
        if self.mode == "fixed":
            codec = self._fixed
            if not codec.lossless and not self._lossy_ready(kind, arrays):
                return self._none, None
            return codec, None
        if self.mode == "seed":
            if kind in GRADIENT_KINDS:
                return (self._fast if raw_nbytes > self.threshold_bytes else self._none), None
            return self._best, None
        return self._choose_network_aware(kind, raw_nbytes, arrays)

    def link_bps(self) -> tuple[float, str]:
        """(link bandwidth in bits/s, where it comes from: ``config``, ``reported`` (this node's uplink as
        its peers measured it), ``measured`` (the rate of what arrived here: assumes a symmetric link) or
        ``assumed``)."""
        if self.link_bandwidth_bps > 0:
            return self.link_bandwidth_bps, "config"
        reported = self.uplink.bps
        if reported:
            return reported, "reported"
        measured = self.link.bps
        return (measured, "measured") if measured else (ASSUMED_LINK_BPS, "assumed")

    def estimate_s(self, kind: str, codec_name: str, raw_nbytes: int, link_bps: float | None = None) -> float | None:
        """Estimated encode + send + decode seconds of `raw_nbytes` with a codec; None if never measured."""
        s = self._stats.get(kind, {}).get(codec_name)
        if not s or s["samples"] == 0:
            return None
        bps = link_bps if link_bps is not None else self.link_bps()[0]
        encode = raw_nbytes / s["encode_bytes_per_s"] if s["encode_bytes_per_s"] else 0.0
        decode = raw_nbytes / s["decode_bytes_per_s"] if s["decode_bytes_per_s"] else 0.0
        return encode + 8.0 * raw_nbytes / s["ratio"] / bps + decode

    def candidates(self, kind: str, arrays: Sequence[np.ndarray] | None = None) -> list[str]:
        """Codec names network-aware weighs for a message of `kind`: the lossless set, plus the lossy set for
        float32 gradient messages once allowed and past warm-up.
        """
        names = list(self._lossless_names)
        if self.allow_lossy and self._lossy_ready(kind, arrays):
            names += self._lossy_names
        return names

    def _choose_network_aware(self, kind, raw_nbytes, arrays):
        if raw_nbytes < MIN_COMPRESS_BYTES:
            return self._none, None
        n = self._count[kind] = self._count.get(kind, 0) + 1
        names = self.candidates(kind, arrays)
        stats = self._stats.setdefault(kind, {})
        bps, bps_source = self.link_bps()
        estimates = {c: self.estimate_s(kind, c, raw_nbytes, bps) for c in names}
        # Every candidate is tried FIRST_TRIES times, round robin, before any estimate is trusted: one
        # sample taken during a burst of load would otherwise misjudge a codec for long.
        untried = [c for c in names if estimates[c] is None or stats[c]["samples"] < FIRST_TRIES]
        if untried:
            choice = min(untried, key=lambda c: stats[c]["samples"] if c in stats else 0)
            reason = "first try"
        else:
            best = min(names, key=lambda c: estimates[c])
            choice, reason = best, "lowest estimate"
            interval = self._probe_interval.get(kind, self.probe_every)
            if best != self._best_choice.get(kind):  # the choice moved: watch closely again
                self._best_choice[kind], interval = best, self.probe_every
            if n >= self._next_probe.setdefault(kind, n) + interval:
                # Worth probing: codecs whose estimate is within PROBE_WITHIN of the best (a codec's own
                # speed and ratio move little; what moves is the link, which the estimates already use).
                others = [c for c in names if c != best and (estimates[c] <= PROBE_WITHIN * estimates[best]
                                                             or stats[c]["samples"] < 2)]
                if others:
                    # codecs measured once first, then the one tried longest ago
                    choice, reason = min(others, key=lambda c: (stats[c]["samples"] >= 2, stats[c]["last_used"])), "probe"
                self._next_probe[kind] = n
                interval = min(2 * interval, PROBE_BACKOFF_MAX * self.probe_every)  # backs off while nothing changes
            self._probe_interval[kind] = interval
        stats.setdefault(choice, {"samples": 0, "ratio": 1.0, "encode_bytes_per_s": 0.0, "decode_bytes_per_s": 0.0,
                                  "last_used": 0})["last_used"] = n
        # The full record (with every estimate) is only built if it is kept (see _account).
        decision = {"message": n, "kind": kind, "raw_nbytes": raw_nbytes, "codec": choice, "reason": reason,
                    "link_bps": bps, "link_source": bps_source, "estimates_s": estimates}
        return self._codecs[choice], decision

    # ------------------------------------------------------------------------------------------
    def encode(self, kind: str, meta: dict[str, Any] | None, tensors: Sequence[WireTensor],
               stream: str | None = None, decoded_values: bool = False) -> Frame:
        """Choose a codec, build the frame (`wiiide.wire.encode.encode_message`, chunks on `pool`) and learn from it.

        `decoded_values`: ask the codec for `Frame.decoded` (error feedback's use).

        Raises:
            ValueError: a header above `wiiide.wire.format.MAX_HEADER_BYTES`.
        """
        arrays = [t.array for t in tensors]
        raw_nbytes = sum(a.nbytes for a in arrays)
        codec, decision = self._choose(kind, raw_nbytes, arrays)
        frame = encode_message(kind, meta, tensors, codec, self.pool, stream, decoded_values)
        self._account(kind, frame, decision, tensors)
        return frame

    def _account(self, kind: str, frame: Frame, decision: dict[str, Any] | None,
                 tensors: Sequence[WireTensor]) -> None:
        choices = self.record["choices"].setdefault(kind, {})
        choices[frame.codec] = choices.get(frame.codec, 0) + 1
        if decision is None:
            return
        reasons = self.record["reasons"]
        reasons[decision["reason"]] = reasons.get(decision["reason"], 0) + 1
        decode_s = None
        if decision["reason"] != "lowest estimate" or self._stats[kind][decision["codec"]]["samples"] == 0:
            decode_s = self._self_decode_s(frame, tensors)
        self.observe(kind, decision["codec"], frame.raw_nbytes, frame.payload_nbytes, frame.encode_s, decode_s)
        decisions = self.record["decisions"]
        if len(decisions) < MAX_DECISIONS_KEPT and (len(decisions) < 20 or self._last_choice.get(kind) != frame.codec):
            decision["estimates_s"] = {c: (round(t, 7) if t is not None else None)
                                       for c, t in decision["estimates_s"].items()}
            decisions.append(decision)
        self._last_choice[kind] = frame.codec

    def _self_decode_s(self, frame: Frame, tensors: Sequence[WireTensor]) -> float:
        """Seconds to decode this frame's payload here (the sender's stand-in for the receiver's cost)."""
        parts = frame.buffers[1:]
        payload = memoryview(parts[0] if len(parts) == 1 else b"".join(parts)) if parts else memoryview(b"")
        specs = [(t.dtype, int(t.array.size)) for t in tensors]
        t0 = self.clock()
        decoder_for(frame.wire_id).decode_message(payload, frame.raw_nbytes, frame.codec_params, specs, self.pool)
        return self.clock() - t0

    def observe(self, kind: str, codec_name: str, raw_nbytes: int, payload_nbytes: int, encode_s: float,
                decode_s: float | None = None) -> None:
        """Fold one message's measured ratio and speeds into the estimates of (kind, codec).

        The ratio is a moving average. A speed is the fastest of the last `SPEED_WINDOW` samples: on a
        shared machine load only ever slows a codec down, and one slow sample (a first use paying an
        import, a burst of other work) would otherwise keep a good codec out for many messages.
        """
        s = self._stats.setdefault(kind, {}).setdefault(
            codec_name, {"samples": 0, "ratio": 1.0, "encode_bytes_per_s": 0.0, "decode_bytes_per_s": 0.0, "last_used": 0})
        a = self.ema_alpha if s["samples"] else 1.0
        ratio = raw_nbytes / payload_nbytes if payload_nbytes else 1.0
        s["ratio"] += a * (ratio - s["ratio"])
        if codec_name != "none":
            for key, seconds in (("encode", encode_s), ("decode", decode_s)):
                if seconds is not None and seconds > 0:
                    recent = s.setdefault(f"{key}_bytes_per_s_recent", [])
                    recent.append(raw_nbytes / seconds)
                    del recent[:-SPEED_WINDOW]
                    s[f"{key}_bytes_per_s"] = max(recent)
        s["samples"] += 1

    def observe_received(self, msg: Message, peer: Any = None) -> None:
        """Learn from a received `wiiide.wire.messages.Message` of `peer` (any hashable naming the connection;
        None for a node with one peer): the rate it arrived at (reported back by `feedback_meta`) and,
        from its meta's `FEEDBACK_META_KEY`, the rate this node's own messages reached that peer.
        A report that is not a finite positive number is ignored (the meta is the peer's to fill).
        """
        self.link.observe(msg.payload_nbytes, msg.payload_recv_s)
        self.record["link_bandwidth_bps_measured"] = self.link.bps
        rx = self._rx_by_peer.get(peer)
        if rx is None:
            rx = self._rx_by_peer[peer] = LinkEstimate(min_bytes=self.link.min_bytes)
        # Only the bytes that arrived while this node read count for the report: a payload that waited
        # in the socket's queue (the parameter server reading its 4th worker after the other 3) would
        # report the speed of a memory copy, not of the peer's uplink.
        queued = getattr(msg, "payload_queued_nbytes", 0) or 0
        rx.observe(msg.payload_nbytes - min(queued, msg.payload_nbytes), msg.payload_recv_s)
        meta = getattr(msg, "meta", None)
        reported = meta.get(FEEDBACK_META_KEY) if isinstance(meta, dict) else None
        if reported is not None:
            self.uplink.observe_rate(reported)
            self.record["uplink_bps_reported"] = self.uplink.bps

    @property
    def learns_uplink(self) -> bool:
        """True when the codec choice uses the peers' reports (network-aware with no configured bandwidth):
        a node whose messages to its peers are costly to give each their own meta (a shard's pull goes
        to every worker) adds `feedback_meta` only then."""
        return self.mode == "network-aware" and self.link_bandwidth_bps <= 0

    def feedback_meta(self, peer: Any = None) -> dict[str, float]:
        """The meta entries to add to the next message to `peer`: ``{FEEDBACK_META_KEY: bit/s}``, the
        rate (`LinkEstimate.bps` of the last payloads of at least the link estimate's `min_bytes`, 256 KiB
        unless the policy was given a smaller `link_min_bytes`) at which `peer`'s messages arrived here;
        ``{}`` before any such payload arrived."""
        rx = self._rx_by_peer.get(peer)
        bps = rx.bps if rx is not None else None
        return {FEEDBACK_META_KEY: round(bps)} if bps else {}

    def drop_residuals(self, stream: str, name: str) -> None:
        """Forget the error-feedback residual any of this policy's codecs keeps for tensor `name` of `stream`
        (top-k's), for a caller that keeps its own residual (`wiiide.server.pace.feedback`)."""
        for codec in [*self._codecs.values(), self._fixed]:
            residuals = getattr(codec, "residuals", None)
            if isinstance(residuals, dict):
                residuals.pop(f"{stream}/{name}", None)

    def close(self) -> None:
        """Stop the codec pool's threads; frame readers given `pool` must not decode afterwards."""
        self.pool.close()
