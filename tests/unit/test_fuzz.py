"""Fuzz tests (hypothesis) of everything a peer controls: the frame reader, the header parser, payload
decoding and the coordinator's handshake. Properties: the only exception is ProtocolError (PeerClosed
for a short stream), nothing hangs (socket timeouts bound every read), nothing allocates beyond the
frame limit, and no random hello is ever admitted. Strings range over all of Unicode, lone surrogates
included (as JSON \\uD800 escapes), and integers over any size, beyond the 4300 digits Python will
parse or print (sys.get_int_max_str_digits): the header text is written by hand, not by json.dumps.

Budget: WIIIIIDE_FUZZ_EXAMPLES examples per test (default 100 in `make test`; e.g. 20000 on demand:
``WIIIIIDE_FUZZ_EXAMPLES=20000 python -m pytest tests/unit/test_fuzz.py``).
"""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wiiide.config import RunConfig
from wiiide.errors import ProtocolError
from wiiide.wire.auth import hello_mac, verify
from wiiide.wire.decode import decode_payload, parse_header
from wiiide.wire.encode import encode_message
from wiiide.wire.format import DTYPES, MAGIC, MAX_HEADER_BYTES, PREFIX, PROTOCOL_VERSION
from wiiide.wire.reader import FrameReader

EXAMPLES = int(os.environ.get("WIIIIIDE_FUZZ_EXAMPLES", "100"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_FRAME = 64 * 1024

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
tensor_entries = st.fixed_dictionaries({}, optional={
    "name": st.one_of(st.text(max_size=10), st.integers()),
    "dtype": st.one_of(st.sampled_from(sorted(DTYPES)), st.text(max_size=8), st.none()),
    "shape": st.one_of(st.lists(st.integers(-3, 2**40), max_size=10), json_values),
})
headers = st.fixed_dictionaries({}, optional={
    "kind": st.one_of(st.sampled_from(["gradients", "params", "batch", "hello"]), json_values),
    "meta": json_values,
    "codec": st.one_of(st.sampled_from(["none", "zlib", "zstd", "bogus"]), json_values),
    "raw_nbytes": st.one_of(st.integers(-5, 2**34), json_values),
    "tensors": st.one_of(st.lists(tensor_entries, max_size=5), json_values),
})


def _read_all(data: bytes) -> list:
    """Feed `data` to a FrameReader through a real socket; return what it read before it stopped."""
    a, b = socket.socketpair()
    a.settimeout(2.0)
    b.sendall(data)
    b.close()
    reader = FrameReader(a, MAX_FRAME, recv_chunk_bytes=1024)
    messages = []
    try:
        while True:
            messages.append(reader.read_message())
    except ProtocolError:  # includes PeerClosed at the end of the stream
        pass
    finally:
        a.close()
    return messages


@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes_only_raise_protocol_error(data):
    _read_all(data)


@FUZZ
@given(headers, st.binary(max_size=2048))
def test_random_headers_and_payloads_only_raise_protocol_error(header, payload):
    header_bytes = json.dumps(header).encode()
    if len(header_bytes) > MAX_HEADER_BYTES:
        return
    frame = PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, len(header_bytes), len(payload)) + header_bytes + payload
    for message in _read_all(frame):
        # whatever was accepted is self-consistent: every tensor has exactly its declared bytes
        assert sum(t.array.nbytes for t in message.tensors) == message.raw_nbytes


@FUZZ
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1))
def test_declared_sizes_never_allocate_beyond_the_limit(header_nbytes, payload_nbytes):
    prefix = PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, header_nbytes, payload_nbytes)
    a, b = socket.socketpair()
    a.settimeout(2.0)
    b.sendall(prefix)
    b.close()
    reader = FrameReader(a, MAX_FRAME)
    try:
        with pytest.raises(ProtocolError):
            reader.read_message()
    finally:
        a.close()
    # the reader never grew a buffer for a frame it refused
    assert all(len(getattr(reader, attr, b"")) <= MAX_FRAME for attr in ("_payload_buf", "_header_buf"))


@FUZZ
@given(st.dictionaries(st.text(max_size=10), json_values, max_size=6), st.binary(max_size=512))
def test_parse_header_then_decode(header, payload):
    try:
        parsed = parse_header(json.dumps(header).encode(), MAX_FRAME)
        decode_payload(parsed, memoryview(payload))
    except ProtocolError:
        pass


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A connected TCP pair on loopback (the handshake sets TCP options a socketpair lacks)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return server, client


@pytest.fixture(scope="module")
def coordinator():
    from wiiide.server.coordinator import Coordinator

    cfg = RunConfig(handshake_timeout_s=1.0, log_tier="silent", num_workers=1)
    node = Coordinator(cfg)
    node.secret = b"k" * 32
    return node


hello_metas = st.fixed_dictionaries({}, optional={
    "protocol_version": st.one_of(st.just(PROTOCOL_VERSION), json_values),
    "node_id": st.one_of(st.text(min_size=1, max_size=20), json_values),
    "nonce": st.one_of(st.text(alphabet="0123456789abcdef", min_size=64, max_size=64), json_values),
    "mac": st.one_of(st.text(alphabet="0123456789abcdef", min_size=64, max_size=64), json_values),
})


@FUZZ
@given(st.one_of(st.binary(max_size=512), st.tuples(st.sampled_from(["hello", "gradients", "welcome"]), hello_metas)))
def test_handshake_refuses_every_random_peer(coordinator, peer_input):
    """Raw bytes or well-formed frames with random fields: refused, never admitted, nothing escapes."""
    a, b = tcp_pair()
    errors: list[BaseException] = []

    def run():
        try:
            coordinator._handshake(a, "fuzz", time.monotonic() + coordinator.cfg.handshake_timeout_s)
        except BaseException as exc:  # anything escaping the handshake is a finding
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    b.settimeout(3.0)
    try:
        if isinstance(peer_input, bytes):
            b.sendall(peer_input)
        else:
            kind, meta = peer_input
            b.sendall(b"".join(bytes(x) for x in encode_message(kind, meta).buffers))
        b.shutdown(socket.SHUT_WR)  # end of the peer's input: the handshake must not wait for more
    except OSError:
        pass
    thread.join(timeout=10)
    b.close()
    assert not thread.is_alive(), "handshake hung"
    assert errors == []
    with pytest.raises(queue.Empty):
        coordinator._joining.get_nowait()


def test_a_correct_hello_is_admitted(coordinator):
    """The property above is not vacuous: the same path admits a peer that knows the secret."""
    a, b = tcp_pair()
    thread = threading.Thread(target=coordinator._handshake, args=(a, "good", time.monotonic() + 5.0))
    thread.start()
    b.settimeout(3.0)
    reader = FrameReader(b, MAX_FRAME)
    challenge = reader.read_message()
    nonce_w = "ab" * 32
    mac = hello_mac(coordinator.secret, PROTOCOL_VERSION, challenge.meta["nonce"], nonce_w, "w1")
    b.sendall(b"".join(bytes(x) for x in encode_message(
        "hello", {"protocol_version": PROTOCOL_VERSION, "node_id": "w1", "nonce": nonce_w, "mac": mac}).buffers))
    thread.join(timeout=10)
    joining = coordinator._joining.get(timeout=1)
    assert joining.node_id == "w1"
    joining.conn.close()
    b.close()


# --------------------------------------------------------------------------------------------------
# Arbitrary Unicode and arbitrarily large integers, written straight into the JSON text
# --------------------------------------------------------------------------------------------------
# all of Unicode, with lone surrogates (category Cs) drawn often: hypothesis rarely draws them by itself
any_unicode = st.text(st.one_of(st.characters(blacklist_categories=()), st.characters(min_codepoint=0xD800,
                                                                                        max_codepoint=0xDFFF)),
                      max_size=12)
json_strings = any_unicode.map(json.dumps)  # a lone surrogate becomes a \\udXXX escape
big_int_literals = st.one_of(
    st.integers().map(str),
    st.integers(-2**80, 2**80).map(str),
    st.tuples(st.sampled_from(["", "-"]), st.integers(1, 9), st.integers(0, 6000)).map(
        lambda t: f"{t[0]}{t[1]}{'0' * t[2]}"),  # up to 6001 digits
)
json_texts = st.recursive(
    st.one_of(json_strings, big_int_literals, st.sampled_from(["true", "false", "null", "1e400", "-0.5"])),
    lambda children: st.one_of(
        st.lists(children, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]"),
        st.lists(st.tuples(json_strings, children), max_size=4).map(
            lambda kvs: "{" + ",".join(f"{k}:{v}" for k, v in kvs) + "}"),
    ),
    max_leaves=12,
)
shape_texts = st.one_of(
    st.lists(st.one_of(big_int_literals, st.integers(0, 8).map(str)), max_size=10),
    # dimensions Python can parse (< 4300 digits) whose product it cannot print (eight of 10^600)
    st.lists(st.integers(300, 4000).map(lambda n: "1" + "0" * n), min_size=2, max_size=8),
).map(lambda dims: "[" + ",".join(dims) + "]")
tensor_texts = st.tuples(st.one_of(json_strings, json_texts),
                         st.one_of(st.sampled_from(sorted(DTYPES)).map(json.dumps), json_strings),
                         st.one_of(shape_texts, json_texts)).map(
    lambda t: '{"name":' + t[0] + ',"dtype":' + t[1] + ',"shape":' + t[2] + "}")
header_texts = st.tuples(
    st.one_of(st.sampled_from(["gradients", "hello"]).map(json.dumps), json_strings, json_texts),
    st.one_of(json_texts, st.dictionaries(any_unicode, any_unicode, max_size=3).map(json.dumps)),
    st.one_of(st.just('"none"'), json_strings),
    st.one_of(big_int_literals, st.integers(0, 64).map(str)),
    st.lists(tensor_texts, min_size=1, max_size=4).map(lambda ts: "[" + ",".join(ts) + "]"),
).map(lambda t: '{"kind":' + t[0] + ',"meta":' + t[1] + ',"codec":' + t[2] + ',"raw_nbytes":' + t[3]
      + ',"tensors":' + t[4] + "}")


def _strings_in(value) -> list[str]:
    stack, found = [value], []
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            found.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


@FUZZ
@given(header_texts, st.binary(max_size=256))
def test_headers_with_any_unicode_and_any_integer_only_raise_protocol_error(text, payload):
    """Whatever parses holds only encodable strings and formattable sizes; the rest is ProtocolError."""
    try:
        header = parse_header(text.encode("utf-8", "surrogatepass"), MAX_FRAME)
    except ProtocolError as exc:
        str(exc).encode("utf-8")  # the refusal's cause can be logged and written
        return
    for string in _strings_in(header):
        string.encode("utf-8")
    assert 0 <= header["raw_nbytes"] <= MAX_FRAME
    try:
        message = decode_payload(header, memoryview(payload))
    except ProtocolError:
        return
    assert sum(t.array.nbytes for t in message.tensors) == message.raw_nbytes


@FUZZ
@given(st.one_of(json_texts, any_unicode, st.integers()), st.one_of(any_unicode, json_texts))
def test_verify_only_raises_protocol_error(received, node_id):
    expected = hello_mac(b"k" * 32, PROTOCOL_VERSION, "a" * 64, "b" * 64, node_id)  # any str: no UnicodeEncodeError
    with pytest.raises(ProtocolError):
        verify(expected, received, "hello")


@FUZZ
@given(st.tuples(st.one_of(json_strings, json_texts), st.one_of(json_strings, json_texts),
                 st.one_of(st.just(str(PROTOCOL_VERSION)), json_strings, json_texts, big_int_literals)))
def test_handshake_refuses_any_unicode_and_any_integer(coordinator, fields):
    """A hello whose node_id, nonce and MAC are any Unicode (lone surrogates included) or any integer:
    refused with a recorded cause, never admitted, nothing escapes the handshake."""
    node_id, mac, version = fields
    text = ('{"kind":"hello","meta":{"protocol_version":' + version + ',"node_id":' + node_id + ',"nonce":"'
            + "a" * 64 + '","mac":' + mac + '},"codec":"none","raw_nbytes":0,"tensors":[]}').encode("utf-8", "surrogatepass")
    a, b = tcp_pair()
    before = coordinator.metrics.event_counts.get("connection_refused", 0)
    result: list = []
    thread = threading.Thread(target=lambda: result.append(
        coordinator._handshake(a, "fuzz", time.monotonic() + coordinator.cfg.handshake_timeout_s)))
    thread.start()
    b.settimeout(3.0)
    try:
        b.sendall(PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, len(text), 0) + text)
        b.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    thread.join(timeout=10)
    b.close()
    assert not thread.is_alive(), "handshake hung"
    assert result == [False]  # returned (no exception escaped) and refused
    assert coordinator.metrics.event_counts["connection_refused"] == before + 1
    with pytest.raises(queue.Empty):
        coordinator._joining.get_nowait()
