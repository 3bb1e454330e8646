"""Top-k sparsification with error feedback (the residual kept per tensor by the sender).

Error bounds: `wiiide.codecs.lossy`.
"""

from __future__ import annotations

import math

import numpy as np

from wiiide.codecs.base import Buffer, check_params
from wiiide.codecs.lossy.casts import F32, _Float32Codec, _expect_size, _flat_float32, _float32_count
from wiiide.errors import ProtocolError


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
