"""Casts of float32 to 16 bits: fp16 (clamped to +-65504) and bf16 (round to nearest even), and what
every lossy codec shares (float32 only, sizes checked against the header).

Error bounds: `wiiide.codecs.lossy`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from wiiide.codecs.base import Codec, TensorSpecs, check_params
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
