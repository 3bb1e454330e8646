"""The ``rows`` codec: only the non-zero rows of each float32 tensor travel, as row ids plus values.

For a dense tensor that is mostly zero rows (an embedding table's gradient computed densely). The
parameter server's sparse embedding path (`wiiide.server.sparse`) does not use it: it never has the dense
tensor, and sends the ids and rows as tensors of their own, checked by `check_row_ids` as here (a
codec must scan the dense tensor to encode and hand back the dense tensor when it decodes). Each
tensor is seen as rows (its first dimension; a 1-D tensor has rows of one value). Per tensor, the
codec sends either

- *sparse*: the ids of the rows holding a non-zero value (strictly increasing, int32 when the tensor
  has fewer than 2^31 rows, else int64), then those rows (float32, row-major), or
- *dense*: the raw bytes, when sparse would not be smaller (a dense MLP layer).

It is lossless: the rows left out are exactly zero (a -0.0 row may come back as +0.0). ``codec_params``:
``{"id_bytes": 4 | 8, "tensors": [[row_elems, rows_sent or -1 for dense], ...]}``. Decoding checks
every field against the header's tensors and refuses ids out of range, repeated or out of order with a
`ProtocolError`, so a frame from the network cannot write outside the tensor or twice into one row.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from wiiide.codecs.base import Buffer, Codec, TensorSpecs, check_params
from wiiide.errors import ProtocolError
from wiiide.wire.format import byte_view

_DENSE = -1
_ID_DTYPES = {4: np.dtype("<i4"), 8: np.dtype("<i8")}


def _as_rows(array: np.ndarray) -> np.ndarray:
    """A (rows, row_elems) view of a C-contiguous array (a 0-D or 1-D array: rows of one value)."""
    if array.ndim <= 1:
        return array.reshape(-1, 1)
    return array.reshape(array.shape[0], -1)


def check_row_ids(ids: np.ndarray, rows: int, what: str) -> None:
    """Refuse row ids from the network that could write outside a (rows, ...) tensor or twice into a row.

    Args:
        ids: 1-D integer array (int32 or int64) of row ids, as received.
        rows: the tensor's rows; every id must be in 0..rows-1.
        what: the words that start the error message (e.g. ``codec 'rows'``).

    Raises:
        ProtocolError: an id out of range, or ids not strictly increasing (a repeated or unordered id).
    """
    if ids.size and (ids[0] < 0 or ids[-1] >= rows or ids.min() < 0 or ids.max() >= rows):
        raise ProtocolError(f"{what}: row id out of range 0..{rows - 1} (got {int(ids.min())}..{int(ids.max())})")
    if ids.size > 1 and not bool(np.all(ids[1:] > ids[:-1])):
        raise ProtocolError(f"{what}: row ids must be strictly increasing (a repeated or unordered id)")


class RowsCodec(Codec):
    """See the module docstring. float32 tensors only (`supports`)."""

    wire_id = "rows"
    lossless = True

    def supports(self, arrays: Sequence[np.ndarray]) -> bool:
        """True when every tensor is float32 (the rows travel as float32)."""
        return all(a.dtype == np.float32 for a in arrays)

    def encode_message(self, arrays, names, stream="", pool=None):
        """Tensors -> (payload parts: per tensor ids then rows, or its raw bytes; codec_params).

        Raises:
            ValueError: a tensor that is not float32.
        """
        if not self.supports(arrays):
            raise ValueError("codec 'rows' encodes float32 tensors only")
        max_rows = max((_as_rows(a).shape[0] for a in arrays), default=0)
        id_bytes = 4 if max_rows < 2**31 else 8
        parts: list[Buffer] = []
        entries: list[list[int]] = []
        for array in arrays:
            rows = _as_rows(np.ascontiguousarray(array))
            row_elems = rows.shape[1] if rows.shape[0] else max(1, int(np.prod(array.shape[1:], dtype=np.int64)))
            touched = np.flatnonzero(rows.any(axis=1)) if rows.size else np.zeros(0, dtype=np.int64)
            if touched.size * (id_bytes + 4 * row_elems) >= array.nbytes:
                entries.append([row_elems, _DENSE])
                parts.append(byte_view(np.ascontiguousarray(array)))
                continue
            entries.append([row_elems, int(touched.size)])
            parts.append(byte_view(touched.astype(_ID_DTYPES[id_bytes])))
            parts.append(byte_view(np.ascontiguousarray(rows[touched])))
        return [p for p in parts if p.nbytes], {"id_bytes": id_bytes, "tensors": entries}

    def decode_message(self, wire: memoryview, raw_nbytes: int, params: dict[str, Any], specs: TensorSpecs,
                       pool: Any = None) -> Buffer:
        """Payload -> the raw bytes of the tensors `specs` declares (zeros where no row was sent).

        Raises:
            ProtocolError: bad ``codec_params`` (missing, wrong types, not matching the tensors), a tensor
                that is not float32, ids out of range, repeated or not increasing, or a payload of
                another size than the params imply.
        """
        check_params("rows", params, {"id_bytes", "tensors"}, {"id_bytes", "tensors"})
        id_bytes, entries = params["id_bytes"], params["tensors"]
        if type(id_bytes) is not int or id_bytes not in _ID_DTYPES:  # noqa: E721 (True == 1)
            raise ProtocolError(f"codec 'rows': id_bytes must be 4 or 8, got {id_bytes!r:.40}")
        if not isinstance(entries, list) or len(entries) != len(specs):
            raise ProtocolError(f"codec 'rows': codec_params describe {len(entries) if isinstance(entries, list) else '?'} "
                                f"tensors, the header declares {len(specs)}")
        out = np.zeros(raw_nbytes, dtype=np.uint8)
        src = np.frombuffer(wire, dtype=np.uint8)
        pos = dst = 0
        for (dtype, count), entry in zip(specs, entries):
            if dtype != "float32":
                raise ProtocolError(f"codec 'rows': tensors must be float32, the header declares {dtype!r:.20}")
            if (not isinstance(entry, list) or len(entry) != 2
                    or any(type(v) is not int for v in entry)):  # noqa: E721 (no bools)
                raise ProtocolError("codec 'rows': each tensor entry must be [row_elems, rows_sent]")
            row_elems, sent = entry
            if row_elems < 1 or count % row_elems:
                raise ProtocolError(f"codec 'rows': row_elems {row_elems} does not divide the tensor's {count} values")
            nbytes, rows = 4 * count, count // row_elems
            if sent == _DENSE:
                need = nbytes
                if pos + need > len(src):
                    raise ProtocolError("codec 'rows': payload shorter than its dense tensor")
                out[dst:dst + nbytes] = src[pos:pos + need]
            else:
                if not 0 <= sent <= rows:
                    raise ProtocolError(f"codec 'rows': {sent} rows sent for a tensor of {rows} rows")
                need = sent * (id_bytes + 4 * row_elems)
                if pos + need > len(src):
                    raise ProtocolError("codec 'rows': payload shorter than its ids and rows")
                ids = src[pos:pos + sent * id_bytes].view(_ID_DTYPES[id_bytes])
                check_row_ids(ids, rows, "codec 'rows'")
                values = src[pos + sent * id_bytes:pos + need].view(np.float32).reshape(sent, row_elems)
                target = out[dst:dst + nbytes].view(np.float32).reshape(rows, row_elems)
                target[ids] = values
            pos += need
            dst += nbytes
        if pos != len(src) or dst != raw_nbytes:
            raise ProtocolError(f"codec 'rows': payload of {len(src)} bytes, its tensors account for {pos} "
                                f"(raw {dst} of {raw_nbytes} declared)")
        return memoryview(out)
