"""Compression policies: which codec encodes a given message.

- ``none``: never compress.
- ``zlib-N``: every message at zlib level N.
- ``adaptive``: the seeds' rule (seed 001/004, "Adaptive Compression Strategy"): gradient messages
  larger than `threshold_bytes` (1 MiB) at zlib level 1, smaller gradient messages uncompressed,
  every other message at zlib level 9.
"""

from __future__ import annotations

from wiiide.codecs import Codec, NoCodec, ZlibCodec, codec_from_name

GRADIENT_KINDS = frozenset({"gradients"})


class CompressionPolicy:
    """Chooses a codec per message from its kind and raw size (bytes)."""

    def __init__(self, name: str, threshold_bytes: int = 1024 * 1024) -> None:
        self.name = name
        self.threshold_bytes = threshold_bytes
        if name == "adaptive":
            self._fixed: Codec | None = None
            self._none, self._fast, self._best = NoCodec(), ZlibCodec(1), ZlibCodec(9)
        else:
            self._fixed = codec_from_name(name)

    def choose(self, kind: str, raw_nbytes: int) -> Codec:
        """Codec for a message of `kind` (e.g. ``gradients``, ``params``) with `raw_nbytes` of tensors."""
        if self._fixed is not None:
            return self._fixed
        if kind in GRADIENT_KINDS:
            return self._fast if raw_nbytes > self.threshold_bytes else self._none
        return self._best
