"""wiiide.codecs: lossless round trips, bounded decoding, the registry and the compression policies."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from wiiide.codecs import (
    REGISTRY,
    Codec,
    NoCodec,
    ZlibCodec,
    codec_from_name,
    decoder_for,
)
from wiiide.codecs.policy import CompressionPolicy
from wiiide.errors import ProtocolError

ALL_CODECS = ["none"] + [f"zlib-{level}" for level in range(1, 10)]


def payloads() -> dict[str, bytes]:
    rng = np.random.default_rng(123)
    return {
        "random float32": rng.standard_normal(50_000).astype(np.float32).tobytes(),
        "all zeros float32": np.zeros(50_000, np.float32).tobytes(),
        "one byte": b"\x07",
    }


@pytest.mark.parametrize("name", ALL_CODECS)
@pytest.mark.parametrize("kind", list(payloads()))
def test_lossless_roundtrip(name, kind):
    raw = payloads()[kind]
    codec = codec_from_name(name)
    assert codec.lossless
    assert codec.name == name
    wire = codec.encode(raw)
    out = decoder_for(codec.wire_id).decode(wire, len(raw))
    assert bytes(out) == raw
    # The decoded bytes read back as the same float32 values, bit for bit.
    if kind != "one byte":
        assert np.array_equal(np.frombuffer(out, np.float32), np.frombuffer(raw, np.float32))


@pytest.mark.parametrize("level", range(1, 10))
def test_zlib_compresses_zeros_and_not_random(level):
    p = payloads()
    codec = ZlibCodec(level)
    assert len(codec.encode(p["all zeros float32"])) < len(p["all zeros float32"]) // 50
    # Random float32 mantissas barely compress: at least 80 % of the size remains.
    assert len(codec.encode(p["random float32"])) > 0.8 * len(p["random float32"])


def test_higher_level_is_not_larger_on_structured_data():
    raw = np.repeat(np.arange(1000, dtype=np.float32), 50).tobytes()
    assert len(ZlibCodec(9).encode(raw)) <= len(ZlibCodec(1).encode(raw))


def test_identity_codec_does_not_copy():
    raw = bytearray(b"abcdef")
    assert NoCodec().encode(raw) is raw
    view = memoryview(raw)
    assert NoCodec().decode(view, 6) is view


def test_identity_decode_checks_size():
    with pytest.raises(ProtocolError, match="5 bytes but the header declares 6"):
        NoCodec().decode(b"abcde", 6)


def test_zlib_decode_emits_at_most_declared_plus_one_byte():
    bomb = zlib.compress(bytes(50_000_000), 9)  # 50 MB of zeros in about 50 KB
    with pytest.raises(ProtocolError, match=r"declared 1000 bytes \(got 1001\+"):
        ZlibCodec().decode(bomb, 1000)


@pytest.mark.parametrize("raw_nbytes", [0, 99, 101])
def test_zlib_decode_wrong_declared_size(raw_nbytes):
    wire = zlib.compress(bytes(range(100)), 6)
    with pytest.raises(ProtocolError, match="declared"):
        ZlibCodec().decode(wire, raw_nbytes)


def test_zlib_decode_corrupt():
    wire = bytearray(zlib.compress(np.arange(1000, dtype=np.float32).tobytes(), 6))
    wire[10] ^= 0xFF
    wire[11] ^= 0xFF
    with pytest.raises(ProtocolError, match="zlib"):
        ZlibCodec().decode(bytes(wire), 4000)


def test_zlib_decoder_accepts_any_level():
    """The wire id is "zlib" for every level: one decoder reads them all."""
    raw = np.arange(2000, dtype=np.int32).tobytes()
    for level in range(1, 10):
        assert bytes(decoder_for("zlib").decode(ZlibCodec(level).encode(raw), len(raw))) == raw


@pytest.mark.parametrize("level", [0, 10, -1])
def test_zlib_level_out_of_range(level):
    with pytest.raises(ValueError, match="1..9"):
        ZlibCodec(level)


@pytest.mark.parametrize("name", ["zlib-0", "zlib-10", "zlib-x", "zlib", "brotli", "", "ZLIB-1"])
def test_codec_from_name_rejects(name):
    with pytest.raises(ValueError):
        codec_from_name(name)


@pytest.mark.parametrize("wire_id", ["brotli", "", "ZLIB", "zlib-1", None, 3, ["zlib"]])
def test_decoder_for_unknown_is_protocol_error(wire_id):
    with pytest.raises(ProtocolError, match="unknown codec"):
        decoder_for(wire_id)  # type: ignore[arg-type]


def test_registry_consistent():
    assert {"none", "zlib"} <= set(REGISTRY)
    assert REGISTRY["none"] is NoCodec and REGISTRY["zlib"] is ZlibCodec
    for wire_id, cls in REGISTRY.items():
        assert issubclass(cls, Codec)
        assert cls.wire_id == wire_id
        assert type(decoder_for(wire_id)) is cls
    assert NoCodec.lossless and ZlibCodec.lossless


# --------------------------------------------------------------------------------------------------
# CompressionPolicy
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gradients", "params", "batch", "hello"])
@pytest.mark.parametrize("raw_nbytes", [0, 100, 10 * 1024 * 1024])
def test_policy_none_never_compresses(kind, raw_nbytes):
    assert isinstance(CompressionPolicy("none").choose(kind, raw_nbytes), NoCodec)


@pytest.mark.parametrize("level", range(1, 10))
def test_policy_fixed_zlib_level(level):
    policy = CompressionPolicy(f"zlib-{level}")
    for kind in ("gradients", "params", "batch"):
        for raw_nbytes in (10, 10 * 1024 * 1024):
            codec = policy.choose(kind, raw_nbytes)
            assert isinstance(codec, ZlibCodec) and codec.level == level and codec.name == f"zlib-{level}"


def test_policy_adaptive_default_threshold_is_1_mib():
    policy = CompressionPolicy("adaptive")
    assert policy.threshold_bytes == 1024 * 1024
    assert policy.choose("gradients", 1024 * 1024 + 1).name == "zlib-1"
    assert policy.choose("gradients", 1024 * 1024).name == "none"  # "larger than" the threshold


@pytest.mark.parametrize("raw_nbytes, expected", [(0, "none"), (4095, "none"), (4096, "none"), (4097, "zlib-1"),
                                                  (100_000_000, "zlib-1")])
def test_policy_adaptive_gradients(raw_nbytes, expected):
    codec = CompressionPolicy("adaptive", threshold_bytes=4096).choose("gradients", raw_nbytes)
    assert codec.name == expected


@pytest.mark.parametrize("kind", ["params", "batch", "welcome", "stop"])
@pytest.mark.parametrize("raw_nbytes", [0, 10, 100_000_000])
def test_policy_adaptive_other_kinds_zlib_9(kind, raw_nbytes):
    codec = CompressionPolicy("adaptive", threshold_bytes=4096).choose(kind, raw_nbytes)
    assert isinstance(codec, ZlibCodec) and codec.level == 9


def test_policy_unknown_name():
    with pytest.raises(ValueError):
        CompressionPolicy("brotli")
