"""Lloyd-Max codes for Gaussian blocks: lloyd2 and lloyd3 (levels from Max 1960, in units of the
block's mean |x|).

Error bounds: `wiiide.codecs.lossy`.
"""

from __future__ import annotations

import math

import numpy as np

from wiiide.codecs.lossy.blockwise import _BlockwiseCodec
from wiiide.codecs.lossy.casts import F32, _expect_size
from wiiide.codecs.lossy.packed import _codes_nbytes, _groups12, _pack_codes


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
    level is a level, not a clamp at the max): meant to run under error feedback (`wiiide.server.pace.feedback`),
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
    feedback (`wiiide.server.pace.feedback`), which carries the difference to the next step."""

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

