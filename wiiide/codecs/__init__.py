"""Codecs for tensor payloads, behind a registry keyed by their wire id.

A codec turns the tensors of one message into the bytes that travel, and back. Each codec is a small
class with a `wire_id` (what the frame header names), a `lossless` flag and bounded decoding: a
payload that would decode to more (or fewer) bytes than its header declares raises `ProtocolError`
(no decompression bombs). (Design after hivemind's ``hivemind/compression/``.)

=========  ========  ==========================================================================
wire id    lossless  what travels
=========  ========  ==========================================================================
none       yes       the raw bytes (no copy)
zlib       yes       DEFLATE, levels 1-9 (the seeds' codec; about 25 MB/s at level 1 here)
zstd       yes       Zstandard, levels 1-22 (``zstandard`` package; releases the GIL)
lz4        yes       LZ4 block format (``lz4`` package; releases the GIL)
blosc2     yes       byte-shuffle (typesize = the tensors' itemsize) + per-byte-plane zstd or lz4
fp16       no        float32 -> float16, clamped to +-65504 (float32 tensors only)
bf16       no        float32 -> bfloat16, round to nearest even (float32 tensors only)
int8       no        8-bit blockwise absmax quantization: one float32 scale per block
topk       no        the k largest magnitudes per tensor (int32 index + float32 value), with
                     error feedback: what is not sent is kept per tensor and added back next time
=========  ========  ==========================================================================

Lossless codecs work on bytes (any dtype). Lossy codecs change what travels (dtype, element count),
so they carry their parameters in the header's ``codec_params`` and the receiver rebuilds exactly
the float32 tensors the header declares; they refuse any message with a non-float32 tensor.
Large lossless payloads may be split into chunks encoded on a thread pool
(`wiiide.codecs.chunked`); the chunk table travels in ``codec_params`` too.

The registry is checked at import: every wire id maps to exactly one codec class, and every class
has a decoder instance.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import numpy as np

from wiiide.errors import ProtocolError

Buffer = bytes | bytearray | memoryview
# (wire dtype name, element count) of each tensor a header declares, in order.
TensorSpecs = Sequence[tuple[str, int]]


class Codec:
    """Base class. Subclasses set `wire_id` and `lossless`.

    Lossless subclasses implement `encode`/`decode` on bytes; lossy ones override
    `encode_message`/`decode_message`, which see the tensors.
    """

    wire_id: ClassVar[str] = ""
    lossless: ClassVar[bool] = True
    # True when encode/decode release the GIL, so chunks of one payload can run on a thread pool.
    releases_gil: ClassVar[bool] = False

    @property
    def name(self) -> str:
        """Name used in configs and metrics, e.g. ``zlib-1``; the wire id if the codec has no level."""
        return self.wire_id

    def supports(self, arrays: Sequence[np.ndarray]) -> bool:
        """Whether this codec can encode a message holding these arrays (lossless: any dtype)."""
        return True

    # -- byte codecs --------------------------------------------------------------------------
    def encode(self, raw: Buffer, itemsize: int = 1) -> Buffer:
        """Raw bytes -> wire bytes. `itemsize` (bytes per element) lets shuffling codecs group bytes."""
        raise NotImplementedError

    def decode(self, wire: Buffer, raw_nbytes: int) -> Buffer:
        """Wire bytes -> exactly `raw_nbytes` raw bytes.

        Raises:
            ProtocolError: the payload is corrupt or decodes to a different size than declared.
        """
        raise NotImplementedError

    # -- whole messages -------------------------------------------------------------------------
    def encode_message(self, arrays: Sequence[np.ndarray], names: Sequence[str], stream: str = "",
                       pool: Any = None) -> tuple[list[Buffer], dict[str, Any]]:
        """The tensors of one message (C-contiguous arrays) -> (payload buffers in order, codec_params).

        `stream` names the message stream (e.g. ``gradients``) for codecs that keep state per tensor.
        `pool` (a `wiiide.codecs.chunked.CodecPool`) lets large payloads be encoded in parallel chunks.
        """
        from wiiide.codecs.chunked import encode_bytes

        return encode_bytes(self, arrays, pool)

    def decode_message(self, wire: memoryview, raw_nbytes: int, params: dict[str, Any], specs: TensorSpecs,
                       pool: Any = None) -> Buffer:
        """Payload -> exactly `raw_nbytes` raw bytes of the tensors `specs` declares.

        Raises:
            ProtocolError: bad `params`, a corrupt payload, or one that decodes to another size.
        """
        from wiiide.codecs.chunked import decode_bytes

        return decode_bytes(self, wire, raw_nbytes, params, pool)


class NoCodec(Codec):
    """Identity: the payload is the raw bytes (no copy)."""

    wire_id = "none"

    def encode(self, raw: Buffer, itemsize: int = 1) -> Buffer:
        return raw

    def decode(self, wire: Buffer, raw_nbytes: int) -> Buffer:
        if len(wire) != raw_nbytes:
            raise ProtocolError(
                f"codec 'none': payload is {len(wire)} bytes but the header declares {raw_nbytes}"
            )
        return wire

    def encode_message(self, arrays, names, stream="", pool=None):
        # The tensors' own buffers go to sendmsg: no join, no copy.
        return [byte_view(a) for a in arrays if a.nbytes], {}

    def decode_message(self, wire, raw_nbytes, params, specs, pool=None):
        check_params("none", params, set())
        return self.decode(wire, raw_nbytes)


def byte_view(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, any shape (also zero-dim or empty), as a flat memoryview (no copy)."""
    return memoryview(array.reshape(-1)).cast("B")


def check_params(wire_id: str, params: Any, allowed: set[str], required: set[str] = frozenset()) -> None:
    """Raise ProtocolError unless `params` is a dict with only `allowed` keys and every `required` one."""
    if not isinstance(params, dict):
        raise ProtocolError(f"codec {wire_id!r}: codec_params must be an object")
    unknown = set(params) - set(allowed)
    if unknown:
        raise ProtocolError(f"codec {wire_id!r}: unknown codec_params {sorted(unknown)[:5]}")
    missing = set(required) - set(params)
    if missing:
        raise ProtocolError(f"codec {wire_id!r}: codec_params lacks {sorted(missing)}")


from wiiide.codecs.lossless import Blosc2Codec, Lz4Codec, ZlibCodec, ZstdCodec  # noqa: E402
from wiiide.codecs.lossy import Bf16Codec, Fp16Codec, Int8BlockCodec, TopKCodec  # noqa: E402

CODEC_CLASSES: tuple[type[Codec], ...] = (NoCodec, ZlibCodec, ZstdCodec, Lz4Codec, Blosc2Codec,
                                          Fp16Codec, Bf16Codec, Int8BlockCodec, TopKCodec)
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
        if cls.lossless is not (cls in (NoCodec, ZlibCodec, ZstdCodec, Lz4Codec, Blosc2Codec)):
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
                    "fp16", "bf16", "int8[-<block 16..65536>]", "topk-<fraction 0..1>")


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
        if head == "shuffle" and arg:
            inner, _, level = arg.partition("-")
            if inner in ("zstd", "lz4"):
                return Blosc2Codec(inner, int(level) if level else 1)
        if name in ("fp16", "bf16"):
            return Fp16Codec() if name == "fp16" else Bf16Codec()
        if head == "int8":
            return Int8BlockCodec(int(arg) if arg else Int8BlockCodec.DEFAULT_BLOCK)
        if head == "topk" and arg:
            return TopKCodec(float(arg))
    except ValueError as exc:
        raise ValueError(f"codec {name!r}: {exc}") from None
    raise ValueError(f"unknown codec name {name!r}; known forms: {', '.join(CODEC_NAME_FORMS)}")


from wiiide.codecs.policy import CompressionPolicy, check_policy_name  # noqa: E402  (re-export)

__all__ = ["Codec", "NoCodec", "ZlibCodec", "ZstdCodec", "Lz4Codec", "Blosc2Codec", "Fp16Codec", "Bf16Codec",
           "Int8BlockCodec", "TopKCodec", "REGISTRY", "CODEC_NAME_FORMS", "decoder_for", "codec_from_name",
           "check_params", "byte_view", "CompressionPolicy", "check_policy_name"]
