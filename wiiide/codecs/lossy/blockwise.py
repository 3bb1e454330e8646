"""Blockwise absmax quantization: the block size and naming every blockwise codec shares, and int8.

Error bounds: `wiiide.codecs.lossy`.
"""

from __future__ import annotations

import numpy as np

from wiiide.codecs.base import TensorSpecs, check_params
from wiiide.codecs.lossy.casts import F32, _Float32Codec, _expect_size, _flat_float32, _float32_count
from wiiide.errors import ProtocolError


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
