"""Building frames: the JSON header (encoded from cached templates) and the payload a codec made.

`encode_message` takes any codec object with the `wiiide.codecs.base.Codec` interface (it imports no
codec module: the compression policy in `wiiide.codecs.policy` builds frames with it); the identity
codec (wire id ``none``) sends the tensors' own buffers.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

from wiiide.wire.format import MAGIC, MAX_HEADER_BYTES, PAYLOAD_ALIGN_BYTES, PREFIX, PREFIX_NBYTES, PROTOCOL_VERSION, byte_view
from wiiide.wire.messages import Frame, WireTensor

if TYPE_CHECKING:  # annotations only: this module sits below the codecs
    from wiiide.codecs.base import Codec
    from wiiide.codecs.chunked import CodecPool


# The header's JSON encoder, built once (json.dumps(..., separators=...) builds a new JSONEncoder on every
# call); its output is json.dumps's. Stateless, so threads may share it.
_HEADER_JSON = json.JSONEncoder(separators=(",", ":"))


def _make_value_json() -> Any:
    """A function giving `_HEADER_JSON.encode(value)`'s text for a dict or list `value` without building
    json's C encoder anew on each call (`JSONEncoder.iterencode` does; that was 0.6 of the 0.9 us a
    frame's ``{"step": 0}`` took), or `_HEADER_JSON.encode` itself where json has no C encoder or it
    takes other arguments. No circular-reference check: a value that contains itself raises
    RecursionError (ValueError with `_HEADER_JSON`); the values are the nodes' own metadata."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return _HEADER_JSON.encode
    try:
        encoder = make(None, _HEADER_JSON.default, json.encoder.encode_basestring_ascii, None, ":", ",",
                       False, False, True)
        probe = {"a": [1, 2.5, "\u00e9", None, True, float("nan")]}
        if "".join(encoder(probe, 0)) != _HEADER_JSON.encode(probe):
            return _HEADER_JSON.encode
    except TypeError:  # another Python's signature
        return _HEADER_JSON.encode
    return lambda value: "".join(encoder(value, 0))


_value_json = _make_value_json()


def encode_message(
    kind: str,
    meta: dict[str, Any] | None = None,
    tensors: Sequence[WireTensor] = (),
    codec: Codec | None = None,
    pool: CodecPool | None = None,
    stream: str | None = None,
    decoded_values: bool = False,
) -> Frame:
    """Build a frame. With the identity codec the tensors' own buffers are sent (no copy).

    Args:
        codec: the codec of the payload (default: none). A message without tensor bytes is sent as none.
        pool: a codec thread pool; large lossless payloads are then encoded in parallel chunks.
        stream: the key codecs with per-tensor state use (top-k's residual); default: `kind`.
        decoded_values: keep in `Frame.decoded` what the receiver will decode, when the codec has it at
            hand (`Codec.encode_message_values`; error feedback's use).

    Raises:
        ValueError: a header larger than MAX_HEADER_BYTES (too many tensors or too much metadata), or a
            lossy codec given a tensor it cannot encode (not float32).
    """
    if codec is None or codec.wire_id == "none" or not any(t.array.nbytes for t in tensors):
        return _identity_frame(kind, meta or {}, tensors)  # a message without tensor bytes is sent as none
    arrays = [t.array for t in tensors]
    raw_nbytes = sum(a.nbytes for a in arrays)
    t0 = time.perf_counter()
    names, stream = [t.name for t in tensors], kind if stream is None else stream
    if decoded_values:
        payload_parts, codec_params, decoded = codec.encode_message_values(arrays, names, stream, pool)
    else:
        (payload_parts, codec_params), decoded = codec.encode_message(arrays, names, stream, pool), None
    encode_s = time.perf_counter() - t0
    sizes = [memoryview(p).nbytes for p in payload_parts]
    payload_parts = [p for p, n in zip(payload_parts, sizes) if n]
    payload_nbytes = sum(sizes)
    wire_id = codec.wire_id
    template = _header_template(kind, wire_id, raw_nbytes, tensors)
    meta = meta or {}
    header = {"kind": kind, "meta": meta, "codec": wire_id, "raw_nbytes": raw_nbytes, "tensors": template.specs}
    if codec_params:
        header["codec_params"] = codec_params
    return Frame(buffers=[template.frame_head(meta, codec_params, payload_nbytes), *payload_parts], kind=kind,
                 codec=codec.name, raw_nbytes=raw_nbytes, payload_nbytes=payload_nbytes, encode_s=encode_s,
                 wire_id=wire_id, codec_params=codec_params, header=header, decoded=decoded)


def _identity_frame(kind: str, meta: dict[str, Any], tensors: Sequence[WireTensor]) -> Frame:
    """`encode_message` with the identity codec, the nodes' default: the tensors' own buffers, no codec
    call and nothing to time. Kept apart and short: the sender's Python between two sends costs a stream
    of 1 MiB frames several times its own microseconds (see _TEMPLATES)."""
    if len(tensors) == 1:
        array = tensors[0].array
        raw_nbytes = array.nbytes
        payload_parts = [byte_view(array)] if raw_nbytes else []
    else:
        raw_nbytes = sum(t.array.nbytes for t in tensors)
        payload_parts = [byte_view(t.array) for t in tensors if t.array.nbytes]
    template = _header_template(kind, "none", raw_nbytes, tensors)
    header = {"kind": kind, "meta": meta, "codec": "none", "raw_nbytes": raw_nbytes, "tensors": template.specs}
    return Frame([template.frame_head(meta, None, raw_nbytes), *payload_parts], kind, "none", raw_nbytes,
                 raw_nbytes, 0.0, "none", {}, header)


class _HeaderTemplate:
    """The JSON header of every frame of one kind, codec and tensor list, but for its ``meta`` and
    ``codec_params``: the text before the meta and after it, encoded once (`_header_template`).

    `specs` is the header's ``tensors`` list, shared by the frames built from this template: read-only.
    """

    __slots__ = ("specs", "before_meta", "after_meta", "after_meta_closed")

    def __init__(self, kind: str, wire_id: str, raw_nbytes: int, tensors: Sequence[WireTensor]) -> None:
        self.specs = [{"name": t.name, "dtype": t.dtype, "shape": list(t.array.shape)} for t in tensors]
        enc = _HEADER_JSON.encode
        # The keys in encode_message's order; _HEADER_JSON.encode of the whole header gives the same text.
        self.before_meta = f'{{"kind":{enc(kind)},"meta":'.encode()
        self.after_meta = f',"codec":{enc(wire_id)},"raw_nbytes":{raw_nbytes},"tensors":{enc(self.specs)}'.encode()
        self.after_meta_closed = self.after_meta + b"}"  # the header's end when it has no codec_params

    def frame_head(self, meta: dict[str, Any], codec_params: dict[str, Any] | None, payload_nbytes: int) -> bytes:
        """The frame's prefix and header (see `_frame_head`) with `meta` and `codec_params` filled in.

        Raises:
            ValueError: a header larger than MAX_HEADER_BYTES.
        """
        tail = (self.after_meta + f',"codec_params":{_value_json(codec_params)}}}'.encode() if codec_params
                else self.after_meta_closed)
        return _pack_head(self.before_meta + _value_json(meta).encode() + tail, payload_nbytes)


# Recent header templates, keyed by kind, codec and (name, dtype, shape) of every tensor: a node sends the
# same shapes step after step, and encoding a header's JSON whole took 2.0 of encode_message's 5.4 us;
# that time between two sends cost 1 MiB frames about 20 % of their throughput between two containers
# (bench-wire, and a loop with a 6 us busy wait per frame between the sends). Cleared when full; shared by
# threads (a dict's get and set are atomic under the GIL; a race builds one entry twice).
_TEMPLATES: dict[tuple[Any, ...], _HeaderTemplate] = {}
_TEMPLATES_MAX = 512


def _header_template(kind: str, wire_id: str, raw_nbytes: int, tensors: Sequence[WireTensor]) -> _HeaderTemplate:
    """The `_HeaderTemplate` of a frame of `kind`, codec `wire_id` and `tensors` (from `_TEMPLATES` when
    seen before; `raw_nbytes` follows from the tensors' dtypes and shapes)."""
    if len(tensors) == 1:  # the common case, without a list: (kind, codec, name, dtype, shape)
        tensor = tensors[0]
        key: tuple[Any, ...] = (kind, wire_id, tensor.name, tensor.dtype, tensor.array.shape)
    else:  # each tensor as one tuple, so no list of them is mistaken for a single tensor's key
        key = (kind, wire_id, *[(t.name, t.dtype, t.array.shape) for t in tensors])
    template = _TEMPLATES.get(key)
    if template is None:
        template = _HeaderTemplate(kind, wire_id, raw_nbytes, tensors)
        if len(_TEMPLATES) >= _TEMPLATES_MAX:
            _TEMPLATES.clear()
        _TEMPLATES[key] = template
    return template


def _frame_head(header: dict[str, Any], payload_nbytes: int) -> bytes:
    """A frame's prefix and JSON header (padded so the payload starts `PAYLOAD_ALIGN_BYTES`-aligned).

    Raises:
        ValueError: a header larger than MAX_HEADER_BYTES.
    """
    return _pack_head(_HEADER_JSON.encode(header).encode("utf-8"), payload_nbytes)


def _pack_head(header_bytes: bytes, payload_nbytes: int) -> bytes:
    """The prefix and `header_bytes` (UTF-8 JSON), padded as `_frame_head` says.

    Raises:
        ValueError: a header larger than MAX_HEADER_BYTES.
    """
    # JSON allows trailing whitespace: pad the header so that the payload starts 8-byte aligned within
    # the frame (a reader that takes whole frames into one buffer then hands out aligned array views).
    header_bytes += b" " * (-(PREFIX_NBYTES + len(header_bytes)) % PAYLOAD_ALIGN_BYTES)
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(header_bytes)} bytes exceeds {MAX_HEADER_BYTES}")
    return PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, len(header_bytes), payload_nbytes) + header_bytes


def with_meta(frame: Frame, extra: dict[str, Any]) -> Frame:
    """`frame` with `extra` added to its header's meta: a new prefix and header, the same payload buffers
    (not copied), so one encoded payload can go to several peers each with its own meta (a shard's pull
    with the rate each worker's pushes arrived at, `wiiide.codecs.policy.FEEDBACK_META_KEY`).
    `frame` itself is left as it was; with an empty `extra` it is returned as is.

    Raises:
        ValueError: `frame` was not built by `encode_message` (no header kept), or the header grows past
            MAX_HEADER_BYTES.
    """
    if not extra:
        return frame
    if frame.header is None:
        raise ValueError(f"frame {frame.kind!r} keeps no header to add meta to")
    header = {**frame.header, "meta": {**frame.header["meta"], **extra}}
    return replace(frame, buffers=[_frame_head(header, frame.payload_nbytes), *frame.buffers[1:]], header=header)
