"""Lossless byte codecs: zlib (the seeds'), zstd, lz4 and byte-shuffle + zstd/lz4 (blosc2).

Every decoder is bounded by the size the header declares: it either checks the size the payload
itself declares before decoding (zstd frame content size, blosc2 chunk header) or decodes into a
buffer of exactly that size (zlib max_length, lz4 uncompressed_size). Anything else, including bytes
after the end of the stream, is a `ProtocolError`.

Measured on this machine (digits MLP 64-512-512-10 gradient, fp32, 1.2 MB; `python -m harness
bench-wire` reports it every run): zlib-1 1.09x at about 25 MB/s, zstd-1 1.09x at about 400-580 MB/s,
lz4 1.01x at about 1.5 GB/s, shuffle-zstd 1.18x at about 400 MB/s, shuffle-lz4 1.05x at about 1 GB/s.
Byte-shuffling helps because the sign/exponent byte of fp32 gradients is very redundant while the
mantissa bytes are noise; blosc2 compresses each byte plane on its own (split mode).
"""

from __future__ import annotations

import threading
import zlib
from typing import Any

import lz4.block
import zstandard

from wiiide.codecs.base import Buffer, Codec
from wiiide.codecs.chunked import decode_bytes, encode_bytes
from wiiide.errors import ProtocolError

_local = threading.local()  # zstd (de)compressor objects are not thread-safe: one per thread


class ByteCodec(Codec):
    """A lossless codec on bytes: a message is its tensors' bytes joined, in parallel chunks when large.

    Subclasses implement `encode`/`decode`; any dtype is accepted (`supports` is always true).
    """

    def encode_message(self, arrays, names, stream="", pool=None):
        """The arrays' bytes encoded whole or in chunks on `pool` (`wiiide.codecs.chunked.encode_bytes`)."""
        return encode_bytes(self, arrays, pool)

    def decode_message(self, wire, raw_nbytes, params, specs, pool=None):
        """Exactly `raw_nbytes` bytes; raises `ProtocolError` as `wiiide.codecs.chunked.decode_bytes` does."""
        return decode_bytes(self, wire, raw_nbytes, params, pool)


class ZlibCodec(ByteCodec):
    """zlib (DEFLATE) at a level 1-9, as in the seeds. About 25 MB/s at level 1 on fp32 gradients here."""

    wire_id = "zlib"
    releases_gil = True  # CPython's zlib releases the GIL for inputs over 5 KiB

    def __init__(self, level: int = 6) -> None:
        if not 1 <= level <= 9:
            raise ValueError(f"zlib level must be 1..9, got {level}")
        self.level = level

    @property
    def name(self) -> str:
        """``zlib-<level>``."""
        return f"zlib-{self.level}"

    def encode(self, raw: Buffer, itemsize: int = 1) -> Buffer:
        """DEFLATE (zlib container) of `raw` at this level; `itemsize` is not used."""
        return zlib.compress(raw, self.level)

    def decode(self, wire: Buffer, raw_nbytes: int) -> Buffer:
        """Inflate to exactly `raw_nbytes` bytes (bounded: never more than one byte beyond).

        Raises:
            ProtocolError: a corrupt stream, another size than declared, or bytes after the stream's end.
        """
        decompressor = zlib.decompressobj()
        try:
            # max_length bounds the output: one byte more than declared reveals an oversized payload.
            out = decompressor.decompress(wire, raw_nbytes + 1)
        except zlib.error as exc:
            raise ProtocolError(f"codec 'zlib': corrupt payload: {exc}") from None
        if len(out) != raw_nbytes or not decompressor.eof or decompressor.unconsumed_tail:
            raise ProtocolError(
                f"codec 'zlib': payload does not decompress to the declared {raw_nbytes} bytes "
                f"(got {len(out)}{'+' if decompressor.unconsumed_tail else ''}, "
                f"stream {'complete' if decompressor.eof else 'truncated'})"
            )
        if decompressor.unused_data:
            raise ProtocolError(f"codec 'zlib': {len(decompressor.unused_data)} bytes after the end of the stream")
        return out


class ZstdCodec(ByteCodec):
    """Zstandard at a level 1-22 (``zstandard`` package). Frames always carry their content size."""

    wire_id = "zstd"
    releases_gil = True

    def __init__(self, level: int = 1) -> None:
        if not 1 <= level <= 22:
            raise ValueError(f"zstd level must be 1..22, got {level}")
        self.level = level

    @property
    def name(self) -> str:
        """``zstd-<level>``."""
        return f"zstd-{self.level}"

    def encode(self, raw: Buffer, itemsize: int = 1) -> Buffer:
        """One Zstandard frame with its content size (a compressor per thread and level)."""
        cache = _local.__dict__.setdefault("zstd_c", {})
        compressor = cache.get(self.level)
        if compressor is None:
            compressor = cache[self.level] = zstandard.ZstdCompressor(level=self.level, write_content_size=True)
        return compressor.compress(raw)

    def decode(self, wire: Buffer, raw_nbytes: int) -> Buffer:
        """Exactly `raw_nbytes` bytes; the frame's own content size is checked before decoding.

        Raises:
            ProtocolError: a corrupt frame or one declaring another size than the header.
        """
        try:
            declared = zstandard.frame_content_size(wire)
        except zstandard.ZstdError as exc:
            raise ProtocolError(f"codec 'zstd': corrupt payload: {exc}") from None
        if declared != raw_nbytes:  # -1: a frame without its size, which this encoder never writes
            raise ProtocolError(f"codec 'zstd': frame declares {declared} bytes but the header declares {raw_nbytes}")
        if raw_nbytes == 0:
            return b""
        decompressor = _local.__dict__.get("zstd_d")
        if decompressor is None:
            decompressor = _local.zstd_d = zstandard.ZstdDecompressor()
        try:
            # Output buffer of exactly the declared size; trailing bytes refused.
            out = decompressor.decompress(wire, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise ProtocolError(f"codec 'zstd': corrupt payload: {exc}") from None
        if len(out) != raw_nbytes:
            raise ProtocolError(f"codec 'zstd': payload decodes to {len(out)} bytes, header declares {raw_nbytes}")
        return out


class Lz4Codec(ByteCodec):
    """LZ4 block format (``lz4`` package), size stored in the header only."""

    wire_id = "lz4"
    releases_gil = True

    def encode(self, raw: Buffer, itemsize: int = 1) -> Buffer:
        """An LZ4 block without a stored size (the header's raw_nbytes bounds decoding)."""
        return lz4.block.compress(raw, store_size=False)

    def decode(self, wire: Buffer, raw_nbytes: int) -> Buffer:
        """Exactly `raw_nbytes` bytes (`uncompressed_size` bounds the output).

        Raises:
            ProtocolError: a corrupt block or one decoding to another size.
        """
        if raw_nbytes == 0:
            if len(wire) > 1:
                raise ProtocolError(f"codec 'lz4': {len(wire)} bytes of payload for 0 declared bytes")
            return b""
        try:
            # The destination holds exactly raw_nbytes: LZ4_decompress_safe fails rather than write past it,
            # and fails on bytes after the end of the block.
            out = lz4.block.decompress(wire, uncompressed_size=raw_nbytes)
        except lz4.block.LZ4BlockError as exc:
            raise ProtocolError(f"codec 'lz4': corrupt payload or larger than the declared {raw_nbytes} bytes: "
                                f"{exc}") from None
        if len(out) != raw_nbytes:
            raise ProtocolError(f"codec 'lz4': payload decodes to {len(out)} bytes, header declares {raw_nbytes}")
        return out


def _blosc2() -> Any:
    """Import blosc2 on first use (its import takes about 0.6 s) and let it release the GIL."""
    import blosc2

    blosc2.set_releasegil(True)
    return blosc2


class Blosc2Codec(ByteCodec):
    """Byte-shuffle + zstd or lz4 through blosc2 (c-blosc2), each byte plane compressed on its own.

    `level` is blosc's clevel 1-9. The shuffle groups bytes by their position in an element of
    `itemsize` bytes (4 for float32). One blosc2 chunk holds at most 2 GiB - overhead.
    """

    wire_id = "blosc2"
    releases_gil = True  # with blosc2.set_releasegil(True)
    MAX_CHUNK_BYTES = 2**31 - 64

    def __init__(self, inner: str = "zstd", level: int = 1) -> None:
        if inner not in ("zstd", "lz4"):
            raise ValueError(f"shuffle codec must wrap zstd or lz4, got {inner!r}")
        if not 1 <= level <= 9:
            raise ValueError(f"shuffle level must be 1..9, got {level}")
        self.inner, self.level = inner, level

    @property
    def name(self) -> str:
        """``shuffle-zstd`` / ``shuffle-lz4``, with ``-<level>`` when the level is not 1."""
        return f"shuffle-{self.inner}" + ("" if self.level == 1 else f"-{self.level}")

    def encode(self, raw: Buffer, itemsize: int = 1) -> Buffer:
        """One blosc2 chunk: byte-shuffle with typesize `itemsize` (bytes per element, clamped to 1..255),
        then zstd or lz4 per byte plane.

        Raises:
            ValueError: more than `MAX_CHUNK_BYTES` at once (callers split into chunks).
        """
        b2 = _blosc2()
        if memoryview(raw).nbytes > self.MAX_CHUNK_BYTES:
            raise ValueError(f"blosc2 encodes at most {self.MAX_CHUNK_BYTES} bytes at once; use chunks")
        return b2.compress2(raw, typesize=max(1, min(itemsize, 255)), clevel=self.level, nthreads=1,
                            filters=[b2.Filter.SHUFFLE], splitmode=b2.SplitMode.ALWAYS_SPLIT,
                            codec=b2.Codec.ZSTD if self.inner == "zstd" else b2.Codec.LZ4)

    def decode(self, wire: Buffer, raw_nbytes: int) -> Buffer:
        """Exactly `raw_nbytes` bytes; the chunk header's sizes are checked before decoding.

        Raises:
            ProtocolError: a corrupt chunk or one declaring another size than the header.
        """
        b2 = _blosc2()
        try:
            nbytes, cbytes, _ = b2.get_cbuffer_sizes(wire)
        except Exception as exc:  # blosc2 raises ValueError/RuntimeError for a bad header
            raise ProtocolError(f"codec 'blosc2': corrupt chunk header: {exc}") from None
        if nbytes != raw_nbytes or cbytes != len(wire):
            raise ProtocolError(f"codec 'blosc2': chunk declares {nbytes} bytes in {cbytes} but the header declares "
                                f"{raw_nbytes} in {len(wire)}")
        out = bytearray(raw_nbytes)
        if raw_nbytes == 0:
            return out
        try:
            b2.decompress2(wire, dst=out, nthreads=1)
        except Exception as exc:
            raise ProtocolError(f"codec 'blosc2': corrupt payload: {exc}") from None
        return out
