"""Blockwise absmax quantization to fewer than 8 bits: int4, int3, int3z (int3's codes through zstd) and
int2, with the code packing they (and the Lloyd-Max codecs) use.

Error bounds: `wiiide.codecs.lossy`.
"""

from __future__ import annotations

import numpy as np

from wiiide.codecs.base import Buffer
from wiiide.codecs.lossless import ZstdCodec
from wiiide.codecs.lossy.blockwise import _BlockwiseCodec, _blockwise_scales
from wiiide.codecs.lossy.casts import F32, _expect_size
from wiiide.errors import ProtocolError


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
    `wiiide.server.pace.feedback`), as 1- to 4-bit gradient quantizers do (Seide et al. 2014, 1-bit SGD;
    Karimireddy et al. 2019, EF-SGD); without it the rounding error is lost each step."""

    wire_id = "int4"
    BITS, LEVELS = 4, 7


class Int3BlockCodec(_PackedBlockCodec):
    """3-bit blockwise absmax quantization: per block of `block` values one float32 scale (max|x| / 3) and one
    code in -3..3 per value, eight codes to three bytes (lowest bits first, stored as code + 4). About 10x
    smaller at block 256. Its squared error on a Gaussian (about 0.09) is more than `Lloyd3BlockCodec`'s
    (0.035) at the same size, but its error is bounded per value (<= scale / 2). Under two-way error feedback
    on the 26 MB model the int3 runs followed fp32's held-out accuracy seed by seed and the lloyd3 runs did
    not (docs/engines.md, "Which lossy codec"; why is not measured). Meant to run under error feedback, as
    `Int4BlockCodec` is."""

    wire_id = "int3"
    BITS, LEVELS = 3, 3


class Int3ZstdBlockCodec(Int3BlockCodec):
    """`Int3BlockCodec`'s values, entropy-coded: the same scales and codes in -3..3, but the codes packed two
    a byte (as int4's nibbles, stored as code + 4) and that byte stream compressed with Zstandard at level 1
    (whose Huffman coding of the 49 byte values does the work); the float32 scales travel as they are. A
    message decodes to exactly int3's values for the same input; only the size changes, and with the data.
    (A sharded run still differs from int3's: its partitions follow its ratio, `wiiide.server.ps.partition`.)

    The size depends on the values: the heavier their tails, the more codes are 0 and the fewer bits a value.
    In blocks of 256, scales included: about 2.2 bits a value for Gaussian values and 1.8 for Laplace ones
    (tests/unit/test_wire_codecs.py checks the Laplace case against int3 and lloyd2), 14.6-15.6x on one
    gradient of the project's MLPs (``python -m harness bench-wire --sections codecs``), against int3's
    10.24x and lloyd2's 15.06x; its encoding and decoding take 1.3-2.6x lloyd2's time there (studies/lossy-accuracy/)."""

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
    sharded server's `wiiide.server.pace.feedback`), as `Int4BlockCodec` is."""

    wire_id = "int2"
    BITS, LEVELS = 2, 1


# Max (1960), "Quantizing for minimum distortion", IRE Trans. Inf. Theory 6(1), Table I, N = 4 for a
