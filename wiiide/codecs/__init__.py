"""Codecs for tensor payloads, behind a registry keyed by their wire id.

A codec turns the raw bytes of a message's tensors into the bytes that travel, and back. Each codec
declares whether it is lossless. Decoding is bounded: a payload that would decode to more bytes than
its header declares raises `ProtocolError` (no decompression bombs).

The registry is checked at import: every wire id maps to exactly one codec class.
(Design after hivemind's ``hivemind/compression/``.)
"""

from __future__ import annotations

import zlib
from typing import ClassVar

from wiiide.errors import ProtocolError

Buffer = bytes | bytearray | memoryview


class Codec:
    """Base class. Subclasses set `wire_id` and `lossless` and implement encode/decode."""

    wire_id: ClassVar[str] = ""
    lossless: ClassVar[bool] = True

    @property
    def name(self) -> str:
        """Name used in configs and metrics, e.g. ``zlib-1``; the wire id if the codec has no level."""
        return self.wire_id

    def encode(self, raw: Buffer) -> Buffer:
        """Raw bytes -> wire bytes."""
        raise NotImplementedError

    def decode(self, wire: Buffer, raw_nbytes: int) -> Buffer:
        """Wire bytes -> exactly `raw_nbytes` raw bytes.

        Raises:
            ProtocolError: the payload is corrupt or decodes to a different size than declared.
        """
        raise NotImplementedError


class NoCodec(Codec):
    """Identity: the payload is the raw bytes (no copy)."""

    wire_id = "none"

    def encode(self, raw: Buffer) -> Buffer:
        return raw

    def decode(self, wire: Buffer, raw_nbytes: int) -> Buffer:
        if len(wire) != raw_nbytes:
            raise ProtocolError(
                f"codec 'none': payload is {len(wire)} bytes but the header declares {raw_nbytes}"
            )
        return wire


class ZlibCodec(Codec):
    """zlib (DEFLATE) at a level 1-9, as in the seeds. About 25 MB/s at level 1 on fp32 gradients here."""

    wire_id = "zlib"

    def __init__(self, level: int = 6) -> None:
        if not 1 <= level <= 9:
            raise ValueError(f"zlib level must be 1..9, got {level}")
        self.level = level

    @property
    def name(self) -> str:
        return f"zlib-{self.level}"

    def encode(self, raw: Buffer) -> Buffer:
        return zlib.compress(raw, self.level)

    def decode(self, wire: Buffer, raw_nbytes: int) -> Buffer:
        decompressor = zlib.decompressobj()
        try:
            # max_length bounds the output: one byte more than declared reveals an oversized payload.
            out = decompressor.decompress(wire, raw_nbytes + 1)
        except zlib.error as exc:
            raise ProtocolError(f"codec 'zlib': corrupt payload: {exc}") from None
        if len(out) != raw_nbytes or not decompressor.eof or decompressor.unconsumed_tail:
            raise ProtocolError(
                f"codec 'zlib': payload does not decompress to the declared {raw_nbytes} bytes "
                f"(got {len(out)}{'+' if decompressor.unconsumed_tail else ''}, "
                f"stream {'complete' if decompressor.eof else 'truncated'})"
            )
        return out


REGISTRY: dict[str, type[Codec]] = {cls.wire_id: cls for cls in (NoCodec, ZlibCodec)}

# Import-time check: every wire id is unique and non-empty.
assert all(wid and REGISTRY[wid].wire_id == wid for wid in REGISTRY), "codec registry is inconsistent"
assert len(REGISTRY) == len({cls for cls in REGISTRY.values()}), "two wire ids share a codec class"

_DECODERS: dict[str, Codec] = {"none": NoCodec(), "zlib": ZlibCodec()}


def decoder_for(wire_id: str) -> Codec:
    """The codec that decodes payloads with this wire id.

    Raises:
        ProtocolError: unknown wire id.
    """
    try:
        return _DECODERS[wire_id]
    except (KeyError, TypeError):
        raise ProtocolError(f"unknown codec {wire_id!r}; known: {sorted(REGISTRY)}") from None


def codec_from_name(name: str) -> Codec:
    """``none`` or ``zlib-N`` -> a codec instance.

    Raises:
        ValueError: unknown name or level.
    """
    if name == "none":
        return NoCodec()
    if name.startswith("zlib-"):
        return ZlibCodec(int(name.split("-", 1)[1]))
    raise ValueError(f"unknown codec name {name!r}")


from wiiide.codecs.policy import CompressionPolicy  # noqa: E402  (re-export)

__all__ = ["Codec", "NoCodec", "ZlibCodec", "REGISTRY", "decoder_for", "codec_from_name", "CompressionPolicy"]
