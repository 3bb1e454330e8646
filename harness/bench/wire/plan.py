"""What one bench-wire run measures: `WirePlan` (frame sizes, codecs, link rates, counts) and its defaults.

Standard library, `wiiide` and `harness.errors` only: the plan travels as JSON (`WirePlan.as_dict`, `WirePlan.from_dict`)
to the source peer, which may run in a container of the node image (no harness dependencies there).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from harness.errors import SpecError
from wiiide.units import KIB, MIB

DEFAULT_SIZES_BYTES = (64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB)
DEFAULT_FRAME_CODECS = ("none", "lz4", "zstd-1", "shuffle-lz4", "shuffle-zstd", "fp16", "int8")
DEFAULT_TABLE_CODECS = ("none", "zlib-1", "zlib-9", "zstd-1", "zstd-3", "lz4", "shuffle-lz4", "shuffle-zstd",
                        "fp16", "bf16", "int8", "int3", "int3z", "lloyd2", "topk-0.01")
DEFAULT_LINK_POLICIES = ("fixed:none", "fixed:lz4", "fixed:zstd-1", "fixed:shuffle-lz4", "fixed:shuffle-zstd",
                         "seed", "network-aware")
DEFAULT_LINK_RATES_BPS = (100e6, 200e6, 500e6, 1e9, 2.5e9, 0.0)  # bit/s; 0 = unpaced
SECTIONS = ("frames", "links", "codecs")
FRAME_READERS = ("whole", "exact")  # the sink's FrameReader: whole_frames=True (the nodes') or exact reads
FLOAT32_BYTES = 4  # payloads are float32 gradient slices
MIN_RECV_CHUNK_BYTES = KIB


class PlanError(SpecError, ValueError):
    """A plan value out of range or an unknown codec or policy; the message names the option and what is allowed.

    A `SpecError` (the CLI's exit 2) and a `ValueError` (as `wiiide.units.UnitError`), so callers may catch either.
    """


@dataclass(frozen=True)
class WirePlan:
    """One run's parameters, checked when built.

    Attributes:
        sizes_bytes: frame payload sizes (bytes; each a positive multiple of 4, float32 elements).
        frame_codecs: codec names (`wiiide.codecs.codec_from_name`) for the frames section.
        table_codecs: codec names for the in-process codec table.
        link_rates_bps: paced link rates (bit/s, SI); 0 = unpaced.
        link_policies: compression policy names (`wiiide.codecs.policy.CompressionPolicy`) for the links section.
        repeats: interleaved repeats of every frame trial and codec-table measurement (>= 1).
        bytes_per_trial: bytes moved per raw / uncompressed frame trial (>= 1).
        link_messages: synchronous round trips per policy and rate (>= 1).
        codec_threads: codec threads for the frames and links sections (>= 1).
        table_threads: thread counts for the codec table (each >= 1).
        small: a small synthetic model (256-1024-1024-10) instead of 1024-4096-4096-10 (for tests).
        recv_chunk_bytes: the receiver's `FrameReader` recv_chunk_bytes (bytes, >= 1 KiB).
        read_ahead_bytes: the receiver's `FrameReader` read_ahead_bytes for exact reads (bytes, 0 .. 1 MiB;
            0: every frame part read exactly; whole-frame reads ignore it).
        sections: which of `SECTIONS` run (default all), e.g. ``("frames",)``.
        frame_readers: how the sink reads the frames section's frames, from `FRAME_READERS`: ``whole``
            (`FrameReader(whole_frames=True)`, the nodes' reader) and ``exact`` (each frame part read
            exactly, three requests per frame); the first reads every codec's frames, the others the
            uncompressed ones too, side by side (reported as ``none/<reader>``).

    Raises:
        PlanError: (a ValueError) on any value out of range or an unknown codec or policy name.
    """

    sizes_bytes: tuple[int, ...] = DEFAULT_SIZES_BYTES
    frame_codecs: tuple[str, ...] = DEFAULT_FRAME_CODECS
    table_codecs: tuple[str, ...] = DEFAULT_TABLE_CODECS
    link_rates_bps: tuple[float, ...] = DEFAULT_LINK_RATES_BPS
    link_policies: tuple[str, ...] = DEFAULT_LINK_POLICIES
    repeats: int = 5
    bytes_per_trial: int = 256 * MIB
    link_messages: int = 100
    codec_threads: int = 1
    table_threads: tuple[int, ...] = (1, 2)
    small: bool = False
    recv_chunk_bytes: int = 64 * MIB  # the nodes' (wiiide.wire.format.DEFAULT_RECV_CHUNK_BYTES)
    read_ahead_bytes: int = 0
    sections: tuple[str, ...] = SECTIONS
    frame_readers: tuple[str, ...] = ("whole",)

    def __post_init__(self) -> None:
        for name in ("sizes_bytes", "frame_codecs", "table_codecs", "link_rates_bps", "link_policies",
                     "table_threads", "sections", "frame_readers"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not self.sizes_bytes or any(s < FLOAT32_BYTES or s % FLOAT32_BYTES for s in self.sizes_bytes):
            raise PlanError(f"--sizes: {list(self.sizes_bytes)} bytes: each size must be a positive multiple of "
                            f"{FLOAT32_BYTES} bytes (whole float32 elements), e.g. 64KiB,1MiB")
        if any(r < 0 for r in self.link_rates_bps):
            raise PlanError(f"--link-rates: {list(self.link_rates_bps)} bit/s: rates must be >= 0 (0 = unpaced)")
        for option, value in (("--repeats", self.repeats), ("--link-messages", self.link_messages),
                              ("--bytes-per-trial-mib", self.bytes_per_trial),
                              ("--codec-threads", self.codec_threads)):
            if value < 1:
                raise PlanError(f"{option}: {value} must be >= 1")
        if not self.table_threads or min(self.table_threads) < 1:
            raise PlanError(f"table_threads: {list(self.table_threads)}: each must be >= 1")
        if self.recv_chunk_bytes < MIN_RECV_CHUNK_BYTES:
            raise PlanError(f"--recv-chunk-bytes: {self.recv_chunk_bytes} bytes: at least 1 KiB")
        if not 0 <= self.read_ahead_bytes <= MIB:
            raise PlanError(f"--read-ahead-bytes: {self.read_ahead_bytes} bytes: 0 .. 1 MiB")
        if (not self.frame_readers or set(self.frame_readers) - set(FRAME_READERS)
                or len(set(self.frame_readers)) != len(self.frame_readers)):
            raise PlanError(f"--frame-readers: {list(self.frame_readers)}: distinct names of {list(FRAME_READERS)}")
        if not self.sections or set(self.sections) - set(SECTIONS):
            raise PlanError(f"--sections: {list(self.sections)}: a non-empty list of {list(SECTIONS)}")
        self._check_names()

    def _check_names(self) -> None:
        from wiiide.codecs import codec_from_name
        from wiiide.codecs.policy import CompressionPolicy

        for option, names in (("frame_codecs", self.frame_codecs), ("table_codecs", self.table_codecs)):
            for name in names:
                try:
                    codec_from_name(name)
                except ValueError as exc:
                    raise PlanError(f"{option}: {exc}") from None
        for name in self.link_policies:
            try:
                CompressionPolicy(name).close()
            except ValueError as exc:
                raise PlanError(f"link_policies: {exc}") from None

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready values (lists for tuples); the report's ``plan`` and the source peer's ``--plan``."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "WirePlan":
        """The inverse of `as_dict`.

        Raises:
            PlanError: an unknown key (the message lists the known ones) or a value `WirePlan` refuses.
        """
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise PlanError(f"plan: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**values)
