"""Codecs for tensor payloads, behind a registry keyed by their wire id.

A codec turns the tensors of one message into the bytes that travel, and back. Each codec is a small
class with a `wire_id` (what the frame header names), a `lossless` flag and bounded decoding: a
payload that would decode to more (or fewer) bytes than its header declares raises `ProtocolError`
(no decompression bombs). (Design after hivemind's ``hivemind/compression/``.)

=========  ========  ==========================================================================
wire id    lossless  what travels
=========  ========  ==========================================================================
none       yes       the raw bytes (no copy)
zlib       yes       DEFLATE, levels 1-9 (the seeds' codec; about 25 MB/s at level 1 here)
zstd       yes       Zstandard, levels 1-22 (``zstandard`` package; releases the GIL)
lz4        yes       LZ4 block format (``lz4`` package; releases the GIL)
blosc2     yes       byte-shuffle (typesize = the tensors' itemsize) + per-byte-plane zstd or lz4
fp16       no        float32 -> float16, clamped to +-65504 (float32 tensors only)
bf16       no        float32 -> bfloat16, round to nearest even (float32 tensors only)
int8       no        8-bit blockwise absmax quantization: one float32 scale per block
int4       no        4-bit blockwise absmax (codes -7..7, two a byte) + one float32 scale per block
int3       no        3-bit blockwise absmax (codes -3..3, eight to three bytes) + one scale per block
int3z      no        int3's scales and codes, the codes two a byte compressed as one zstd frame
int2       no        ternary blockwise absmax (codes -1..1, four a byte) + one scale per block
lloyd2     no        2-bit Lloyd-Max levels for a Gaussian, scaled by the block's mean |x|
lloyd3     no        3-bit Lloyd-Max levels, scaled by the block's mean |x|
topk       no        the k largest magnitudes per tensor (int32 index + float32 value), with
                     error feedback: what is not sent is kept per tensor and added back next time
rows       yes       the non-zero rows of each float32 tensor: row ids (int32/int64) + rows
                     (mostly-zero dense tensors; `wiiide.codecs.rows`)
=========  ========  ==========================================================================

Lossless codecs work on bytes (any dtype). Lossy codecs change what travels (dtype, element count),
so they carry their parameters in the header's ``codec_params`` and the receiver rebuilds exactly
the float32 tensors the header declares; they refuse any message with a non-float32 tensor.
Large lossless payloads may be split into chunks encoded on a thread pool
(`wiiide.codecs.chunked`); the chunk table travels in ``codec_params`` too.

Modules, one job each (imports run down this list, never up):

- `wiiide.codecs.base`: the `Codec` interface, `NoCodec`, byte helpers;
- `wiiide.codecs.chunked`: parallel chunks on a `CodecPool` (passed in by whoever owns it);
- `wiiide.codecs.lossless`, `wiiide.codecs.lossy` (a package, one module per family): the codecs;
- `wiiide.codecs.registry`: wire id -> codec class and decoder, codec names -> instances (checked at
  import: every wire id maps to exactly one codec class, and every class has a decoder instance);
- `wiiide.codecs.policy`: which codec encodes a message (builds frames with `wiiide.wire.encode`,
  which imports no codec; this package does not re-export it: import `wiiide.codecs.policy` directly),
  with `wiiide.codecs.link_estimate`: the link rate a node infers from what it receives.

`byte_view` lives in `wiiide.wire.format` (below the codecs) and is re-exported here.
"""

from wiiide.codecs.base import (
    Buffer,
    Codec,
    NoCodec,
    TensorSpecs,
    check_params,
)
from wiiide.codecs.lossless import (
    Blosc2Codec,
    ByteCodec,
    Lz4Codec,
    ZlibCodec,
    ZstdCodec,
)
from wiiide.codecs.lossy.blockwise import Int8BlockCodec
from wiiide.codecs.lossy.casts import Bf16Codec, Fp16Codec
from wiiide.codecs.lossy.topk import TopKCodec
from wiiide.codecs.registry import (
    CODEC_CLASSES,
    CODEC_NAME_FORMS,
    REGISTRY,
    codec_from_name,
    decoder_for,
)
from wiiide.codecs.rows import RowsCodec
from wiiide.wire.format import byte_view

__all__ = ["Buffer", "TensorSpecs", "Codec", "ByteCodec", "NoCodec", "ZlibCodec", "ZstdCodec", "Lz4Codec",
           "Blosc2Codec", "Fp16Codec", "Bf16Codec", "Int8BlockCodec", "TopKCodec", "RowsCodec", "CODEC_CLASSES", "REGISTRY",
           "CODEC_NAME_FORMS", "decoder_for", "codec_from_name", "check_params", "byte_view"]
