"""The codec registry: every codec class by its wire id, the decoder of a wire id, codecs by name.

The registry is checked at import: every wire id maps to exactly one codec class, and every class
has a decoder instance (after hivemind's ``hivemind/compression/``). Both the wire's decoding
(`wiiide.wire.decode`, which decodes by wire id) and the compression policy (`wiiide.codecs.policy`,
which builds codecs by name) import this module; it imports only the codec implementations.
"""

from __future__ import annotations

from wiiide.codecs.base import Codec, NoCodec
from wiiide.codecs.lossless import Blosc2Codec, Lz4Codec, ZlibCodec, ZstdCodec
from wiiide.codecs.lossy.blockwise import Int8BlockCodec
from wiiide.codecs.lossy.casts import Bf16Codec, Fp16Codec
from wiiide.codecs.lossy.lloyd import Lloyd2BlockCodec, Lloyd3BlockCodec
from wiiide.codecs.lossy.packed import Int2BlockCodec, Int3BlockCodec, Int3ZstdBlockCodec, Int4BlockCodec
from wiiide.codecs.lossy.topk import TopKCodec
from wiiide.codecs.rows import RowsCodec
from wiiide.errors import ProtocolError

CODEC_CLASSES: tuple[type[Codec], ...] = (NoCodec, ZlibCodec, ZstdCodec, Lz4Codec, Blosc2Codec,
                                          Fp16Codec, Bf16Codec, Int8BlockCodec, Int4BlockCodec,
                                          Int3BlockCodec, Int3ZstdBlockCodec, Int2BlockCodec, Lloyd2BlockCodec,
                                          Lloyd3BlockCodec, TopKCodec, RowsCodec)
REGISTRY: dict[str, type[Codec]] = {cls.wire_id: cls for cls in CODEC_CLASSES}
# One decoder per wire id: decoding needs no level or state (lossy parameters travel in the header).
_DECODERS: dict[str, Codec] = {wid: cls() for wid, cls in REGISTRY.items()}


def _check_registry() -> None:
    """Import-time check: wire ids unique, non-empty, short ASCII, one class each, each decodable."""
    if len(REGISTRY) != len(CODEC_CLASSES):
        raise RuntimeError(f"codec registry: duplicate wire ids among {[c.wire_id for c in CODEC_CLASSES]}")
    for wid, cls in REGISTRY.items():
        if not (wid and wid.isascii() and len(wid) <= 16 and cls.wire_id == wid and issubclass(cls, Codec)):
            raise RuntimeError(f"codec registry: bad entry {wid!r} -> {cls!r}")
        if cls.lossless is not (cls in (NoCodec, ZlibCodec, ZstdCodec, Lz4Codec, Blosc2Codec, RowsCodec)):
            raise RuntimeError(f"codec registry: {wid!r} has an unexpected lossless flag")
        if type(_DECODERS[wid]) is not cls:
            raise RuntimeError(f"codec registry: no decoder for {wid!r}")


_check_registry()


def decoder_for(wire_id: str) -> Codec:
    """The codec that decodes payloads with this wire id.

    Raises:
        ProtocolError: unknown wire id.
    """
    try:
        return _DECODERS[wire_id]
    except (KeyError, TypeError):
        raise ProtocolError(f"unknown codec {wire_id!r}; known: {sorted(REGISTRY)}") from None


CODEC_NAME_FORMS = ("none", "zlib-1..9", "zstd-1..22", "lz4", "shuffle-zstd[-1..9]", "shuffle-lz4[-1..9]",
                    "fp16", "bf16", "int8[-<block 16..65536>]", "int4[-<block 16..65536>]",
                    "int3[-<block 16..65536>]", "int3z[-<block 16..65536>]", "int2[-<block 16..65536>]",
                    "lloyd2[-<block 16..65536>]", "lloyd3[-<block 16..65536>]", "topk-<fraction 0..1>", "rows")


def codec_from_name(name: str) -> Codec:
    """A codec name (one of `CODEC_NAME_FORMS`, e.g. ``zstd-3``, ``topk-0.01``) -> a new codec instance.

    Raises:
        ValueError: unknown name or out-of-range level, block or fraction.
    """
    if not isinstance(name, str):
        raise ValueError(f"codec name must be a string, got {name!r}")
    head, _, arg = name.partition("-")
    try:
        if name == "none":
            return NoCodec()
        if head == "zlib" and arg:
            return ZlibCodec(int(arg))
        if head == "zstd" and arg:
            return ZstdCodec(int(arg))
        if name == "lz4":
            return Lz4Codec()
        if name == "rows":
            return RowsCodec()
        if head == "shuffle" and arg:
            inner, _, level = arg.partition("-")
            if inner in ("zstd", "lz4"):
                return Blosc2Codec(inner, int(level) if level else 1)
        if name in ("fp16", "bf16"):
            return Fp16Codec() if name == "fp16" else Bf16Codec()
        if head == "int8":
            return Int8BlockCodec(int(arg) if arg else Int8BlockCodec.DEFAULT_BLOCK)
        if head == "int4":
            return Int4BlockCodec(int(arg) if arg else Int4BlockCodec.DEFAULT_BLOCK)
        if head == "int3":
            return Int3BlockCodec(int(arg) if arg else Int3BlockCodec.DEFAULT_BLOCK)
        if head == "int3z":
            return Int3ZstdBlockCodec(int(arg) if arg else Int3ZstdBlockCodec.DEFAULT_BLOCK)
        if head == "int2":
            return Int2BlockCodec(int(arg) if arg else Int2BlockCodec.DEFAULT_BLOCK)
        if head == "lloyd2":
            return Lloyd2BlockCodec(int(arg) if arg else Lloyd2BlockCodec.DEFAULT_BLOCK)
        if head == "lloyd3":
            return Lloyd3BlockCodec(int(arg) if arg else Lloyd3BlockCodec.DEFAULT_BLOCK)
        if head == "topk" and arg:
            return TopKCodec(float(arg))
    except ValueError as exc:
        raise ValueError(f"codec {name!r}: {exc}") from None
    raise ValueError(f"unknown codec name {name!r}; known forms: {', '.join(CODEC_NAME_FORMS)}")


__all__ = ["CODEC_CLASSES", "REGISTRY", "CODEC_NAME_FORMS", "decoder_for", "codec_from_name"]
