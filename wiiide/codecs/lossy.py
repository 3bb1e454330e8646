"""Lossy codecs for float32 gradients: fp16 and bf16 casts, 8-, 4-, 3- and 2-bit blockwise quantization (linear), 2- and
3-bit Lloyd-Max, top-k.

Each one refuses a message holding any tensor that is not float32 (`supports`), so it can only be
chosen for float32 payloads; the policies use them for gradient messages only, after warm-up
(`wiiide.codecs.policy`). The receiver rebuilds float32 tensors of exactly the declared shapes; the
payload size is checked against what the header's shapes and ``codec_params`` imply before any
array is built, so a lossy frame can never decode to more than its declared ``raw_nbytes``. Decoding
always builds a new array (never a view of the payload), so a receiver may keep it past the next read
(`wiiide.ps.feedback.received_values`).

Error bounds (tested in tests/unit/test_wire_codecs.py), for finite inputs x:
- fp16: |x| <= 65504 (larger values are clamped to +-65504): relative error <= 2**-11 for normal
  halves (|x| >= 2**-14), absolute error <= 2**-25 below; nan stays nan.
- bf16: round to nearest even of the top 16 bits: relative error <= 2**-8; nan stays nan.
- int8: per block of `block` elements, scale = max|x| / 127; |error| <= scale / 2.
- int4: per block of `block` elements, scale = max|x| / 7; |error| <= scale / 2 (two values a byte).
- int3: per block of `block` elements, scale = max|x| / 3; |error| <= scale / 2 (eight values to three bytes).
- int3z: int3's values exactly (its codes entropy-coded with zstd).
- int2: per block of `block` elements, scale = max|x|, codes -1..1; |error| <= scale / 2 (four values a
  byte).
- lloyd2: no bound per value (four levels +-0.5675 m, +-1.8930 m, m = the block's mean |x|); relative squared
  error about 0.12 on Gaussian blocks (Max 1960's 0.1175), under error feedback only.
- lloyd3: no bound per value (eight levels +-0.3072, +-0.9475, +-1.6845, +-2.6971 m); relative squared error about
  0.035 on Gaussian blocks (Max 1960's 0.03454), under error feedback only.
- topk: the k = ceil(fraction * n) largest |x + residual| per tensor travel exactly; the rest is kept
  in the sender's residual and added to that tensor next time (error feedback, as in Stich et al.
  2018, "Sparsified SGD with memory", and PyTorch's PowerSGD hook). So the sum of everything decoded
  plus the residual equals the sum of everything encoded.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from wiiide.codecs.base import Buffer, Codec, TensorSpecs, check_params
from wiiide.codecs.lossless import ZstdCodec
from wiiide.errors import ProtocolError

F16_MAX = 65504.0
F32 = np.dtype("<f4")


def _flat_float32(arrays: Sequence[np.ndarray], wire_id: str) -> list[np.ndarray]:
    flats = []
    for a in arrays:
        if a.dtype != F32:
            raise ValueError(f"codec {wire_id!r} encodes float32 tensors only, got {a.dtype}")
        flats.append(a.reshape(-1))
    return flats


def _float32_count(wire_id: str, raw_nbytes: int, specs: TensorSpecs) -> int:
    """Element count of a lossy payload's tensors; ProtocolError unless every one is float32."""
    if any(dtype != "float32" for dtype, _ in specs):
        raise ProtocolError(f"codec {wire_id!r} carries float32 tensors only, the header declares "
                            f"{sorted({d for d, _ in specs})}")
    count = sum(n for _, n in specs)
    if count * 4 != raw_nbytes:
        raise ProtocolError(f"codec {wire_id!r}: {count} float32 elements but raw_nbytes {raw_nbytes}")
    return count


def _expect_size(wire_id: str, wire: memoryview, expected: int) -> None:
    if wire.nbytes != expected:
        raise ProtocolError(f"codec {wire_id!r}: payload is {wire.nbytes} bytes, the header implies {expected}")


class _Float32Codec(Codec):
    lossless = False

    def supports(self, arrays: Sequence[np.ndarray]) -> bool:
        return bool(arrays) and all(a.dtype == F32 for a in arrays)


class Fp16Codec(_Float32Codec):
    """float32 -> IEEE half, values beyond +-65504 clamped (so no gradient becomes inf). 2x smaller."""

    wire_id = "fp16"

    def encode_message(self, arrays, names, stream="", pool=None):
        """float32 tensors -> one buffer of float16 values (2 bytes each), clamped to +-65504; no codec_params.

        Raises:
            ValueError: a tensor that is not float32.
        """
        flats = _flat_float32(arrays, self.wire_id)
        out = np.empty(sum(f.size for f in flats), dtype="<f2")
        at = 0
        with np.errstate(over="ignore"):
            for f in flats:
                out[at:at + f.size] = f  # one casting pass; overflow gives inf, clamped below
                at += f.size
        np.clip(out, -F16_MAX, F16_MAX, out=out)
        return [memoryview(out).cast("B")] if out.size else [], {}

    def decode_message(self, wire, raw_nbytes, params, specs, pool=None):
        """float16 payload -> the declared float32 tensors' bytes.

        Raises:
            ProtocolError: codec_params given, a non-float32 spec, or a payload not 2 bytes per element.
        """
        check_params(self.wire_id, params, set())
        n = _float32_count(self.wire_id, raw_nbytes, specs)
        _expect_size(self.wire_id, wire, 2 * n)
        return memoryview(np.frombuffer(wire, dtype="<f2", count=n).astype(F32)).cast("B")


class Bf16Codec(_Float32Codec):
    """float32 -> bfloat16 (round to nearest even, nan kept as a quiet nan). 2x smaller, fp32's range."""

    wire_id = "bf16"

    def encode_message(self, arrays, names, stream="", pool=None):
        """float32 tensors -> one buffer of bfloat16 bit patterns (uint16, round to nearest even); no codec_params.

        Raises:
            ValueError: a tensor that is not float32.
        """
        flats = _flat_float32(arrays, self.wire_id)
        bits = np.concatenate(flats).view(np.uint32) if len(flats) != 1 else flats[0].view(np.uint32)
        rounded = bits >> 16
        rounded &= 1
        rounded += 0x7FFF
        rounded += bits  # wraps only for nan bit patterns, fixed below
        rounded >>= 16
        out = rounded.astype("<u2")
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        if nan.any():
            out[nan] = ((bits[nan] >> 16) | 0x0040).astype("<u2")
        return [memoryview(out).cast("B")] if out.size else [], {}

    def decode_message(self, wire, raw_nbytes, params, specs, pool=None):
        """bfloat16 payload -> the declared float32 tensors' bytes (low 16 bits zero).

        Raises:
            ProtocolError: codec_params given, a non-float32 spec, or a payload not 2 bytes per element.
        """
        check_params(self.wire_id, params, set())
        n = _float32_count(self.wire_id, raw_nbytes, specs)
        _expect_size(self.wire_id, wire, 2 * n)
        out = np.frombuffer(wire, dtype="<u2", count=n).astype("<u4")
        out <<= 16
        return memoryview(out.view(F32)).cast("B")


class _BlockwiseCodec(_Float32Codec):
    """What the blockwise quantizers share: a block size (`MIN_BLOCK`..`MAX_BLOCK` values per float32
    scale), their name (``<wire id>`` at the default block, else ``<wire id>-<block>``), encoding with or
    without the decoded values (`_encode`: flattening, then `_quantize` per subclass) and the check of the block a header declares."""

    DEFAULT_BLOCK = 256
    MIN_BLOCK, MAX_BLOCK = 16, 65536

    def __init__(self, block: int = DEFAULT_BLOCK) -> None:
        if not self.MIN_BLOCK <= block <= self.MAX_BLOCK:
            raise ValueError(f"{self.wire_id} block must be {self.MIN_BLOCK}..{self.MAX_BLOCK}, got {block}")
        self.block = block

    @property
    def name(self) -> str:
        """``<wire id>`` at the default block (256), else ``<wire id>-<block>``."""
        return self.wire_id if self.block == self.DEFAULT_BLOCK else f"{self.wire_id}-{self.block}"

    def encode_message(self, arrays, names, stream="", pool=None):
        """float32 tensors -> (payload parts, codec_params ``{"block": block}``), the layout of `_encode`.

        Raises:
            ValueError: a tensor that is not float32.
        """
        parts, params, _ = self._encode(arrays, values=False)
        return parts, params

    def encode_message_values(self, arrays, names, stream="", pool=None):
        """`encode_message` and the decoded values, computed from the codes (no decoding).

        Raises:
            ValueError: a tensor that is not float32.
        """
        return self._encode(arrays, values=True)

    def _encode(self, arrays, values: bool):
        """(payload parts, codec_params, float32 decoded values when `values` else None): the tensors
        flattened into one float32 vector for `_quantize` (an empty one has no payload)."""
        flats = _flat_float32(arrays, self.wire_id)
        x = flats[0] if len(flats) == 1 else np.concatenate(flats)
        if x.size == 0:
            return [], {"block": self.block}, (np.empty(0, dtype=F32) if values else None)
        return self._quantize(x, values)

    def _quantize(self, x: np.ndarray, values: bool):
        """`_encode` of a non-empty flat float32 vector `x`. Subclasses."""
        raise NotImplementedError

    def _header_counts(self, params, raw_nbytes: int, specs: TensorSpecs) -> tuple[int, int, int]:
        """(block, float32 element count, block count) of a received header; ProtocolError unless the
        block is an integer in range and every spec is float32 adding up to `raw_nbytes`."""
        check_params(self.wire_id, params, {"block"}, {"block"})
        b = params["block"]
        if not isinstance(b, int) or isinstance(b, bool) or not self.MIN_BLOCK <= b <= self.MAX_BLOCK:
            raise ProtocolError(f"codec {self.wire_id!r}: block must be an integer {self.MIN_BLOCK}..{self.MAX_BLOCK}")
        n = _float32_count(self.wire_id, raw_nbytes, specs)
        return b, n, -(-n // b)


class Int8BlockCodec(_BlockwiseCodec):
    """8-bit blockwise absmax quantization: per block of `block` values one float32 scale
    (max|x| / 127) and one int8 per value. About 3.9x smaller at block 256 (after bitsandbytes'
    blockwise 8-bit quantization, Dettmers et al. 2022, with a linear code)."""

    wire_id = "int8"

    def _quantize(self, x: np.ndarray, values: bool):
        """float32 values -> (float32 scale per block, int8 per value); codec_params ``{"block": block}``;
        with `values`, value x scale as `decode_message` computes it."""
        n, b = x.size, self.block
        nb = -(-n // b)
        full = n // b
        scales = np.empty(nb, dtype=F32)
        q = np.empty(n, dtype=np.int8)
        decoded = np.empty(n, dtype=F32) if values else None
        pieces = [(x[:full * b].reshape(full, b), scales[:full], q[:full * b].reshape(full, b),
                   decoded[:full * b].reshape(full, b) if values else None)]
        if full < nb:
            pieces.append((x[full * b:].reshape(1, -1), scales[full:], q[full * b:].reshape(1, -1),
                           decoded[full * b:].reshape(1, -1) if values else None))
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            for xs, sc, qs, out in pieces:
                np.max(np.abs(xs), axis=1, out=sc)
                sc /= 127.0
                scaled = xs / np.where(sc > 0, sc, np.float32(1.0))[:, None]  # not x * (1 / sc): see _blockwise_scales
                np.rint(scaled, out=scaled)
                np.clip(scaled, -127, 127, out=scaled)
                qs[...] = scaled
                if out is not None:
                    np.multiply(scaled, sc[:, None], out=out)  # decode_message's (value x scale)
        return [memoryview(scales).cast("B"), memoryview(q).cast("B")], {"block": b}, decoded

    def decode_message(self, wire, raw_nbytes, params, specs, pool=None):
        """Scales and int8 values -> the declared float32 tensors' bytes (value x scale).

        Raises:
            ProtocolError: a bad block size in codec_params, a non-float32 spec, or a payload size that does
                not match the declared element count.
        """
        b, n, nb = self._header_counts(params, raw_nbytes, specs)
        _expect_size(self.wire_id, wire, 4 * nb + n)
        scales = np.frombuffer(wire, dtype=F32, count=nb)
        q = np.frombuffer(wire, dtype=np.int8, count=n, offset=4 * nb)
        out = np.empty(n, dtype=F32)
        full = n // b
        np.multiply(q[:full * b].reshape(full, b), scales[:full, None], out=out[:full * b].reshape(full, b))
        if full < nb:
            np.multiply(q[full * b:], scales[full], out=out[full * b:])
        return memoryview(out).cast("B")


def _blockwise_scales(x: np.ndarray, block: int, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Absmax quantization of flat float32 `x` in blocks of `block`: (scale per block, float32
    codes in -levels..levels, rounded to nearest). scale = max|x| / levels (0 for an all-zero block,
    whose codes are 0). Shapes: (ceil(n / block),), (ceil(n / block), block): the last block padded
    with zero codes. Raises nothing."""
    n = x.size
    nb = -(-n // block)
    pad = nb * block - n
    xs = np.pad(x, (0, pad)) if pad else x
    xs = xs.reshape(nb, block)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore", under="ignore"):
        scales = np.max(np.abs(xs), axis=1).astype(F32)
        scales /= levels
        # x / scale, not x * (1 / scale): below about 2.9e-39 a scale's inverse overflows float32 to inf,
        # and 0 x inf is NaN (whose code would be garbage); |x| / scale <= levels never overflows.
        codes = xs / np.where(scales > 0, scales, np.float32(1.0))[:, None]
        np.rint(codes, out=codes)
        np.clip(codes, -levels, levels, out=codes)
    return scales, codes


def _pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """`bits`-bit codes (uint8, each < 2**bits, a multiple of 8 // bits of them; 8 for 3 bits) packed 8 // bits
    a byte (3 bits: `_pack_codes3`), lowest bits first: uint8, shape (codes.size * bits // 8,). Raises
    nothing."""
    if bits == 3:
        return _pack_codes3(codes)
    columns = codes.reshape(-1, 8 // bits)
    packed = columns[:, 0].copy()
    for i in range(1, columns.shape[1]):
        packed |= columns[:, i] << (bits * i)
    return packed


def _codes_nbytes(n: int, bits: int) -> int:
    """Bytes of `n` packed `bits`-bit codes (2 or 4: 8 // bits a byte; 3: eight to three bytes), the last byte
    or group padded. Raises nothing."""
    group = 8 if bits == 3 else 8 // bits
    return -(-n // group) * group * bits // 8


def _pack_codes3(codes: np.ndarray) -> np.ndarray:
    """3-bit codes (uint8, each < 8, a multiple of 8 of them) packed eight to three bytes, lowest bits first
    (code i of a group at bits 3i..3i+2 of a little-endian 24-bit word): uint8, shape (codes.size * 3 // 8,).
    Raises nothing."""
    columns = codes.reshape(-1, 8)
    word = np.zeros(columns.shape[0], dtype="<u4")
    for i in range(8):
        word |= columns[:, i].astype("<u4") << (3 * i)
    return np.ascontiguousarray(word.view(np.uint8).reshape(-1, 4)[:, :3]).reshape(-1)


def _unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of `_pack_codes`: uint8 packed codes -> every code, int8, shape (packed.size * 8 // bits,).
    Raises nothing."""
    if bits == 3:
        return _unpack_codes3(packed)
    per_byte = 8 // bits
    columns = np.empty((packed.size, per_byte), dtype=np.int8)
    mask = (1 << bits) - 1
    for i in range(per_byte):
        np.bitwise_and(packed >> (bits * i) if i else packed, mask, out=columns[:, i], casting="unsafe")
    return columns.reshape(-1)


def _unpack_codes3(packed: np.ndarray) -> np.ndarray:
    """The inverse of `_pack_codes3`: uint8 (3 m,) -> the 8 m codes, int8 (8 m,). Raises nothing."""
    return _CODES3_OF_GROUP.take(_groups12(packed).reshape(-1), axis=0).reshape(-1)


def _groups12(packed: np.ndarray) -> np.ndarray:
    """The 12-bit groups of four 3-bit codes in `_pack_codes3`'s layout: uint8 (3 m,) -> uint16 (m, 2), the
    low then the high half of each three bytes' little-endian 24-bit word. Raises nothing."""
    triples = packed.reshape(-1, 3)
    word = triples[:, 0].astype("<u4")
    word |= triples[:, 1].astype("<u4") << 8
    word |= triples[:, 2].astype("<u4") << 16
    groups = np.empty((triples.shape[0], 2), dtype=np.uint16)
    np.bitwise_and(word, 0xFFF, out=groups[:, 0], casting="unsafe")
    np.right_shift(word, 12, out=groups[:, 1], casting="unsafe")
    return groups


# The four 3-bit codes of every 12-bit group, lowest bits first: shape (4096, 4), int8 (codes 0..7).
_CODES3_OF_GROUP = ((np.arange(4096)[:, None] >> np.array([0, 3, 6, 9])) & 7).astype(np.int8)


class _PackedBlockCodec(_BlockwiseCodec):
    """Blockwise absmax quantization to `BITS`-bit codes in -`LEVELS`..`LEVELS`, stored as code +
    `LEVELS` + 1 (so a code of 0 never occurs), 8 // `BITS` codes a byte (2 or 4 bits) or eight to three
    bytes (3 bits), lowest bits first (`_pack_codes`); per block of `block` values one float32 scale
    (max|x| / `LEVELS`). The last byte (group) is padded with zero-value codes. Subclasses set `wire_id`,
    `BITS` and `LEVELS`."""

    BITS = 4
    LEVELS = 7

    def _quantize(self, x: np.ndarray, values: bool):
        """float32 values -> (float32 scale per block, packed codes: `_codes_nbytes` (n, BITS) bytes);
        codec_params ``{"block": block}``; with `values`, code x scale as `decode_message` computes it."""
        n = x.size
        scales, codes = _blockwise_scales(x, self.block, self.LEVELS)
        stored = np.full(_codes_nbytes(n, self.BITS) * 8 // self.BITS, self.LEVELS + 1, dtype=np.uint8)
        np.add(codes.reshape(-1)[:n], self.LEVELS + 1, out=stored[:n], casting="unsafe")
        packed = _pack_codes(stored, self.BITS)
        decoded = None
        if values:
            codes *= scales[:, None]  # the codes are done with: decode_message's (code x scale), in place
            decoded = codes.reshape(-1)[:n]
        return [memoryview(scales).cast("B"), self._codes_part(packed)], {"block": self.block}, decoded

    def _codes_part(self, packed: np.ndarray) -> Buffer:
        """The packed codes as they travel after the scales: the packed bytes themselves (`Int3ZstdBlockCodec`
        compresses them)."""
        return memoryview(packed).cast("B")

    def _packed_codes(self, wire: memoryview, offset: int, packed_nbytes: int) -> np.ndarray:
        """The packed codes of a payload whose scales take its first `offset` bytes: uint8 (packed_nbytes,).

        Raises:
            ProtocolError: the payload is not exactly `offset` + `packed_nbytes` bytes.
        """
        _expect_size(self.wire_id, wire, offset + packed_nbytes)
        return np.frombuffer(wire, dtype=np.uint8, count=packed_nbytes, offset=offset)

    def decode_message(self, wire, raw_nbytes, params, specs, pool=None):
        """Scales and packed codes -> the declared float32 tensors' bytes ((stored code - LEVELS - 1) x scale).

        Raises:
            ProtocolError: a bad block size in codec_params, a non-float32 spec, a payload size that does
                not match the declared element count, or a stored code outside 1..2 LEVELS + 1 (a code of 0
                among them); for int3z also a corrupt zstd frame or one declaring another size.
        """
        b, n, nb = self._header_counts(params, raw_nbytes, specs)
        packed = self._packed_codes(wire, 4 * nb, _codes_nbytes(n, self.BITS))
        if n == 0:
            return memoryview(b"")
        scales = np.frombuffer(wire, dtype=F32, count=nb)
        codes = _unpack_codes(packed, self.BITS)[:n]
        top = 2 * self.LEVELS + 1  # the largest stored code; BITS may hold more (int3z: 4 bits for 1..7)
        if not codes.all():
            raise ProtocolError(f"codec {self.wire_id!r}: a code of 0 (codes are 1..{top} for "
                                f"-{self.LEVELS}..{self.LEVELS})")
        if top < (1 << self.BITS) - 1 and codes.max() > top:
            raise ProtocolError(f"codec {self.wire_id!r}: a code above {top} (codes are 1..{top} for "
                                f"-{self.LEVELS}..{self.LEVELS})")
        codes -= self.LEVELS + 1
        out = np.empty(nb * b, dtype=F32)
        out[n:] = 0.0
        out[:n] = codes
        out.reshape(nb, b)[...] *= scales[:, None]
        return memoryview(out[:n]).cast("B")


class Int4BlockCodec(_PackedBlockCodec):
    """4-bit blockwise absmax quantization: per block of `block` values one float32 scale
    (max|x| / 7) and one 4-bit code in -7..7 per value, two codes a byte (low nibble first, stored as
    code + 8). About 7.8x smaller at block 256. Meant to run under error feedback (the sharded server's
    `wiiide.ps.feedback`), as 1- to 4-bit gradient quantizers do (Seide et al. 2014, 1-bit SGD;
    Karimireddy et al. 2019, EF-SGD); without it the rounding error is lost each step."""

    wire_id = "int4"
    BITS, LEVELS = 4, 7


class Int3BlockCodec(_PackedBlockCodec):
    """3-bit blockwise absmax quantization: per block of `block` values one float32 scale (max|x| / 3) and one
    code in -3..3 per value, eight codes to three bytes (lowest bits first, stored as code + 4). About 10x
    smaller at block 256. Its squared error on a Gaussian (about 0.09) is more than `Lloyd3BlockCodec`'s
    (0.035) at the same size, but its error is bounded per value (<= scale / 2). Under two-way error feedback
    on the 26 MB model the int3 runs followed fp32's held-out accuracy seed by seed and the lloyd3 runs did
    not (README, "Sharded parameter servers"; why is not measured). Meant to run under error feedback, as
    `Int4BlockCodec` is."""

    wire_id = "int3"
    BITS, LEVELS = 3, 3


class Int3ZstdBlockCodec(Int3BlockCodec):
    """`Int3BlockCodec`'s values, entropy-coded: the same scales and codes in -3..3, but the codes packed two
    a byte (as int4's nibbles, stored as code + 4) and that byte stream compressed with Zstandard at level 1
    (whose Huffman coding of the 49 byte values does the work); the float32 scales travel as they are. A
    message decodes to exactly int3's values for the same input; only the size changes, and with the data.
    (A sharded run still differs from int3's: its partitions follow its ratio, `wiiide.ps.partition`.)

    The size depends on the values: the heavier their tails, the more codes are 0 and the fewer bits a value.
    In blocks of 256, scales included: about 2.2 bits a value for Gaussian values and 1.8 for Laplace ones
    (tests/unit/test_wire_codecs.py checks the Laplace case against int3 and lloyd2), 14.6-15.6x on one
    gradient of the project's MLPs (``python -m harness bench-wire --sections codecs``), against int3's
    10.24x and lloyd2's 15.06x; its encoding and decoding take 1.3-2.6x lloyd2's time there (README,
    "Sharded parameter servers", session 16)."""

    wire_id = "int3z"
    BITS, LEVELS = 4, 3
    ZSTD_LEVEL = 1  # level 3 took longer and coded the nibbles worse on Gaussian and Laplace values

    def _codes_part(self, packed: np.ndarray) -> Buffer:
        """The packed codes as one zstd frame (with its content size)."""
        return ZstdCodec(self.ZSTD_LEVEL).encode(memoryview(packed).cast("B"))

    def _packed_codes(self, wire: memoryview, offset: int, packed_nbytes: int) -> np.ndarray:
        """The zstd frame after the scales, decompressed to exactly `packed_nbytes` bytes (the frame's own size
        is checked against it before decompressing, so no frame can decode to more).

        Raises:
            ProtocolError: the payload is shorter than the scales, the frame is corrupt, or it declares another
                size than `packed_nbytes`.
        """
        if packed_nbytes == 0:
            _expect_size(self.wire_id, wire, offset)
            return np.empty(0, dtype=np.uint8)
        if wire.nbytes <= offset:
            raise ProtocolError(f"codec {self.wire_id!r}: payload is {wire.nbytes} bytes, the scales alone take "
                                f"{offset} and the codes' zstd frame follows them")
        try:
            packed = ZstdCodec(self.ZSTD_LEVEL).decode(wire[offset:], packed_nbytes)
        except ProtocolError as exc:
            raise ProtocolError(f"codec {self.wire_id!r}: the codes' frame: {exc}") from None
        return np.frombuffer(packed, dtype=np.uint8)


class Int2BlockCodec(_PackedBlockCodec):
    """2-bit blockwise absmax quantization (ternary): per block of `block` values one float32 scale
    (max|x|) and one code in -1..1 per value (rounded to nearest: |x| < scale / 2 becomes 0), four codes
    a byte (lowest bits first, stored as code + 2). About 15x smaller at block 256. The ternary levels of
    TernGrad (Wen et al. 2017) with deterministic rounding; meant to run under error feedback (the
    sharded server's `wiiide.ps.feedback`), as `Int4BlockCodec` is."""

    wire_id = "int2"
    BITS, LEVELS = 2, 1


# Max (1960), "Quantizing for minimum distortion", IRE Trans. Inf. Theory 6(1), Table I, N = 4 for a
# unit-variance Gaussian: decision threshold 0.9816, output levels 0.4528 and 1.510 (mean squared error
# 0.1175). Here in units of the block's mean |x| (E|x| = sqrt(2 / pi) for the unit Gaussian).
_MEAN_ABS_PER_SIGMA = math.sqrt(2.0 / math.pi)
LLOYD2_THRESHOLD = np.float32(0.9816 / _MEAN_ABS_PER_SIGMA)  # 1.2303 x mean|x|
LLOYD2_LEVELS = (np.float32(0.4528 / _MEAN_ABS_PER_SIGMA), np.float32(1.5104 / _MEAN_ABS_PER_SIGMA))  # 0.5675, 1.8930


# The four values of a code 2 x outer + negative, in units of the block's scale, and of every byte of four
# codes (lowest bits first): shape (256, 4), float32, so decoding is one gather of 4 KiB rows.
_LLOYD2_CODE_VALUES = np.array([LLOYD2_LEVELS[0], -LLOYD2_LEVELS[0], LLOYD2_LEVELS[1], -LLOYD2_LEVELS[1]], dtype=F32)
_LLOYD2_BYTE_VALUES = _LLOYD2_CODE_VALUES[(np.arange(256)[:, None] >> np.array([0, 2, 4, 6])) & 3]


def _lloyd2_values(packed: np.ndarray, scales: np.ndarray, block: int, n: int) -> np.ndarray:
    """The float32 values, shape (n,), of `n` packed 2-bit Lloyd-Max codes (uint8, shape (ceil(n / 4),)):
    each code's level (`_LLOYD2_CODE_VALUES`) x its block's scale (`scales`: float32, (ceil(n / block),)).
    The one computation both the encoder (error feedback's decoded values) and the decoder run. Raises
    nothing."""
    return _scaled_by_block(_LLOYD2_BYTE_VALUES.take(packed, axis=0).reshape(-1)[:n], scales, block)


def _scaled_by_block(out: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    """`out` (float32, (n,), levels in units of their block's scale) multiplied in place by `scales` (float32,
    (ceil(n / block),)), block by block; returns `out`. Raises nothing."""
    n = out.size
    nb, full = scales.size, n // block
    out[:full * block].reshape(full, block)[...] *= scales[:full, None]
    if full < nb:
        out[full * block:] *= scales[full]
    return out


class _LloydBlockCodec(_BlockwiseCodec):
    """What the Lloyd-Max codes share: scales (the block's mean |x|), then `BITS`-bit codes 2 x level index +
    negative, packed by `_pack_codes` and turned into values by `_values` (the one computation of encoder and
    decoder). Subclasses set `wire_id`, `BITS` and `_values`."""

    BITS = 2

    def _values(self, packed: np.ndarray, scales: np.ndarray, block: int, n: int) -> np.ndarray:
        raise NotImplementedError

    def _mean_magnitude_blocks(self, x: np.ndarray):
        """`_quantize`'s start: (scales: float32 (ceil(n / block),), each block's mean |x|; codes: uint8 zeros
        padded to whole bytes of `BITS`-bit codes; the blocks: (|x|, scale, codes) views shaped (blocks, block), the
        full blocks, then a short last one)."""
        n, b = x.size, self.block
        nb, full = -(-n // b), n // b
        magnitude = np.abs(x)
        scales = np.empty(nb, dtype=F32)
        codes = np.zeros(_codes_nbytes(n, self.BITS) * 8 // self.BITS, dtype=np.uint8)  # padding: code 0
        blocks = [(magnitude[:full * b].reshape(full, b), scales[:full], codes[:full * b].reshape(full, b))]
        if full < nb:
            blocks.append((magnitude[full * b:].reshape(1, -1), scales[full:], codes[full * b:n].reshape(1, -1)))
        with np.errstate(invalid="ignore", over="ignore"):
            for mags, scale, _ in blocks:
                np.mean(mags, axis=1, out=scale)
        return scales, codes, blocks

    def _finish(self, x: np.ndarray, scales: np.ndarray, codes: np.ndarray, values: bool):
        """`_quantize`'s end, from the level index of each value (`codes[:n]`, uint8, padded with 0): the
        sign bit added, the codes packed, the decoded values when asked for."""
        n = x.size
        codes[:n] <<= 1
        codes[:n] |= np.signbit(x).view(np.uint8)
        packed = _pack_codes(codes, self.BITS)
        decoded = self._values(packed, scales, self.block, n) if values else None
        return [memoryview(scales).cast("B"), memoryview(packed)], {"block": self.block}, decoded

    def decode_message(self, wire, raw_nbytes, params, specs, pool=None):
        """Scales and packed codes -> the declared float32 tensors' bytes (`_values`).

        Raises:
            ProtocolError: a bad block size in codec_params, a non-float32 spec, or a payload size that does
                not match the declared element count.
        """
        b, n, nb = self._header_counts(params, raw_nbytes, specs)
        packed_nbytes = _codes_nbytes(n, self.BITS)
        _expect_size(self.wire_id, wire, 4 * nb + packed_nbytes)
        if n == 0:
            return memoryview(b"")
        scales = np.frombuffer(wire, dtype=F32, count=nb)
        packed = np.frombuffer(wire, dtype=np.uint8, count=packed_nbytes, offset=4 * nb)
        with np.errstate(invalid="ignore", over="ignore"):
            return memoryview(self._values(packed, scales, b, n)).cast("B")


class Lloyd2BlockCodec(_LloydBlockCodec):
    """2-bit blockwise Lloyd-Max quantization: per block of `block` values one float32 scale m (the block's
    mean |x|) and a 2-bit code per value, 2 x outer + negative: |x| >= 1.2303 m (outer) decodes to
    +-1.8930 m, smaller ones to +-0.5675 m (Max 1960's four levels for a Gaussian, in units of its mean
    |x|). Payload: the scales, then the codes four a byte, lowest bits first (the last byte padded with
    code 0); all four codes are values. About 15x smaller at block 256, as `Int2BlockCodec`, with under a
    fifth of its squared error on a Gaussian (relative error 0.34 against 0.81: every value is sent as
    nonzero, where the ternary code rounds |x| < max/2 to 0). No bound on a value's error (the outer
    level is a level, not a clamp at the max): meant to run under error feedback (`wiiide.ps.feedback`),
    which carries the difference to the next step."""

    wire_id = "lloyd2"

    def _quantize(self, x: np.ndarray, values: bool):
        """float32 values -> (float32 mean |x| per block, 2-bit codes four a byte); codec_params
        ``{"block": block}``; with `values`, `_lloyd2_values` of the codes, as `decode_message` computes it."""
        scales, codes, blocks = self._mean_magnitude_blocks(x)
        with np.errstate(invalid="ignore", over="ignore"):
            for magnitude, scale, code in blocks:
                np.greater_equal(magnitude, scale[:, None] * LLOYD2_THRESHOLD, out=code.view(bool))
        return self._finish(x, scales, codes, values)

    def _values(self, packed: np.ndarray, scales: np.ndarray, block: int, n: int) -> np.ndarray:
        return _lloyd2_values(packed, scales, block, n)


# Max (1960), Table I, N = 8 for a unit-variance Gaussian: decision thresholds 0.5006, 1.050, 1.748 (and 0), output
# levels 0.2451, 0.7560, 1.344, 2.152 (mean squared error 0.03454); here in units of the block's mean |x|.
LLOYD3_THRESHOLDS = tuple(np.float32(t / _MEAN_ABS_PER_SIGMA) for t in (0.5006, 1.050, 1.748))  # 0.6274, 1.3160, 2.1908
LLOYD3_LEVELS = tuple(np.float32(v / _MEAN_ABS_PER_SIGMA) for v in (0.2451, 0.7560, 1.344, 2.152))  # 0.3072 .. 2.6971

# The eight values of a code 2 x magnitude index + negative, in units of the block's scale, and of every 12-bit group
# of four codes (lowest bits first): shape (4096, 4), float32 (64 KiB), so decoding is two gathers per 3 bytes.
_LLOYD3_CODE_VALUES = np.array([sign * level for level in LLOYD3_LEVELS for sign in (1, -1)], dtype=F32)
_LLOYD3_GROUP_VALUES = _LLOYD3_CODE_VALUES[(np.arange(4096)[:, None] >> np.array([0, 3, 6, 9])) & 7]


def _lloyd3_values(packed: np.ndarray, scales: np.ndarray, block: int, n: int) -> np.ndarray:
    """The float32 values, shape (n,), of `n` packed 3-bit Lloyd-Max codes (uint8, shape (3 ceil(n / 8),)): each
    code's level (`_LLOYD3_CODE_VALUES`) x its block's scale (`scales`: float32, (ceil(n / block),)). The one
    computation both the encoder (error feedback's decoded values) and the decoder run. Raises nothing."""
    return _scaled_by_block(_LLOYD3_GROUP_VALUES.take(_groups12(packed).reshape(-1), axis=0).reshape(-1)[:n],
                            scales, block)


class Lloyd3BlockCodec(_LloydBlockCodec):
    """3-bit blockwise Lloyd-Max quantization: per block of `block` values one float32 scale m (the block's
    mean |x|) and a 3-bit code per value, 2 x i + negative, i the number of thresholds 0.6274 m, 1.3160 m,
    2.1908 m that |x| reaches, decoding to +-0.3072, +-0.9475, +-1.6845 or +-2.6971 m (Max 1960's eight levels
    for a Gaussian, in units of its mean |x|). Payload: the scales, then the codes eight to three bytes, lowest
    bits first (the last group padded with code 0); all eight codes are values. About 10x smaller at block
    256, with under a third of `Lloyd2BlockCodec`'s squared error on a Gaussian (0.035 against 0.12;
    `Int4BlockCodec`, 7.8x, has about 0.014). No bound on a value's error: meant to run under error
    feedback (`wiiide.ps.feedback`), which carries the difference to the next step."""

    wire_id = "lloyd3"
    BITS = 3

    def _quantize(self, x: np.ndarray, values: bool):
        """float32 values -> (float32 mean |x| per block, 3-bit codes eight to three bytes); codec_params
        ``{"block": block}``; with `values`, `_lloyd3_values` of the codes, as `decode_message` computes it."""
        scales, codes, blocks = self._mean_magnitude_blocks(x)
        with np.errstate(invalid="ignore", over="ignore"):
            for magnitude, scale, code in blocks:
                for threshold in LLOYD3_THRESHOLDS:
                    code += magnitude >= scale[:, None] * threshold
        return self._finish(x, scales, codes, values)

    def _values(self, packed: np.ndarray, scales: np.ndarray, block: int, n: int) -> np.ndarray:
        return _lloyd3_values(packed, scales, block, n)


class TopKCodec(_Float32Codec):
    """Top-k sparsification with error feedback: per tensor, the k = ceil(fraction * n) entries of
    largest |x + residual| travel as (int32 index, float32 value); the rest becomes the new residual,
    kept on the sender per (stream, tensor name) and added back the next time that tensor is sent.

    8 bytes per kept value: at fraction 0.01, 50x smaller than float32.
    """

    wire_id = "topk"

    def __init__(self, fraction: float = 0.01) -> None:
        if not (isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0 and math.isfinite(fraction)):
            raise ValueError(f"top-k fraction must be in (0, 1], got {fraction!r}")
        self.fraction = float(fraction)
        self.residuals: dict[str, np.ndarray] = {}

    @property
    def name(self) -> str:
        """``topk-<fraction>`` (``%g``)."""
        return f"topk-{self.fraction:g}"

    def k_for(self, n: int) -> int:
        """Values kept of a tensor of `n` elements: ceil(fraction x n), at least 1 (0 for an empty tensor)."""
        return min(n, max(1, math.ceil(self.fraction * n))) if n else 0

    def encode_message(self, arrays, names, stream="", pool=None):
        """Per tensor the k largest |x + residual| as (int32 index, float32 value); the rest becomes that
        (stream, name)'s residual. codec_params hold each tensor's k.

        Raises:
            ValueError: a tensor that is not float32.
        """
        flats = _flat_float32(arrays, self.wire_id)
        index_parts, value_parts, ks = [], [], []
        for f, name in zip(flats, names):
            key = f"{stream}/{name}"
            n = f.size
            residual = self.residuals.get(key)
            acc = f + residual if residual is not None and residual.size == n else f.copy()
            k = self.k_for(n)
            if k < n:
                idx = np.argpartition(np.abs(acc), n - k)[n - k:].astype("<i4")
            else:
                idx = np.arange(n, dtype="<i4")
            values = acc[idx]
            acc[idx] = 0.0
            self.residuals[key] = acc  # what was not sent, added back next time
            index_parts.append(idx)
            value_parts.append(values.astype(F32, copy=False))
            ks.append(k)
        parts: list[Buffer] = []
        for idx, values in zip(index_parts, value_parts):
            if idx.size:
                parts += [memoryview(idx).cast("B"), memoryview(values).cast("B")]
        return parts, {"k": ks}

    def residual_of(self, stream: str, name: str) -> np.ndarray | None:
        """The error-feedback residual kept for a tensor (float32, flat), None before its first send."""
        return self.residuals.get(f"{stream}/{name}")

    def decode_message(self, wire, raw_nbytes, params, specs, pool=None):
        """Indices and values -> dense float32 tensors (zeros elsewhere) of the declared shapes.

        Raises:
            ProtocolError: a bad k list, an index out of range, or a payload of another size.
        """
        check_params(self.wire_id, params, {"k"}, {"k"})
        ks = params["k"]
        total = _float32_count(self.wire_id, raw_nbytes, specs)
        if (not isinstance(ks, list) or len(ks) != len(specs)
                or not all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= n
                           for k, (_, n) in zip(ks, specs))):
            raise ProtocolError("codec 'topk': 'k' must list, per tensor, an integer 0..its element count")
        _expect_size(self.wire_id, wire, 8 * sum(ks))
        out = np.zeros(total, dtype=F32)
        at_wire = at_out = 0
        for k, (_, n) in zip(ks, specs):
            if k:
                idx = np.frombuffer(wire, dtype="<i4", count=k, offset=at_wire)
                values = np.frombuffer(wire, dtype=F32, count=k, offset=at_wire + 4 * k)
                if idx.min() < 0 or idx.max() >= n:
                    raise ProtocolError(f"codec 'topk': an index is outside 0..{n - 1}")
                out[at_out:at_out + n][idx] = values
            at_wire += 8 * k
            at_out += n
        return memoryview(out).cast("B")
