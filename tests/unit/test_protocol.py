"""wiiide.wire (format, encode, send, decode, reader): frames over a real socket pair, every dtype and codec, and every malformed frame."""

from __future__ import annotations

import json
import socket
import threading
import time
import zlib

import numpy as np
import pytest
import torch

from wiiide.codecs import NoCodec, ZlibCodec
from wiiide.errors import PeerClosed, ProtocolError
from wiiide.wire.tensors import from_wire, to_wire
from wiiide.wire import encode as wire_encode
from wiiide.wire.decode import parse_header
from wiiide.wire.encode import encode_message, with_meta
from wiiide.wire.format import (
    DTYPES,
    MAGIC,
    MAX_HEADER_BYTES,
    MAX_TENSOR_RANK,
    PAYLOAD_ALIGN_BYTES,
    PREFIX,
    PREFIX_NBYTES,
    PROTOCOL_VERSION,
    DeadlineExceeded,
)
from wiiide.wire.messages import Frame, Message, WireTensor
from wiiide.wire.reader import FrameReader
from wiiide.wire.send import send_frames

MIB = 1024 * 1024
CODECS = {"none": NoCodec(), "zlib-1": ZlibCodec(1), "zlib-9": ZlibCodec(9)}
TORCH_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}


def random_array(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random values covering the dtype's range (floats include inf, -0.0 and nan)."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype == "bfloat16":
        return rng.integers(0, 2**16, size=shape, dtype=np.uint16)
    if dt.kind == "f":
        a = (rng.standard_normal(size=shape) * 100).astype(dt)
        flat = a.reshape(-1)
        if flat.size >= 4:
            flat[:4] = [np.inf, -0.0, np.nan, -np.inf]
        return a
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)


def roundtrip(sock_pair, frames, max_frame_bytes=64 * MIB, **reader_kwargs):
    writer, reader_sock = sock_pair
    sent = send_frames(writer, frames)
    assert sent == sum(f.wire_nbytes for f in frames)
    reader = FrameReader(reader_sock, max_frame_bytes, **reader_kwargs)
    return [reader.read_message() for _ in frames]


def assert_same(a: np.ndarray, b: np.ndarray) -> None:
    """Same dtype, shape and bytes (so nan and -0.0 count as equal only if their bits are)."""
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def raw_frame(header, payload: bytes = b"", *, magic: bytes = MAGIC, version: int = PROTOCOL_VERSION,
              header_nbytes: int | None = None, payload_nbytes: int | None = None) -> bytes:
    """A frame built by hand: a dict header is JSON-encoded, bytes are sent as they are."""
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    return PREFIX.pack(magic, version, 0, len(hb) if header_nbytes is None else header_nbytes,
                       len(payload) if payload_nbytes is None else payload_nbytes) + hb + payload


def header(tensors=(), raw_nbytes=None, codec="none", **extra):
    tensors = list(tensors)
    if raw_nbytes is None:
        raw_nbytes = sum(int(np.prod(t["shape"])) * DTYPES[t["dtype"]].itemsize for t in tensors)
    return {"kind": "gradients", "meta": {}, "codec": codec, "raw_nbytes": raw_nbytes, "tensors": tensors, **extra}


# --------------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------------
def test_prefix_is_16_bytes_network_order():
    assert PREFIX_NBYTES == 16
    frame = encode_message("stop", {"reason": "x"})
    first = bytes(frame.buffers[0])
    magic, version, flags, header_nbytes, payload_nbytes = PREFIX.unpack(first[:16])
    assert (magic, version, flags, payload_nbytes) == (MAGIC, PROTOCOL_VERSION, 0, 0)
    assert first[4:8] == header_nbytes.to_bytes(4, "big")
    assert json.loads(first[16:16 + header_nbytes]) == {
        "kind": "stop", "meta": {"reason": "x"}, "codec": "none", "raw_nbytes": 0, "tensors": []}


@pytest.mark.parametrize("codec_name", CODECS)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_roundtrip_every_dtype(sock_pair, dtype, codec_name):
    arrays = [random_array(dtype, (7, 5), seed=1), random_array(dtype, (3,), seed=2),
              random_array(dtype, (2, 3, 4), seed=3)]
    tensors = [WireTensor(f"t{i}", a, dtype) for i, a in enumerate(arrays)]
    frame = encode_message("gradients", {"step": 3, "loss": 0.5}, tensors, CODECS[codec_name])
    (msg,) = roundtrip(sock_pair, [frame])
    assert msg.kind == "gradients"
    assert msg.meta == {"step": 3, "loss": 0.5}
    assert msg.raw_nbytes == sum(a.nbytes for a in arrays)
    assert msg.codec == ("none" if codec_name == "none" else "zlib")
    assert frame.codec == codec_name
    assert msg.wire_nbytes == frame.wire_nbytes
    assert [t.name for t in msg.tensors] == ["t0", "t1", "t2"]
    for sent, got in zip(tensors, msg.tensors):
        assert got.dtype == dtype
        assert_same(sent.array, got.array)


@pytest.mark.parametrize("codec_name", CODECS)
def test_roundtrip_mixed_dtypes_in_one_message(sock_pair, codec_name):
    tensors = [WireTensor(d, random_array(d, (4, 3), seed=i), d) for i, d in enumerate(sorted(DTYPES))]
    (msg,) = roundtrip(sock_pair, [encode_message("batch", {}, tensors, CODECS[codec_name])])
    for sent, name in zip(tensors, sorted(DTYPES)):
        assert msg.tensor(name).dtype == DTYPES[name]
        assert_same(sent.array, msg.tensor(name))


@pytest.mark.parametrize("codec_name", CODECS)
@pytest.mark.parametrize("dtype", sorted(TORCH_DTYPES))
def test_torch_roundtrip_through_wire(sock_pair, dtype, codec_name):
    torch.manual_seed(0)
    t = (torch.randn(6, 4) * 50).to(TORCH_DTYPES[dtype])
    (msg,) = roundtrip(sock_pair, [encode_message("params", {}, [to_wire("w", t)], CODECS[codec_name])])
    got = from_wire(msg.tensors[0])
    assert got.dtype == t.dtype
    assert got.shape == t.shape
    assert torch.equal(got, t)


def test_bfloat16_travels_as_its_bit_patterns(sock_pair):
    t = torch.tensor([1.0, -2.5, 3.140625, float("inf")], dtype=torch.bfloat16)
    wt = to_wire("b", t)
    assert wt.dtype == "bfloat16" and wt.array.dtype == np.uint16
    assert wt.array.tolist() == t.view(torch.int16).numpy().view(np.uint16).tolist()
    (msg,) = roundtrip(sock_pair, [encode_message("params", {}, [wt])])
    assert msg.tensors[0].dtype == "bfloat16"
    assert torch.equal(from_wire(msg.tensors[0]), t)


@pytest.mark.parametrize("codec_name", CODECS)
def test_empty_1d_tensor(sock_pair, codec_name):
    tensors = [WireTensor("empty", np.empty((0,), np.float32)), WireTensor("x", np.arange(3, dtype=np.int64))]
    (msg,) = roundtrip(sock_pair, [encode_message("batch", {}, tensors, CODECS[codec_name])])
    assert msg.tensor("empty").shape == (0,)
    assert msg.tensor("empty").dtype == np.float32
    assert msg.tensor("x").tolist() == [0, 1, 2]


@pytest.mark.parametrize("shape", [(0, 3), (3, 0)])
def test_empty_multidim_tensor(sock_pair, shape):
    tensors = [WireTensor("empty", np.empty(shape, np.float32))]
    (msg,) = roundtrip(sock_pair, [encode_message("batch", {}, tensors)])
    assert msg.tensor("empty").shape == shape


@pytest.mark.parametrize("codec_name", CODECS)
def test_zero_dim_tensor(sock_pair, codec_name):
    tensors = [WireTensor("scalar", np.array(2.5, dtype=np.float32)), to_wire("loss", torch.tensor(7, dtype=torch.int64))]
    (msg,) = roundtrip(sock_pair, [encode_message("gradients", {}, tensors, CODECS[codec_name])])
    assert msg.tensor("scalar").shape == ()
    assert float(msg.tensor("scalar")) == 2.5
    assert from_wire(msg.tensors[1]).shape == torch.Size([])


@pytest.mark.parametrize("codec_name", CODECS)
def test_decoded_tensors_are_what_the_checked_constructor_builds(sock_pair, codec_name):
    """decode_payload builds its tensors without WireTensor's checks (WireTensor.of_wire): they must be
    exactly what the checked constructor accepts unchanged, for every dtype and rank (0-d, 1-d, 3-d)."""
    shapes = [(), (5,), (2, 3, 4)]
    tensors = [WireTensor(f"{d}{len(s)}", random_array(d, s, seed=i), d)
               for i, (d, s) in enumerate((d, s) for d in sorted(DTYPES) for s in shapes)]
    (msg,) = roundtrip(sock_pair, [encode_message("batch", {}, tensors, CODECS[codec_name])])
    for sent, got in zip(tensors, msg.tensors):
        assert type(got.array) is np.ndarray and got.array.flags.c_contiguous
        assert got.array.dtype == DTYPES[sent.dtype] and got.array.shape == sent.array.shape
        checked = WireTensor(got.name, got.array, got.dtype)
        assert checked.array is got.array  # nothing the checks would have converted
        assert checked == got


def test_header_bytes_are_json_dumps_compact():
    """The header encoder built once writes what json.dumps(..., separators=(",", ":")) writes, then
    spaces up to the payload's alignment."""
    meta = {"step": 3, "loss": float("nan"), "note": "é\u00e9 \"q\"", "big": 2**70, "nested": {"a": [1, None, True]}}
    frame = encode_message("gradients", meta, [WireTensor("g", np.zeros((2, 2), np.float32))])
    header = {"kind": "gradients", "meta": meta, "codec": "none", "raw_nbytes": 16,
              "tensors": [{"name": "g", "dtype": "float32", "shape": [2, 2]}]}
    head = bytes(frame.buffers[0])
    assert len(head) % PAYLOAD_ALIGN_BYTES == 0
    assert head[PREFIX.size:].rstrip(b" ") == json.dumps(header, separators=(",", ":")).encode()
    assert len(head[PREFIX.size:]) - len(head[PREFIX.size:].rstrip(b" ")) < PAYLOAD_ALIGN_BYTES


@pytest.mark.parametrize("codec_name", ["none", "zlib-1", "int8", "topk-0.1"])
def test_header_from_a_template_is_the_whole_header_encoded(codec_name):
    """A header built from its cached template (kind, codec, tensors) with the frame's meta and codec
    parameters spliced in is the text `json.dumps` gives for the whole header, for every codec, with
    several tensors, codec parameters (int8's block, top-k's k) and a second frame of the same shapes."""
    from wiiide.codecs import codec_from_name

    codec = codec_from_name(codec_name)
    tensors = [WireTensor("w", random_array("float32", (3, 40))), WireTensor("bé", random_array("float32", (40,)))]
    for meta in ({"step": 1, "note": " x"}, {"step": 2, "uplink_bps": 1.5e8, "nested": {"a": [None, True]}}):
        frame = encode_message("gradients", meta, tensors, codec)
        head = bytes(frame.buffers[0])
        assert head[PREFIX.size:].rstrip(b" ") == json.dumps(frame.header, separators=(",", ":")).encode()
        assert frame.header["meta"] == meta and frame.header["codec"] == codec.wire_id
        assert ("codec_params" in frame.header) == bool(frame.codec_params)


def test_header_templates_are_keyed_by_shape_and_bounded():
    """Frames of one name and kind but other shapes get their own shapes in the header, and the template
    cache never holds more than its bound however many shapes pass."""
    for n in range(1, wire_encode._TEMPLATES_MAX + 20):
        frame = encode_message("pull", {"step": n}, [WireTensor("p", np.zeros(n, np.float32))])
        assert frame.header["tensors"] == [{"name": "p", "dtype": "float32", "shape": [n]}]
        assert json.loads(bytes(frame.buffers[0])[PREFIX.size:])["tensors"][0]["shape"] == [n]
        assert len(wire_encode._TEMPLATES) <= wire_encode._TEMPLATES_MAX


class _TrickleSocket:
    """A socket stand-in whose `sendmsg` takes at most `step` bytes a call (a kernel with a full send
    buffer, or a socket with a timeout), recording what it took."""

    def __init__(self, step: int) -> None:
        self.step, self.sent, self.calls = step, bytearray(), 0

    def sendmsg(self, buffers):
        self.calls += 1
        data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)[:self.step]
        self.sent += data
        return len(data)


@pytest.mark.parametrize("step", [1, 7, 150, 4096, 1 << 30])
@pytest.mark.parametrize("nframes", [1, 3])
def test_send_frames_finishes_partial_sends_in_order(step, nframes):
    """Whatever a sendmsg call takes, every byte of the frames leaves once, in order, and the count
    returned is the frames' size (one frame takes the single-frame path, three the general one)."""
    frames = [encode_message("m", {"i": i}, [WireTensor("v", np.arange(100 * (i + 1), dtype=np.float32)),
                                             WireTensor("e", np.zeros(0, np.float32)),
                                             WireTensor("w", np.ones((4, 5), np.int16))],
                             ZlibCodec(1) if i == 1 else None) for i in range(nframes)]
    want = b"".join(bytes(memoryview(b).cast("B")) for f in frames for b in f.buffers)
    sock = _TrickleSocket(step)
    assert send_frames(sock, frames) == len(want) == sum(f.wire_nbytes for f in frames)
    assert bytes(sock.sent) == want
    assert sock.calls == -(-len(want) // step)


def test_byte_view_of_any_layout_is_its_c_order_bytes():
    """`byte_view` gives an array's bytes in C order for C-contiguous, Fortran-ordered, zero-dim and
    empty arrays alike."""
    from wiiide.wire.format import byte_view

    for array in (np.arange(12, dtype=np.float32).reshape(3, 4), np.asfortranarray(np.arange(12.0).reshape(3, 4)),
                  np.asarray(np.float32(2.5)), np.zeros((2, 0), np.float32), np.arange(5, dtype=np.uint8)):
        view = byte_view(array)
        assert view.format == "B" and view.ndim == 1
        assert view.tobytes() == np.ascontiguousarray(array).tobytes()


@pytest.mark.parametrize("codec_name", CODECS)
def test_control_messages_without_tensors(sock_pair, codec_name):
    frames = [encode_message("hello", {"protocol_version": 1, "node_id": "n1", "nested": {"a": [1, 2]}},
                             codec=CODECS[codec_name]),
              encode_message("stop", codec=CODECS[codec_name])]
    for f in frames:
        assert f.payload_nbytes == 0 and f.raw_nbytes == 0 and f.codec == "none"
        assert len(f.buffers) == 1  # prefix + header only
    hello, stop = roundtrip(sock_pair, frames)
    assert hello.kind == "hello" and hello.tensors == [] and hello.raw_nbytes == 0
    assert hello.meta == {"protocol_version": 1, "node_id": "n1", "nested": {"a": [1, 2]}}
    assert stop.kind == "stop" and stop.meta == {} and stop.tensors == []
    assert hello.wire_nbytes == frames[0].wire_nbytes


def test_many_frames_in_one_send_arrive_in_order(sock_pair):
    frames = [encode_message("m", {"i": i}, [WireTensor("v", np.full(i + 1, i, np.int32))],
                             ZlibCodec(1) if i % 2 else None) for i in range(20)]
    msgs = roundtrip(sock_pair, frames)
    assert [m.meta["i"] for m in msgs] == list(range(20))
    assert [m.tensor("v").tolist() for m in msgs] == [[i] * (i + 1) for i in range(20)]


def test_identity_codec_sends_tensor_buffers_without_copy():
    a = np.arange(1000, dtype=np.float32)
    frame = encode_message("gradients", {}, [WireTensor("g", a)])
    assert len(frame.buffers) == 2
    assert np.shares_memory(np.frombuffer(frame.buffers[1], dtype=np.float32), a)
    assert frame.payload_nbytes == frame.raw_nbytes == a.nbytes


def test_with_meta_adds_meta_and_shares_the_payload(sock_pair):
    """One encoded payload, a meta per peer (a shard's pull to each worker): each copy is a valid frame
    carrying its own meta and the same bytes; the original frame is unchanged."""
    a = np.arange(4097, dtype=np.float32)
    frame = encode_message("pull", {"step": 3}, [WireTensor("p0", a)], ZlibCodec(1))
    head = bytes(frame.buffers[0])
    copies = [with_meta(frame, {"rx_bps": rate}) for rate in (1e6, 2.5e8)]
    assert with_meta(frame, {}) is frame
    assert bytes(frame.buffers[0]) == head and frame.header["meta"] == {"step": 3}
    for copy in copies:
        assert copy.buffers[1:] == frame.buffers[1:] and copy.buffers[1] is frame.buffers[1]
    msgs = roundtrip(sock_pair, [frame, *copies], whole_frames=True)
    assert [m.meta for m in msgs] == [{"step": 3}, {"step": 3, "rx_bps": 1e6}, {"step": 3, "rx_bps": 2.5e8}]
    for m in msgs:
        assert m.codec == frame.wire_id
        assert_same(m.tensor("p0"), a)
    hand_made = Frame(buffers=[head, *frame.buffers[1:]], kind="pull", codec="zlib-1",
                               raw_nbytes=a.nbytes, payload_nbytes=frame.payload_nbytes, encode_s=0.0)
    with pytest.raises(ValueError, match="keeps no header"):
        with_meta(hand_made, {"rx_bps": 1.0})


def test_zlib_frame_is_smaller_for_compressible_data():
    a = np.zeros(100_000, np.float32)
    frame = encode_message("params", {}, [WireTensor("p", a)], ZlibCodec(9))
    assert frame.raw_nbytes == 400_000
    assert frame.payload_nbytes < 10_000
    assert frame.codec == "zlib-9"


class RecordingSocket:
    """Delegates recv_into to a real socket and records how many bytes each call asked for."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.requests: list[int] = []

    def recv_into(self, view, nbytes: int = 0) -> int:
        self.requests.append(memoryview(view).nbytes)
        return self.sock.recv_into(view, nbytes)


@pytest.mark.parametrize("codec_name", ["none", "zlib-1"])
def test_large_payload_small_chunks_from_thread(sock_pair, codec_name):
    writer, reader_sock = sock_pair
    rng = np.random.default_rng(7)
    big = rng.standard_normal(2 * MIB, dtype=np.float32)  # 8 MiB
    if codec_name == "zlib-1":
        big[::2] = 0.0  # compressible, still 8 MiB raw
    frame = encode_message("params", {"step": 1}, [WireTensor("p", big)], CODECS[codec_name])
    errors: list[BaseException] = []

    def send() -> None:
        try:
            send_frames(writer, [frame, encode_message("stop")])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    recording = RecordingSocket(reader_sock)
    reader = FrameReader(recording, max_frame_bytes=64 * MIB, recv_chunk_bytes=4096)  # type: ignore[arg-type]
    msg = reader.read_message()
    stop = reader.read_message()
    sender.join(timeout=30)
    assert not sender.is_alive() and not errors
    assert msg.raw_nbytes == 8 * MIB
    assert_same(msg.tensor("p"), big)
    assert msg.wire_nbytes == frame.wire_nbytes
    assert stop.kind == "stop"
    assert max(recording.requests) <= 4096
    assert len(recording.requests) >= frame.payload_nbytes // 4096


def test_message_tensor_lookup_missing_name_raises():
    msg = Message(kind="x", tensors=[WireTensor("a", np.zeros(1, np.uint8))])
    assert msg.tensor("a").tolist() == [0]
    with pytest.raises(ProtocolError, match="no tensor 'b'"):
        msg.tensor("b")


def test_wiretensor_rejects_dtypes_outside_whitelist():
    with pytest.raises(ValueError, match="whitelist"):
        WireTensor("c", np.zeros(2, np.complex64))
    with pytest.raises(ValueError, match="whitelist"):
        WireTensor("u", np.zeros(2, np.uint32))
    with pytest.raises(ValueError, match="whitelist"):
        WireTensor("x", np.zeros(2, np.float32), "float8")


def test_wiretensor_big_endian_input_is_sent_little_endian(sock_pair):
    a = np.arange(5, dtype=">f4")
    wt = WireTensor("be", a)
    assert wt.dtype == "float32"
    (msg,) = roundtrip(sock_pair, [encode_message("m", {}, [wt])])
    assert msg.tensor("be").tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_non_contiguous_input_is_made_contiguous(sock_pair):
    a = np.arange(12, dtype=np.int16).reshape(3, 4).T
    (msg,) = roundtrip(sock_pair, [encode_message("m", {}, [WireTensor("t", a)])])
    assert msg.tensor("t").tolist() == a.tolist()


def test_encode_rejects_header_over_limit():
    with pytest.raises(ValueError, match="exceeds"):
        encode_message("m", {"blob": "x" * (MAX_HEADER_BYTES + 1)})


# --------------------------------------------------------------------------------------------------
# Malformed frames: each raises ProtocolError (and not PeerClosed) on the reading side
# --------------------------------------------------------------------------------------------------
F32_4 = {"name": "g", "dtype": "float32", "shape": [4]}
ZEROS_16 = bytes(16)
BOMB = zlib.compress(bytes(10_000_000), 9)
GOOD_ZLIB = zlib.compress(np.arange(4, dtype=np.float32).tobytes(), 6)


def deep_json(depth: int) -> bytes:
    return b'{"kind":"m","codec":"none","raw_nbytes":0,"tensors":[],"meta":' + b'{"a":' * depth + b"1" + b"}" * depth + b"}"


BAD_FRAMES = {  # name: (frame bytes, regex the error message must match)
    "bad magic": (raw_frame(header([F32_4]), ZEROS_16, magic=b"XX"), "magic"),
    "http request": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "magic"),
    "version 2": (raw_frame(header([F32_4]), ZEROS_16, version=2), "version 2"),
    "version 0": (raw_frame(header([F32_4]), ZEROS_16, version=0), "version 0"),
    "empty header": (raw_frame(b"", b""), "header of 0 bytes"),
    "non-JSON header": (raw_frame(b"this is not json {"), "not valid UTF-8 JSON"),
    "non-UTF-8 header": (raw_frame(b"\xff\xfe\xfd"), "not valid UTF-8 JSON"),
    "JSON array": (raw_frame(b"[1, 2, 3]"), "not a JSON object"),
    "JSON string": (raw_frame(b'"gradients"'), "not a JSON object"),
    "JSON null": (raw_frame(b"null"), "not a JSON object"),
    "deeply nested arrays": (raw_frame(b"[" * 200_000), "not valid UTF-8 JSON"),
    "deeply nested objects": (raw_frame(deep_json(40_000)), "not valid UTF-8 JSON"),
    "missing kind": (raw_frame({"meta": {}, "codec": "none", "raw_nbytes": 0, "tensors": []}), "'kind'"),
    "empty kind": (raw_frame(header(kind="")), "'kind'"),
    "kind too long": (raw_frame(header(kind="k" * 65)), "'kind'"),
    "kind not a string": (raw_frame(header(kind=5)), "'kind'"),
    "meta not an object": (raw_frame(header(meta=[1])), "'meta'"),
    "codec missing": (raw_frame({"kind": "m", "meta": {}, "raw_nbytes": 0, "tensors": []}), "'codec'"),
    "unknown codec": (raw_frame(header([F32_4], codec="brotli"), ZEROS_16), "unknown codec 'brotli'"),
    "codec pickle": (raw_frame(header([F32_4], codec="pickle"), ZEROS_16), "unknown codec 'pickle'"),
    "raw_nbytes negative": (raw_frame(header(raw_nbytes=-1)), "'raw_nbytes'"),
    "raw_nbytes bool": (raw_frame(header([{"name": "b", "dtype": "uint8", "shape": [1]}], raw_nbytes=True), b"\x01"),
                        "'raw_nbytes'"),
    "raw_nbytes float": (raw_frame(header([F32_4], raw_nbytes=16.0), ZEROS_16), "'raw_nbytes'"),
    "raw_nbytes over max frame": (raw_frame(header(raw_nbytes=2 * MIB)), "'raw_nbytes'"),
    "tensors not a list": (raw_frame({"kind": "m", "meta": {}, "codec": "none", "raw_nbytes": 16,
                                      "tensors": {"g": F32_4}}, ZEROS_16), "'tensors'"),
    "tensors missing": (raw_frame({"kind": "m", "meta": {}, "codec": "none", "raw_nbytes": 0}), "'tensors'"),
    "too many tensors": (raw_frame(header([{"name": "", "dtype": "uint8", "shape": [0]}] * 4097)), "at most 4096"),
    "tensor not an object": (raw_frame(header(raw_nbytes=0, tensors=[[1]])), "tensor 0 is not an object"),
    "tensor name not a string": (raw_frame(header([{"name": 1, "dtype": "uint8", "shape": [1]}]), b"\0"), "bad name"),
    "tensor name too long": (raw_frame(header([{"name": "n" * 257, "dtype": "uint8", "shape": [1]}]), b"\0"), "bad name"),
    "unknown dtype": (raw_frame(header([{"name": "c", "dtype": "complex64", "shape": [2]}], raw_nbytes=16), ZEROS_16),
                      "unknown dtype 'complex64'"),
    "dtype object (pickle-ish)": (raw_frame(header([{"name": "c", "dtype": "object", "shape": [2]}], raw_nbytes=16),
                                            ZEROS_16), "unknown dtype 'object'"),
    "dtype missing": (raw_frame(header([{"name": "c", "shape": [2]}], raw_nbytes=16), ZEROS_16), "unknown dtype None"),
    "shape does not match raw_nbytes": (raw_frame(header([{"name": "g", "dtype": "float32", "shape": [3]}], raw_nbytes=16),
                                                  ZEROS_16), "need 12"),
    "shape needs more than raw_nbytes": (raw_frame(header([{"name": "g", "dtype": "float64", "shape": [4]}], raw_nbytes=16),
                                                   ZEROS_16), "need 32"),
    "second tensor overflows": (raw_frame(header([F32_4, {"name": "h", "dtype": "int64", "shape": [2**40, 2**40]}],
                                                 raw_nbytes=16), ZEROS_16), "'raw_nbytes' declares 16"),
    "negative dim": (raw_frame(header([{"name": "g", "dtype": "float32", "shape": [-4]}], raw_nbytes=16), ZEROS_16),
                     "non-negative integers"),
    "negative dims cancelling": (raw_frame(header([{"name": "g", "dtype": "float32", "shape": [-2, -2]}], raw_nbytes=16),
                                           ZEROS_16), "non-negative integers"),
    "bool dim": (raw_frame(header([{"name": "g", "dtype": "uint8", "shape": [True]}], raw_nbytes=1), b"\0"),
                 "non-negative integers"),
    "float dim": (raw_frame(header([{"name": "g", "dtype": "float32", "shape": [4.0]}], raw_nbytes=16), ZEROS_16),
                  "non-negative integers"),
    "string dim": (raw_frame(header([{"name": "g", "dtype": "float32", "shape": ["4"]}], raw_nbytes=16), ZEROS_16),
                   "non-negative integers"),
    "shape not a list": (raw_frame(header([{"name": "g", "dtype": "float32", "shape": 4}], raw_nbytes=16), ZEROS_16),
                         "shape must be a list"),
    "rank 9": (raw_frame(header([{"name": "g", "dtype": "float32", "shape": [1] * (MAX_TENSOR_RANK + 1)}], raw_nbytes=4),
                         bytes(4)), "at most 8"),
    "none payload shorter than declared": (raw_frame(header([F32_4]), bytes(12)), "12 bytes but the header declares 16"),
    "none payload longer than declared": (raw_frame(header([F32_4]), bytes(20)), "20 bytes but the header declares 16"),
    "payload without tensors": (raw_frame(header(), b"extra"), "5 bytes but the header declares 0"),
    "zlib bomb": (raw_frame(header([{"name": "g", "dtype": "float32", "shape": [256]}], codec="zlib"), BOMB),
                  "does not decompress to the declared 1024 bytes"),
    "zlib decompresses short": (raw_frame(header([{"name": "g", "dtype": "float32", "shape": [8]}], codec="zlib"),
                                          GOOD_ZLIB), "declared 32 bytes"),
    "zlib truncated stream": (raw_frame(header([F32_4], codec="zlib"), GOOD_ZLIB[:-3]), "truncated"),
    "zlib corrupt data": (raw_frame(header([F32_4], codec="zlib"), b"\x00garbage that is not deflate"), "corrupt"),
    "zlib empty payload": (raw_frame(header([F32_4], codec="zlib"), b""), "declared 16 bytes"),
}


@pytest.mark.parametrize("name", BAD_FRAMES)
def test_bad_frame_raises_protocol_error(sock_pair, name):
    writer, reader_sock = sock_pair
    data, pattern = BAD_FRAMES[name]
    # From a thread: some frames are larger than the socket buffer, and the reader may stop early.
    sender = threading.Thread(target=_sendall_quiet, args=(writer, data), daemon=True)
    sender.start()
    reader = FrameReader(reader_sock, max_frame_bytes=1 * MIB)
    with pytest.raises(ProtocolError, match=pattern) as info:
        reader.read_message()
    assert type(info.value) is ProtocolError, f"{name}: got {type(info.value).__name__}: {info.value}"


def _sendall_quiet(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # the reader gave up on the frame, as it should


def test_good_frame_built_by_hand_is_accepted(sock_pair):
    """Control for BAD_FRAMES: the same helpers build a frame the reader accepts."""
    writer, reader_sock = sock_pair
    payload = np.arange(4, dtype=np.float32).tobytes()
    writer.sendall(raw_frame(header([F32_4]), payload) + raw_frame(header([F32_4], codec="zlib"), GOOD_ZLIB))
    reader = FrameReader(reader_sock, max_frame_bytes=1 * MIB)
    assert reader.read_message().tensor("g").tolist() == [0.0, 1.0, 2.0, 3.0]
    assert reader.read_message().tensor("g").tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("header_nbytes, payload_nbytes", [
    (MAX_HEADER_BYTES + 1, 0),  # header over its own limit
    (100, 1 * MIB),  # header + payload over max_frame_bytes by 100 bytes
    (100, 2**63),  # a payload no one could allocate
    (2**32 - 1, 2**64 - 1),
])
def test_oversized_frame_is_refused_right_after_the_prefix(sock_pair, header_nbytes, payload_nbytes):
    writer, reader_sock = sock_pair
    sentinel = b"NEXT-BYTES-UNREAD"
    writer.sendall(PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, header_nbytes, payload_nbytes) + sentinel)
    reader = FrameReader(reader_sock, max_frame_bytes=1 * MIB)
    with pytest.raises(ProtocolError, match="header|max_frame_bytes") as info:
        reader.read_message()
    assert type(info.value) is ProtocolError
    # Nothing past the 16-byte prefix was read: neither header nor payload.
    assert reader_sock.recv(64) == sentinel


def test_frame_exactly_at_max_frame_bytes_is_accepted(sock_pair):
    writer, reader_sock = sock_pair
    max_frame = 64 * 1024
    hb = b'{"kind":"m","codec":"none","raw_nbytes":%d,"tensors":[{"name":"b","dtype":"uint8","shape":[%d]}]}'
    # Find the payload size that makes header + payload == max_frame.
    n = max_frame - len(hb % (60000, 60000))
    hdr = hb % (n, n)
    assert len(hdr) + n == max_frame
    frame = raw_frame(hdr, bytes(n))
    threading.Thread(target=lambda: _sendall_quiet(writer, frame), daemon=True).start()
    msg = FrameReader(reader_sock, max_frame_bytes=max_frame).read_message()
    assert msg.tensor("b").shape == (n,)


@pytest.mark.parametrize("dtype", [["float32"], {"a": 1}])
def test_unhashable_dtype_raises_protocol_error(sock_pair, dtype):
    writer, reader_sock = sock_pair
    writer.sendall(raw_frame(header([{"name": "g", "dtype": dtype, "shape": [4]}], raw_nbytes=16), ZEROS_16))
    with pytest.raises(ProtocolError):
        FrameReader(reader_sock, max_frame_bytes=1 * MIB).read_message()


@pytest.mark.parametrize("shape", [[0, 2**70], [0, 2**62, 2**62]])
def test_zero_size_shape_with_huge_dim_raises_protocol_error(sock_pair, shape):
    writer, reader_sock = sock_pair
    writer.sendall(raw_frame(header([{"name": "e", "dtype": "float32", "shape": shape}], raw_nbytes=0)))
    with pytest.raises(ProtocolError):
        FrameReader(reader_sock, max_frame_bytes=1 * MIB).read_message()


def test_zlib_payload_with_trailing_bytes_raises_protocol_error(sock_pair):
    writer, reader_sock = sock_pair
    writer.sendall(raw_frame(header([F32_4], codec="zlib"), GOOD_ZLIB + b"trailing junk"))
    with pytest.raises(ProtocolError):
        FrameReader(reader_sock, max_frame_bytes=1 * MIB).read_message()


# --------------------------------------------------------------------------------------------------
# End of stream
# --------------------------------------------------------------------------------------------------
def test_eof_between_frames_is_peer_closed(sock_pair):
    writer, reader_sock = sock_pair
    send_frames(writer, [encode_message("stop")])
    writer.shutdown(socket.SHUT_WR)
    reader = FrameReader(reader_sock, max_frame_bytes=1 * MIB)
    assert reader.read_message().kind == "stop"
    with pytest.raises(PeerClosed, match="^peer closed the connection$"):
        reader.read_message()


FULL = raw_frame(header([F32_4]), np.arange(4, dtype=np.float32).tobytes())


@pytest.mark.parametrize("cut", [1, 8, 15, 16, 20, len(FULL) - 16, len(FULL) - 1])
def test_truncated_frame_is_peer_closed_mid_frame(sock_pair, cut):
    writer, reader_sock = sock_pair
    writer.sendall(FULL[:cut])
    writer.shutdown(socket.SHUT_WR)
    with pytest.raises(PeerClosed, match="middle of a frame"):
        FrameReader(reader_sock, max_frame_bytes=1 * MIB).read_message()


def test_truncation_control_full_frame_is_read(sock_pair):
    writer, reader_sock = sock_pair
    writer.sendall(FULL)
    writer.shutdown(socket.SHUT_WR)
    assert FrameReader(reader_sock, max_frame_bytes=1 * MIB).read_message().tensor("g").tolist() == [0, 1, 2, 3]


def test_parse_header_returns_validated_header():
    hdr = header([F32_4, {"name": "s", "dtype": "bool", "shape": []}])
    assert hdr["raw_nbytes"] == 17
    assert parse_header(json.dumps(hdr).encode(), 1024) == hdr
    with pytest.raises(ProtocolError, match="raw_nbytes"):
        parse_header(json.dumps(hdr).encode(), 16)


@pytest.mark.parametrize("whole_frames", [False, True], ids=["exact", "whole"])
def test_the_reader_says_how_much_of_a_payload_was_already_queued(whole_frames):
    """A frame sent whole before the read starts: its payload was all in the receive queue (FIONREAD; a
    whole-frame reader that took the payload with its header knows it without asking)."""
    import socket as _socket

    a, b = _socket.socketpair()
    try:
        payload = np.arange(4096, dtype=np.float32)
        send_frames(a, [encode_message("gradients", {}, [WireTensor("grad", payload)])])
        reader = FrameReader(b, max_frame_bytes=1 << 20, reuse_buffers=whole_frames, whole_frames=whole_frames)
        msg = reader.read_message()
        assert msg.payload_queued_nbytes == payload.nbytes == msg.payload_nbytes
        assert np.array_equal(msg.tensor("grad"), payload)
    finally:
        a.close()
        b.close()


def _frame_bytes(frame) -> bytes:
    return b"".join(bytes(memoryview(b).cast("B")) for b in frame.buffers)


def _stream_and_check(writer, reader, frames, aligned: bool = False) -> None:
    """Send `frames` (meta {"i": index}) in one write from a thread; read each with `reader` and check it
    is the frame sent: meta, wire size, every tensor's values (and, with `aligned`, aligned arrays)."""
    data = b"".join(_frame_bytes(f) for f in frames)
    threading.Thread(target=_sendall_quiet, args=(writer, data), daemon=True).start()
    for i, frame in enumerate(frames):
        msg = reader.read_message(deadline=time.monotonic() + 10)
        assert msg.meta == {"i": i} and msg.wire_nbytes == frame.wire_nbytes
        sent = [np.frombuffer(memoryview(b).cast("B"), np.float32) for b in frame.buffers[1:]]
        got = [t.array for t in msg.tensors]
        assert len(sent) == len(got) and all(np.array_equal(a, b) for a, b in zip(sent, got))
        assert not aligned or all(a.flags.aligned for a in got)


@pytest.mark.parametrize("recv_chunk_bytes", [1000, 64 * MIB])
def test_read_ahead_reads_a_stream_of_frames_exactly_as_without(sock_pair, recv_chunk_bytes):
    """With read_ahead_bytes the end of one frame and the start of the next come in one recv: the
    messages are the same, whatever the frames' sizes (no payload, smaller and larger than the
    read-ahead buffer) and however the kernel cuts the stream."""
    writer, reader_sock = sock_pair
    rng = np.random.default_rng(5)
    sizes = [0, 1, 3000, 5000, 300_000, 0, 17, 4096 - 200, 1 * MIB]
    frames = [encode_message("m", {"i": i}, [WireTensor("t", rng.standard_normal(n // 4 or 1).astype(np.float32))]
                             if n else []) for i, n in enumerate(sizes)]
    reader = FrameReader(reader_sock, 4 * MIB, recv_chunk_bytes, reuse_buffers=False, read_ahead_bytes=4096)
    _stream_and_check(writer, reader, frames)
    writer.close()
    with pytest.raises(PeerClosed, match="peer closed the connection$"):
        reader.read_message()


def test_read_ahead_takes_at_most_its_buffer_past_a_frame(sock_pair):
    """What a reader takes past the end of the frame it returned is bounded by read_ahead_bytes: the
    rest stays in the socket."""
    writer, reader_sock = sock_pair
    frame = encode_message("m", {}, [WireTensor("t", np.zeros(1000, np.float32))])
    writer.sendall(_frame_bytes(frame) + b"X" * 10_000)
    time.sleep(0.05)  # all of it in the reader's queue before the first recv
    reader = FrameReader(reader_sock, 1 * MIB, read_ahead_bytes=4096)
    reader.read_message()
    left = b""
    while len(left) < 10_000 - 4096:
        left += reader_sock.recv(65536)
    assert left == b"X" * (10_000 - 4096)


def test_read_ahead_still_refuses_an_oversized_frame_after_a_good_one(sock_pair):
    writer, reader_sock = sock_pair
    good = _frame_bytes(encode_message("m", {}, [WireTensor("t", np.zeros(8, np.float32))]))
    writer.sendall(good + PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, 100, 2 * MIB) + b"Y" * 64)
    time.sleep(0.05)
    reader = FrameReader(reader_sock, 1 * MIB, read_ahead_bytes=4096)
    reader.read_message()
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        reader.read_message()


def test_read_ahead_is_off_on_a_socket_without_recvmsg_into():
    """A TLS socket (ssl.SSLSocket has no recvmsg_into) reads every part exactly."""

    class NoScatter:
        def recv_into(self, view):
            return 0

    assert FrameReader(NoScatter(), 1 * MIB, read_ahead_bytes=4096).read_ahead_bytes == 0


class _CountingSocket:
    """A socket wrapper that counts `recv_into` calls (everything else goes to the real socket)."""

    def __init__(self, sock):
        self._sock, self.recv_calls = sock, 0

    def recv_into(self, view, nbytes=0):
        self.recv_calls += 1
        return self._sock.recv_into(view, nbytes)

    def __getattr__(self, name):
        return getattr(self._sock, name)


@pytest.mark.parametrize("sizes", [
    [0, 1, 3000, 5000, 300_000, 0, 17, 4096 - 200, 1 * MIB, 8, 2 * MIB, 2 * MIB, 64],
    [70_000] * 5 + [0] * 5 + [70_000] * 3,
])
def test_whole_frames_read_a_stream_of_frames_exactly_as_without(sock_pair, sizes):
    """whole_frames takes frames into one buffer, asking for the last frame's size: the messages are the
    same whatever the sizes (shorter than the guess: bytes of the next frames are kept; longer: the
    buffer grows), and the payload's arrays are aligned views of that buffer."""
    writer, reader_sock = sock_pair
    rng = np.random.default_rng(6)
    frames = [encode_message("m", {"i": i}, [WireTensor("t", rng.standard_normal(n // 4 or 1).astype(np.float32))]
                             if n else []) for i, n in enumerate(sizes)]
    reader = FrameReader(reader_sock, 4 * MIB, reuse_buffers=True, whole_frames=True)
    assert reader.whole_frames
    _stream_and_check(writer, reader, frames, aligned=True)
    assert reader.buffered_nbytes() == 0
    writer.close()
    with pytest.raises(PeerClosed, match="peer closed the connection$"):
        reader.read_message()


def test_whole_frames_read_equal_frames_with_one_request_each(sock_pair):
    """Frames of one size, all queued: after the first (the first guess, then the rest), each frame is one
    `recv_into` asking for exactly its size, and nothing is read past the last one."""
    writer, reader_sock = sock_pair
    count = 17_000  # a frame of 68 KB: longer than the first guess
    frame = _frame_bytes(encode_message("m", {}, [WireTensor("t", np.ones(count, np.float32))]))
    writer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)  # the kernel caps it at 2 x wmem_max
    writer.sendall(frame * 4 + b"Z" * 3)  # all queued before the first read
    counting = _CountingSocket(reader_sock)
    reader = FrameReader(counting, 1 * MIB, reuse_buffers=True, whole_frames=True)
    reader.read_message()
    assert counting.recv_calls == 2  # the first guess, then the rest of the frame
    for _ in range(3):
        assert reader.read_message().tensor("t").sum() == count
    assert counting.recv_calls == 2 + 3
    assert reader.buffered_nbytes() == 0 and reader_sock.recv(16) == b"Z" * 3


def test_whole_frames_refuse_an_oversized_frame_read_with_a_good_one_without_growing(sock_pair):
    """An oversized frame whose prefix came in with a good frame is refused from its prefix, and the
    reader's buffer did not grow to the size it declares."""
    writer, reader_sock = sock_pair
    good = _frame_bytes(encode_message("m", {}, [WireTensor("t", np.zeros(8, np.float32))]))
    writer.sendall(good * 3 + PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, 100, 2 * MIB) + b"Y" * 64)
    time.sleep(0.05)
    reader = FrameReader(reader_sock, 1 * MIB, reuse_buffers=True, whole_frames=True)
    for _ in range(3):
        reader.read_message()
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        reader.read_message()
    assert len(reader._frame_buf) < 1 * MIB


def test_whole_frames_keep_a_deadline_on_a_partial_frame(sock_pair):
    writer, reader_sock = sock_pair
    frame = _frame_bytes(encode_message("m", {}, [WireTensor("t", np.zeros(1000, np.float32))]))
    writer.sendall(frame + frame[:100])
    reader = FrameReader(reader_sock, 1 * MIB, reuse_buffers=True, whole_frames=True)
    reader.read_message()
    with pytest.raises(DeadlineExceeded):
        reader.read_message(deadline=time.monotonic() + 0.2)


def test_whole_frames_say_when_the_peer_closes_mid_frame(sock_pair):
    writer, reader_sock = sock_pair
    frame = _frame_bytes(encode_message("m", {}, [WireTensor("t", np.zeros(1000, np.float32))]))
    writer.sendall(frame + frame[:100])
    writer.close()
    reader = FrameReader(reader_sock, 1 * MIB, reuse_buffers=True, whole_frames=True)
    reader.read_message()
    with pytest.raises(PeerClosed, match="middle of a frame"):
        reader.read_message()


def test_whole_frames_need_reused_buffers_and_a_kernel_socket(sock_pair):
    _, reader_sock = sock_pair
    assert not FrameReader(reader_sock, 1 * MIB, reuse_buffers=False, whole_frames=True).whole_frames
    assert FrameReader(reader_sock, 1 * MIB, reuse_buffers=True, whole_frames=True).whole_frames
    no_scatter = type("NoScatter", (), {"recv_into": lambda self, view: 0})()  # a TLS socket's shape
    assert not FrameReader(no_scatter, 1 * MIB, reuse_buffers=True, whole_frames=True).whole_frames


def test_the_reader_tells_the_decodes_cpu_apart_from_the_read():
    """A zlib frame of 4 MiB: decompressing it takes the reading thread's CPU (``decode_cpu_s``), which an
    uncompressed frame, a view of the received bytes, does not need."""
    a, b = socket.socketpair()
    try:
        values = np.tile(np.arange(1024, dtype=np.float32), 1024)
        for codec in (ZlibCodec(1), None):
            frame = encode_message("gradients", {"i": 0}, [WireTensor("grad", values)], codec)
            threading.Thread(target=_sendall_quiet, args=(a, _frame_bytes(frame)), daemon=True).start()
            cpu0 = time.thread_time()
            msg = FrameReader(b, max_frame_bytes=1 << 24).read_message(deadline=time.monotonic() + 10)
            read_cpu_s = time.thread_time() - cpu0
            assert np.array_equal(msg.tensors[0].array, values)
            if codec is not None:
                assert 0 < msg.decode_cpu_s <= read_cpu_s
                zlib_decode_cpu_s = msg.decode_cpu_s
            else:
                assert msg.decode_cpu_s < zlib_decode_cpu_s / 10
    finally:
        a.close()
        b.close()
