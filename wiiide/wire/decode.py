"""Decoding frames: the header's validation (`parse_header`) and the payload's decoding into numpy arrays
(`decode_payload`), by the codec the header names (`wiiide.codecs.registry`). Anything malformed raises
`ProtocolError`; callers close that connection.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import numpy as np

from wiiide.codecs.chunked import CodecPool
from wiiide.codecs.registry import decoder_for
from wiiide.errors import ProtocolError
from wiiide.wire.format import DTYPES, MAX_NAME_CHARS, MAX_TENSOR_RANK, MAX_TENSORS
from wiiide.wire.messages import Message, WireTensor


def parse_header(header_bytes: bytes | bytearray, max_raw_nbytes: int) -> dict[str, Any]:
    """Parse and validate a frame header (JSON). Raises ProtocolError naming what is wrong."""
    try:
        # json.loads(bytes) would accept UTF-8-encoded surrogates ('surrogatepass'): decode strictly.
        header_text = header_bytes.decode("utf-8")
        header = json.loads(header_text)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError includes integers of more than sys.get_int_max_str_digits() digits
        raise ProtocolError(f"frame header is not valid UTF-8 JSON: {str(exc)[:200]}") from None
    if not isinstance(header, dict):
        raise ProtocolError("frame header is not a JSON object")
    if "\\u" in header_text:  # only an escape can make a lone surrogate: check when there is one
        _refuse_lone_surrogates(header)
    kind, meta, codec = header.get("kind"), header.get("meta", {}), header.get("codec")
    raw_nbytes, tensors = header.get("raw_nbytes"), header.get("tensors")
    if not isinstance(kind, str) or not 0 < len(kind) <= 64:
        raise ProtocolError(f"frame header: 'kind' must be a short string, got {kind!r:.80}")
    if not isinstance(meta, dict):
        raise ProtocolError("frame header: 'meta' must be an object")
    if not isinstance(codec, str):
        raise ProtocolError(f"frame header: 'codec' must be a string, got {codec!r:.80}")
    decoder_for(codec)  # unknown codec -> ProtocolError
    if not isinstance(header.get("codec_params", {}), dict):
        raise ProtocolError("frame header: 'codec_params' must be an object")
    if not _is_int(raw_nbytes) or not 0 <= raw_nbytes <= max_raw_nbytes:
        raise ProtocolError(f"frame header: 'raw_nbytes' must be an integer in 0..{max_raw_nbytes}, got {raw_nbytes!r:.80}")
    if not isinstance(tensors, list) or len(tensors) > MAX_TENSORS:
        raise ProtocolError(f"frame header: 'tensors' must be a list of at most {MAX_TENSORS} entries")
    total = 0
    for i, t in enumerate(tensors):
        if not isinstance(t, dict):
            raise ProtocolError(f"frame header: tensor {i} is not an object")
        name, dtype, shape = t.get("name"), t.get("dtype"), t.get("shape")
        if not isinstance(name, str) or len(name) > MAX_NAME_CHARS:
            raise ProtocolError(f"frame header: tensor {i} has a bad name")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ProtocolError(f"tensor {name!r}: unknown dtype {dtype!r:.40}; allowed: {sorted(DTYPES)}")
        if (not isinstance(shape, list) or len(shape) > MAX_TENSOR_RANK
                or not all(_is_int(d) and d >= 0 for d in shape)):
            raise ProtocolError(f"tensor {name!r}: shape must be a list of at most {MAX_TENSOR_RANK} non-negative integers")
        total += _tensor_nbytes(shape, DTYPES[dtype].itemsize, max_raw_nbytes)
        if total > raw_nbytes:
            break
    if total != raw_nbytes:
        need = f"more than {max_raw_nbytes}" if total > max_raw_nbytes else f"{total}+"
        raise ProtocolError(f"frame header: tensor shapes need {need} bytes but 'raw_nbytes' declares {raw_nbytes}")
    return header


def _tensor_nbytes(shape: list[int], itemsize: int, limit_nbytes: int) -> int:
    """Bytes of a tensor of `shape` (non-negative ints) and `itemsize`, or `limit_nbytes + 1` as soon as
    the running product passes `limit_nbytes`: a header may declare dimensions of any size (eight of
    10^600), and their exact product is never built (nor formatted: Python refuses to print an int of
    more than 4300 digits, sys.get_int_max_str_digits)."""
    if 0 in shape:
        return 0
    nbytes = itemsize
    for dim in shape:
        nbytes *= dim
        if nbytes > limit_nbytes:
            return limit_nbytes + 1
    return nbytes


def _refuse_lone_surrogates(value: Any) -> None:
    """Raise ProtocolError when a string anywhere in a parsed JSON value holds a lone surrogate.

    JSON's \\uD800 escapes can produce them; they are not Unicode scalar values, so they cannot be
    encoded to UTF-8 (a MAC, a log line or the metrics file would fail later). I-JSON (RFC 7493,
    section 2.1) forbids them. Iterative: the depth is bounded by json's own recursion limit anyway.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            strings = (item,)
        elif isinstance(item, dict):
            strings = item.keys()
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
            continue
        else:
            continue
        for text in strings:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ProtocolError("frame header holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF "
                                    "escape): not valid Unicode (RFC 7493 I-JSON, section 2.1)") from None


def decode_payload(header: dict[str, Any], payload: memoryview, pool: CodecPool | None = None) -> Message:
    """Decode a validated header's payload into numpy arrays (views, no copy when uncompressed).

    Raises ProtocolError when the payload does not decode to exactly the declared bytes.
    """
    t0 = time.perf_counter()
    specs = [(t["dtype"], math.prod(t["shape"])) for t in header["tensors"]]
    raw = decoder_for(header["codec"]).decode_message(payload, header["raw_nbytes"],
                                                      header.get("codec_params", {}), specs, pool)
    raw = memoryview(raw)
    if raw.format != "B" or raw.ndim != 1:
        raw = raw.cast("B")
    if raw.nbytes != header["raw_nbytes"]:  # every decoder checks this; a last guard for the views below
        raise ProtocolError(f"codec {header['codec']!r} decoded {raw.nbytes} bytes, header declares {header['raw_nbytes']}")
    tensors, offset = [], 0
    for t, (dtype, count) in zip(header["tensors"], specs):
        dt = DTYPES[dtype]
        shape = t["shape"]
        if count == 0:
            try:
                array = np.empty(shape, dtype=dt)
            except ValueError as exc:  # e.g. [0, 2**70]: zero elements but a dimension numpy cannot hold
                raise ProtocolError(f"tensor {t['name']!r}: shape {str(shape)[:200]} cannot be built: "
                                    f"{str(exc)[:200]}") from None
        else:
            array = np.frombuffer(raw, dtype=dt, count=count, offset=offset)
            if len(shape) != 1:  # frombuffer already made the 1-d shape [count]
                array = array.reshape(shape)
        offset += count * dt.itemsize
        tensors.append(WireTensor.of_wire(t["name"], array, dtype))
    return Message(
        kind=header["kind"], meta=header.get("meta", {}), tensors=tensors, codec=header["codec"],
        raw_nbytes=header["raw_nbytes"], decode_s=time.perf_counter() - t0, payload_nbytes=payload.nbytes,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
