"""The WIIIIIDE wire protocol: length-prefixed frames with a JSON header and raw tensor bytes.

Frame layout (all integers in network byte order)::

    offset  size  field
    0       2     magic            b"W5"
    2       1     version          PROTOCOL_VERSION
    3       1     flags            0 (reserved)
    4       4     header_nbytes    uint32, <= MAX_HEADER_BYTES
    8       8     payload_nbytes   uint64; header + payload <= the configured max_frame_bytes
    16      ...   header           UTF-8 JSON object
    ...     ...   payload          the message's tensors, concatenated and encoded by one codec

The header of a message::

    {"kind": "gradients", "meta": {...},  "codec": "zlib", "raw_nbytes": 2621440,
     "tensors": [{"name": "grad", "dtype": "float32", "shape": [655360]}],
     "codec_params": {...}}                 # only when the codec has parameters

``tensors`` and ``raw_nbytes`` always describe what the receiver rebuilds (for lossy codecs: the
original float32 tensors), whatever travels. ``codec_params`` (a chunk table for parallel lossless
chunks, the block size of int8, the k of top-k) is validated by the codec's decoder against those
shapes before anything is decoded (`wiiide.codecs`).

Control messages are frames with tensors == [] and an empty payload. There is no pickle anywhere:
tensors are raw little-endian bytes of a whitelisted dtype, checked against their declared shapes.
Anything malformed raises `ProtocolError`; callers close that connection.

A frame leaves in one `socket.sendmsg` call (scatter-gather: prefix, header and the tensors' own
buffers, no concatenation copy when uncompressed) and is received with `recv_into` into one buffer
per frame (or one buffer reused for every frame, `reuse_buffers`), each `recv_into` asking for all
that is left of the frame part up to `recv_chunk_bytes` (`DEFAULT_RECV_CHUNK_BYTES`, 64 MiB: seed 001's
256 KiB chunks cost a 16 MiB frame about half its throughput between two containers, bench-wire's
``chunk`` raw variant against ``whole``; asking for more allocates nothing, the kernel returns what it has). Decoded tensors are numpy views of that buffer when uncompressed: no copy and
no `bytes()` round trip between the socket and the arrays. The nodes' readers take each frame whole
(`FrameReader(whole_frames=True)`: prefix, header and payload in one buffer, one request per frame in a
stream of equal frames; bench-wire measured it against exact reads). With `read_ahead_bytes` a reader of
exact parts also takes, in the recv that ends a frame, up to that many bytes of what follows. A TLS
connection (`wiiide.tls.TLSStream`) has no `sendmsg`: it encrypts the frames' buffers itself
(`send_buffers`); on an `ssl.SSLSocket` each large buffer goes out with `sendall` and the small ones are joined.
"""

from __future__ import annotations

import fcntl
import json
import math
import socket
import ssl
import struct
import termios
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Sequence

import numpy as np

from wiiide.codecs.base import Codec, NoCodec, byte_view
from wiiide.codecs.chunked import CodecPool
from wiiide.codecs.registry import decoder_for
from wiiide.errors import PeerClosed, ProtocolError

MAGIC = b"W5"
PROTOCOL_VERSION = 1
PREFIX = struct.Struct("!2sBBIQ")
PREFIX_NBYTES = PREFIX.size  # 16
MAX_HEADER_BYTES = 256 * 1024
DEFAULT_RECV_CHUNK_BYTES = 64 * 1024 * 1024  # the most one recv_into asks for (see the module's docstring)
MAX_TENSOR_RANK = 8
PAYLOAD_ALIGN_BYTES = 8  # encode_message pads headers so a payload starts at this multiple within its frame
WHOLE_FRAME_FIRST_GUESS_BYTES = 64 * 1024  # what a whole-frame reader asks for before it has read a frame
MAX_TENSORS = 4096
MAX_NAME_CHARS = 256

# dtype name on the wire -> numpy dtype holding its bytes (little-endian). bfloat16 travels as its raw
# 16-bit patterns in a uint16 array; `wiiide.tensors` converts to and from torch.
DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype("<f8"),
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "int16": np.dtype("<i2"),
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}
_NUMPY_TO_WIRE = {v: k for k, v in DTYPES.items() if k != "bfloat16"}


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


class DeadlineExceeded(TimeoutError):
    """A read's absolute deadline passed before the frame was complete (a `TimeoutError`, hence an
    OSError: callers that treat a socket timeout as a lost peer treat this one alike)."""


@dataclass
class WireTensor:
    """One named tensor: a C-contiguous numpy array and its wire dtype name.

    `array` holds the raw element bytes; for ``bfloat16`` it is a uint16 array of bit patterns.
    """

    name: str
    array: np.ndarray
    dtype: str = ""

    def __post_init__(self) -> None:
        array = self.array
        if not self.dtype and type(array) is np.ndarray:
            wire = _NUMPY_TO_WIRE.get(array.dtype)
            if wire is not None and array.flags.c_contiguous:
                self.dtype = wire  # a plain C-contiguous array of a wire dtype: nothing to check or convert
                return
        if not self.dtype:
            dt = self.array.dtype.newbyteorder("<") if self.array.dtype.byteorder == ">" else self.array.dtype
            try:
                self.dtype = _NUMPY_TO_WIRE[np.dtype(dt)]
            except KeyError:
                raise ValueError(f"tensor {self.name!r}: dtype {self.array.dtype} is not in the wire whitelist") from None
        if self.dtype not in DTYPES:
            raise ValueError(f"tensor {self.name!r}: dtype {self.dtype!r} is not in the wire whitelist")
        want = DTYPES[self.dtype]
        array = self.array
        if not (type(array) is np.ndarray and array.dtype == want and array.flags.c_contiguous):
            # np.require keeps a zero-dim array zero-dim (np.ascontiguousarray would make it shape (1,)).
            self.array = np.require(array, dtype=want, requirements="C")

    @classmethod
    def of_wire(cls, name: str, array: np.ndarray, dtype: str) -> WireTensor:
        """A tensor `decode_payload` built: `array` is already a C-contiguous ndarray of `DTYPES[dtype]`
        (a view of the received buffer), so the checks and conversions of `__post_init__` are skipped:
        fewer interpreter and numpy code paths per received frame (see `FrameReader`)."""
        tensor = object.__new__(cls)
        tensor.name, tensor.array, tensor.dtype = name, array, dtype
        return tensor


@dataclass
class Message:
    """A decoded message: its kind, JSON metadata and tensors (numpy arrays viewing the frame buffer)."""

    kind: str
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: list[WireTensor] = field(default_factory=list)
    codec: str = "none"
    raw_nbytes: int = 0  # tensor bytes before encoding
    wire_nbytes: int = 0  # whole frame on the wire: prefix + header + payload
    decode_s: float = 0.0
    decode_cpu_s: float = 0.0  # the reading thread's CPU seconds in decoding the payload (`time.thread_time`)
    payload_nbytes: int = 0  # encoded tensor bytes (what the codec produced)
    payload_recv_s: float = 0.0  # from the end of the header to the last payload byte
    payload_queued_nbytes: int = 0  # payload bytes already in the socket's receive queue when its read began

    def tensor(self, name: str) -> np.ndarray:
        """The array of the tensor called `name`.

        Raises:
            ProtocolError: the message has no such tensor.
        """
        for t in self.tensors:
            if t.name == name:
                return t.array
        raise ProtocolError(f"message {self.kind!r} has no tensor {name!r}")


@dataclass(slots=True)
class Frame:
    """An encoded frame ready to send: its buffers, in order, and what it cost to make.

    `buffers`: the prefix and header (``bytes``), then the payload's parts (`payload_nbytes` bytes in all;
    `send_frames` counts on it).
    """

    buffers: list[Any]
    kind: str
    codec: str  # the codec's name, e.g. zstd-1
    raw_nbytes: int
    payload_nbytes: int
    encode_s: float
    wire_id: str = "none"
    codec_params: dict[str, Any] = field(default_factory=dict)
    header: dict[str, Any] | None = None  # the JSON header the first buffer carries (see `with_meta`)
    # What the receiver will decode (float32, flat), when encode_message was asked for it and the codec
    # had it at hand (`Codec.encode_message_values`); else None. Not sent.
    decoded: Any = None

    @property
    def wire_nbytes(self) -> int:
        """Bytes the frame takes on the wire: prefix + header + payload."""
        return sum(memoryview(b).nbytes for b in self.buffers)


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
    if codec is None or type(codec) is NoCodec or not any(t.array.nbytes for t in tensors):
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
# (bench-wire and a scratch loop with a 6 us busy loop per frame, session 8). Cleared when full; shared by
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


def send_frames(sock: socket.socket, frames: Sequence[Frame]) -> int:
    """Send frames with scatter-gather `sendmsg`, one call while the kernel takes everything.

    Returns the number of bytes sent. Raises OSError (e.g. BrokenPipeError) from the socket.
    """
    send_buffers = getattr(sock, "send_buffers", None)
    if send_buffers is None and len(frames) == 1 and not isinstance(sock, ssl.SSLSocket):
        # One frame on a kernel socket (the nodes' case): its buffers as they are, the views and sums below
        # only after a partial send (a frame's Python between two sends costs throughput, see _TEMPLATES).
        buffers = frames[0].buffers
        head = buffers[0]
        if type(head) is bytes and len(buffers) <= _IOV_MAX:
            total = len(head) + frames[0].payload_nbytes
            sent = sock.sendmsg(buffers)
            if sent == total:
                return total
            return sent + _send_rest([memoryview(b).cast("B") for b in buffers], sent, sock)
    buffers = [memoryview(b).cast("B") for f in frames for b in f.buffers]
    total = sum(b.nbytes for b in buffers)
    if send_buffers is not None:  # wiiide.tls.TLSStream: encrypts and sends the frames itself
        send_buffers(buffers)
        return total
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg on SSLSocket (wiiide.tls, memory_bio=False)
        _send_buffers_tls(sock, buffers)
        return total
    sent = _send_rest(buffers, 0, sock)
    assert sent == total
    return total


_IOV_MAX = 1024  # the most buffers one sendmsg takes on Linux


def _send_rest(buffers: list[memoryview], sent: int, sock: socket.socket) -> int:
    """Send what is left of `buffers` (byte views) once their first `sent` bytes are out; returns the
    bytes this call sent. Raises OSError from the socket."""
    sent_total = 0
    while True:
        # Drop what went out; keep the rest of a partly sent buffer.
        while buffers and sent >= buffers[0].nbytes:
            sent -= buffers[0].nbytes
            buffers.pop(0)
        if sent:
            buffers[0] = buffers[0][sent:]
        if not buffers:
            return sent_total
        sent = sock.sendmsg(buffers[:_IOV_MAX])
        sent_total += sent


TLS_COALESCE_BYTES = 64 * 1024  # buffers below this are joined before a TLS write (one record, not one each)


def coalesced(buffers: Sequence[memoryview], small_nbytes: int = TLS_COALESCE_BYTES) -> Iterator[Any]:
    """`buffers` in order (C-contiguous byte views), each buffer of at least `small_nbytes` as it is and
    each run of smaller ones between them (prefixes, headers) joined into one `bytes`: a TLS write makes
    at least one record of its own, so small buffers are joined first."""
    small: list[memoryview] = []
    for buf in buffers:
        if buf.nbytes < small_nbytes:
            small.append(buf)
            continue
        if small:
            yield b"".join(small) if len(small) > 1 else small[0]
            small = []
        yield buf
    if small:
        yield b"".join(small) if len(small) > 1 else small[0]


def _send_buffers_tls(sock: ssl.SSLSocket, buffers: list[memoryview]) -> None:
    """`sendall` each buffer of `coalesced(buffers)`. Raises OSError."""
    for part in coalesced(buffers):
        sock.sendall(part)


class FrameReader:
    """Reads frames from one connected socket, enforcing the size limits.

    Args:
        sock: a connected, blocking socket (a timeout may be set on it).
        max_frame_bytes: largest header + payload accepted; also the largest decoded tensor bytes.
        recv_chunk_bytes: the most one `recv_into` call asks for (`DEFAULT_RECV_CHUNK_BYTES`, 64 MiB; seed
            001 had 256 KiB, measured slower by bench-wire).
        quickack: re-arm TCP_QUICKACK after each frame (Linux clears it after use).
        reuse_buffers: receive every payload into one buffer kept by the reader (grown as needed)
            instead of a new one per frame. Saves the allocation and page faults of a fresh buffer
            (about 10 % of the time of a 64 MiB frame here), but an uncompressed message's arrays are
            then only valid until the next read: use it where each message is consumed (copied,
            summed) before the next one is read, as the coordinator and the worker do.
        pool: the codec thread pool chunked payloads are decoded on (a node passes its compression
            policy's `pool`); None: chunks are decoded one after the other in the calling thread.
        read_ahead_bytes: 0 (the default): every part of a frame is read exactly, nothing past it. N > 0:
            the call that reads the end of a frame also asks the kernel for up to N more bytes
            (`socket.recvmsg_into` scattering into the frame and a fixed N-byte buffer of this reader),
            so that in a stream the next frame's prefix, header and first payload bytes come with the
            same system call: one `recv` per frame instead of three. Only what the kernel already holds
            is taken (a recv returns once it has copied something). Those bytes are checked as every
            frame is (prefix, then header, before any is used), but up to N bytes of a frame are then
            read before its header is validated, into that fixed buffer (nothing is allocated from an
            unchecked size). The bytes read ahead belong to this reader: use one reader per connection
            for its whole life, as the nodes do. Ignored on a TLS socket (no `recvmsg_into`).
        whole_frames: read each frame whole, the way bench-wire's fastest raw loop (``whole``) reads a
            message: prefix, header and payload land in one buffer kept by the reader, and each `recv_into`
            asks for the whole frame at once, the last frame's size being the guess before the prefix is
            known (`WHOLE_FRAME_FIRST_GUESS_BYTES` for the first). A stream of equal frames then costs one
            request per frame and no copy; bytes past a frame (when a frame is shorter than the guess)
            stay in that buffer for the next read. Requires `reuse_buffers` (the payload is a view of the
            reader's buffer, valid until the next read) and a kernel socket; ignored otherwise. Bytes of
            a following frame may be read before its prefix and header are checked, into that buffer only
            (it grows only to a frame's validated size, never from an unchecked one). The bytes read past
            a frame belong to this reader: one reader per connection for its whole life, as the nodes
            do. `read_ahead_bytes` is ignored when this is on.
    """

    def __init__(self, sock: socket.socket, max_frame_bytes: int, recv_chunk_bytes: int = DEFAULT_RECV_CHUNK_BYTES,
                 quickack: bool = False, reuse_buffers: bool = False, pool: CodecPool | None = None,
                 read_ahead_bytes: int = 0, whole_frames: bool = False) -> None:
        self.sock = sock
        self.pool = pool
        self.max_frame_bytes = max_frame_bytes
        self.recv_chunk_bytes = recv_chunk_bytes
        self.quickack = quickack and hasattr(socket, "TCP_QUICKACK")
        self.reuse_buffers = reuse_buffers
        self._prefix = bytearray(PREFIX_NBYTES)
        self._queued_buf = bytearray(4)  # FIONREAD's answer, reused
        tls = isinstance(sock, ssl.SSLSocket) or not hasattr(sock, "recvmsg_into")
        self.read_ahead_bytes = 0 if tls else max(0, int(read_ahead_bytes))
        self._ahead = memoryview(bytearray(self.read_ahead_bytes))
        self._ahead_start = self._ahead_end = 0  # bytes of the stream read ahead, not yet used: _ahead[start:end]
        self._payload_buf = bytearray(0)
        self.whole_frames = bool(whole_frames) and reuse_buffers and not tls
        if self.whole_frames:
            self.read_ahead_bytes = 0
        self._frame_buf = bytearray(WHOLE_FRAME_FIRST_GUESS_BYTES if self.whole_frames else 0)
        self._frame_view = memoryview(self._frame_buf)
        self._frame_start = self._frame_end = 0  # whole_frames: bytes of the stream read, not yet used
        self._frame_guess_nbytes = WHOLE_FRAME_FIRST_GUESS_BYTES
        self.last_payload_recv_s = 0.0
        self.last_payload_queued_nbytes = 0

    def _recv_exact(self, view: memoryview, *, at_boundary: bool = False, deadline: float | None = None,
                    last: bool = False) -> None:
        """Fill `view`: first from the bytes read ahead, then from the socket. `last`: `view` ends a frame,
        so with `read_ahead_bytes` its final recv also asks for what follows (see the class)."""
        pos, n = 0, view.nbytes
        held = self._ahead_end - self._ahead_start
        if held:
            pos = min(held, n)
            view[:pos] = self._ahead[self._ahead_start:self._ahead_start + pos]
            self._ahead_start += pos
            if pos == n:
                return
            self._ahead_start = self._ahead_end = 0
        chunk = self.recv_chunk_bytes
        ahead = self._ahead if last and self.read_ahead_bytes else None
        while pos < n:
            if ahead is not None and n - pos <= chunk:
                got = _recv_within(self.sock, lambda: self.sock.recvmsg_into([view[pos:], ahead])[0], deadline,
                                   pos, n, at_boundary)
                if got > n - pos:
                    self._ahead_start, self._ahead_end = 0, got - (n - pos)
                    got = n - pos
            else:
                got = _recv_within(self.sock, lambda: self.sock.recv_into(view[pos:pos + min(chunk, n - pos)]),
                                   deadline, pos, n, at_boundary)
            pos += got

    def read_raw(self, deadline: float | None = None) -> tuple[dict[str, Any], memoryview, int]:
        """Read one frame: (parsed and validated header, payload view, frame bytes on the wire).

        `deadline` (a `time.monotonic()` instant) bounds the whole read in wall time whatever the peer
        sends and however slowly; the socket's own timeout is restored afterwards.

        Raises:
            ProtocolError: a malformed frame (PeerClosed on EOF).
            DeadlineExceeded: the deadline passed before the frame was complete (a TimeoutError).
            OSError: from the socket (socket.timeout after the socket's timeout without a byte).
        """
        if deadline is None:
            return self._read_raw(None)
        saved_timeout_s = self.sock.gettimeout()
        try:
            return self._read_raw(deadline)
        finally:
            try:
                self.sock.settimeout(saved_timeout_s)
            except OSError:
                pass

    def buffered_nbytes(self) -> int:
        """Bytes of the stream this reader took from its socket past the frames it returned (read-ahead or
        whole-frame reads): the next frame may already be here while `select` on the socket sees nothing."""
        return (self._ahead_end - self._ahead_start) + (self._frame_end - self._frame_start)

    def _fill(self, need_end: int, ask_end: int, deadline: float | None) -> None:
        """whole_frames: receive into the frame buffer until it holds `need_end` bytes from its start, each
        `recv_into` asking for everything up to `ask_end` (>= need_end, <= the buffer's size)."""
        view, end = self._frame_view, self._frame_end
        while end < need_end:
            end += _recv_within(self.sock, lambda: self.sock.recv_into(view[end:ask_end]), deadline, end, need_end,
                                True)
            self._frame_end = end

    def _read_raw_whole(self, deadline: float | None) -> tuple[dict[str, Any], memoryview, int]:
        """`_read_raw` for `whole_frames` (see the class): one buffer, whole-frame requests."""
        start, end = self._frame_start, self._frame_end
        if start:  # what the last read took past its frame moves to the front: this frame starts at 0
            self._frame_view[:end - start] = self._frame_view[start:end]
            self._frame_start, self._frame_end = 0, end - start
        ask_end = min(max(self._frame_guess_nbytes, PREFIX_NBYTES), len(self._frame_buf))
        self._fill(PREFIX_NBYTES, ask_end, deadline)
        magic, version, _flags, header_nbytes, payload_nbytes = PREFIX.unpack_from(self._frame_buf)
        self._check_prefix(magic, version, header_nbytes, payload_nbytes)
        frame_nbytes = PREFIX_NBYTES + header_nbytes + payload_nbytes
        if frame_nbytes > len(self._frame_buf):  # grown only to a validated size; what was read comes along
            grown = bytearray(frame_nbytes)
            grown[:self._frame_end] = self._frame_view[:self._frame_end]
            self._frame_buf, self._frame_view = grown, memoryview(grown)
        header_end = PREFIX_NBYTES + header_nbytes
        self._fill(header_end, frame_nbytes, deadline)
        header = parse_header(self._frame_buf[PREFIX_NBYTES:header_end], self.max_frame_bytes)
        held = min(self._frame_end, frame_nbytes) - header_end
        self.last_payload_queued_nbytes = min(_queued_nbytes(self.sock, self._queued_buf) + held, payload_nbytes)
        t0 = time.perf_counter()
        self._fill(frame_nbytes, frame_nbytes, deadline)
        self.last_payload_recv_s = time.perf_counter() - t0
        if self.quickack:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        self._frame_start = frame_nbytes if self._frame_end > frame_nbytes else 0
        if not self._frame_start:
            self._frame_end = 0
        self._frame_guess_nbytes = frame_nbytes
        return header, self._frame_view[header_end:frame_nbytes], frame_nbytes

    def _check_prefix(self, magic: bytes, version: int, header_nbytes: int, payload_nbytes: int) -> None:
        """Raise ProtocolError unless a frame prefix's fields are acceptable to this reader."""
        if magic != MAGIC:
            raise ProtocolError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}): not a WIIIIIDE peer")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {version} not supported (this node speaks {PROTOCOL_VERSION})")
        if header_nbytes == 0 or header_nbytes > MAX_HEADER_BYTES:
            raise ProtocolError(f"header of {header_nbytes} bytes is outside 1..{MAX_HEADER_BYTES}")
        if header_nbytes + payload_nbytes > self.max_frame_bytes:
            raise ProtocolError(
                f"frame of {header_nbytes + payload_nbytes} bytes exceeds max_frame_bytes={self.max_frame_bytes}"
            )

    def _read_raw(self, deadline: float | None) -> tuple[dict[str, Any], memoryview, int]:
        if self.whole_frames:
            return self._read_raw_whole(deadline)
        self._recv_exact(memoryview(self._prefix), at_boundary=True, deadline=deadline)
        magic, version, _flags, header_nbytes, payload_nbytes = PREFIX.unpack(self._prefix)
        self._check_prefix(magic, version, header_nbytes, payload_nbytes)
        header_buf = bytearray(header_nbytes)
        self._recv_exact(memoryview(header_buf), deadline=deadline, last=payload_nbytes == 0)
        header = parse_header(header_buf, self.max_frame_bytes)
        if self.reuse_buffers:
            if len(self._payload_buf) < payload_nbytes:
                self._payload_buf = bytearray(payload_nbytes)
            payload = memoryview(self._payload_buf)[:payload_nbytes]
        else:
            payload = memoryview(bytearray(payload_nbytes))
        held = self._ahead_end - self._ahead_start
        self.last_payload_queued_nbytes = min(_queued_nbytes(self.sock, self._queued_buf) + held, payload_nbytes)
        t0 = time.perf_counter()
        self._recv_exact(payload, deadline=deadline, last=True)
        self.last_payload_recv_s = time.perf_counter() - t0
        if self.quickack:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        return header, payload, PREFIX_NBYTES + header_nbytes + payload_nbytes

    def read_message(self, deadline: float | None = None) -> Message:
        """Read and decode one message, within `deadline` (a `time.monotonic()` instant) when given.

        Raises ProtocolError (PeerClosed on EOF), DeadlineExceeded or OSError (see `read_raw`).
        """
        header, payload, wire_nbytes = self.read_raw(deadline)
        cpu0 = time.thread_time()
        msg = decode_payload(header, payload, self.pool)
        msg.decode_cpu_s = time.thread_time() - cpu0
        msg.wire_nbytes = wire_nbytes
        msg.payload_recv_s = self.last_payload_recv_s
        msg.payload_queued_nbytes = self.last_payload_queued_nbytes
        return msg


def _recv_within(sock: socket.socket, recv: Any, deadline: float | None, have_nbytes: int, need_nbytes: int,
                 at_boundary: bool) -> int:
    """Call `recv` (one receive on `sock`, returning the bytes it took) within `deadline`; `have_nbytes` of
    the `need_nbytes` of a frame (part) are in so far. An absolute deadline, not a timeout per recv: a
    peer sending one byte per second cannot stretch the read (the socket's timeout is cut to what is
    left of it). Returns the bytes received (> 0).

    Raises:
        DeadlineExceeded: the deadline passed. PeerClosed: EOF (its message says whether mid-frame;
            `at_boundary` with nothing in yet: between frames). OSError: from the socket.
    """
    if deadline is not None:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise DeadlineExceeded(f"read deadline passed with {have_nbytes} of {need_nbytes} bytes of a frame "
                                   "part received")
        sock.settimeout(remaining_s)
    try:
        got = recv()
    except socket.timeout:
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlineExceeded(f"read deadline passed with {have_nbytes} of {need_nbytes} bytes of a frame "
                                   "part received") from None
        raise
    if not got:
        if at_boundary and have_nbytes == 0:
            raise PeerClosed("peer closed the connection")
        raise PeerClosed(f"peer closed the connection in the middle of a frame ({have_nbytes} of {need_nbytes} "
                         "bytes)")
    return got


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


def _queued_nbytes(sock: socket.socket, buf: bytearray | None = None) -> int:
    """Bytes waiting in `sock`'s receive queue (ioctl FIONREAD, SIOCINQ on TCP; Linux tcp(7)); 0 when the
    socket cannot tell (not a kernel socket, or the call failed). One system call, no data read.
    `buf`: a 4-byte bytearray the answer is written into (reused by a reader; None: a new one)."""
    try:
        if buf is None:
            buf = bytearray(4)
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
        return int.from_bytes(buf, "little", signed=True) if buf else 0
    except (OSError, ValueError, AttributeError, TypeError):
        return 0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
