"""The codec interface: `Codec`, the identity `NoCodec`, and the byte helpers every codec shares.

A codec turns the tensors of one message into the bytes that travel, and back (see the table in
`wiiide.codecs`). This module imports no codec implementation, so the implementations
(`wiiide.codecs.lossless`, `wiiide.codecs.lossy`), the parallel chunking (`wiiide.codecs.chunked`)
and the registry (`wiiide.codecs.registry`) can all import it without a cycle.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import numpy as np

from wiiide.errors import ProtocolError
from wiiide.wire.format import byte_view

Buffer = bytes | bytearray | memoryview
# (wire dtype name, element count) of each tensor a header declares, in order.
TensorSpecs = Sequence[tuple[str, int]]


class Codec:
    """Base class of every codec. Subclasses set `wire_id` and `lossless`.

    Byte codecs (`wiiide.codecs.lossless.ByteCodec`) implement `encode`/`decode` on bytes; lossy ones
    override `encode_message`/`decode_message`, which see the tensors. Instances may keep state
    (top-k's residual), so one instance serves one sender.
    """

    wire_id: ClassVar[str] = ""
    lossless: ClassVar[bool] = True
    # True when encode/decode release the GIL, so chunks of one payload can run on a thread pool.
    releases_gil: ClassVar[bool] = False

    @property
    def name(self) -> str:
        """Name used in configs and metrics, e.g. ``zlib-1``; the wire id if the codec has no level."""
        return self.wire_id

    def supports(self, arrays: Sequence[np.ndarray]) -> bool:
        """Whether this codec can encode a message holding these arrays (lossless: any dtype)."""
        return True

    # -- byte codecs --------------------------------------------------------------------------
    def encode(self, raw: Buffer, itemsize: int = 1) -> Buffer:
        """Raw bytes -> wire bytes. `itemsize` (bytes per element) lets shuffling codecs group bytes.

        Raises:
            NotImplementedError: a codec that only encodes whole messages (the lossy ones).
        """
        raise NotImplementedError(f"codec {self.wire_id!r} does not encode bare bytes")

    def decode(self, wire: Buffer, raw_nbytes: int) -> Buffer:
        """Wire bytes -> exactly `raw_nbytes` raw bytes.

        Raises:
            ProtocolError: the payload is corrupt or decodes to a different size than declared.
            NotImplementedError: a codec that only decodes whole messages (the lossy ones).
        """
        raise NotImplementedError(f"codec {self.wire_id!r} does not decode bare bytes")

    # -- whole messages -------------------------------------------------------------------------
    def encode_message(self, arrays: Sequence[np.ndarray], names: Sequence[str], stream: str = "",
                       pool: Any = None) -> tuple[list[Buffer], dict[str, Any]]:
        """The tensors of one message (C-contiguous arrays, any shape) -> (payload buffers in order, codec_params).

        `stream` names the message stream (e.g. ``gradients``) for codecs that keep state per tensor.
        `pool` (a `wiiide.codecs.chunked.CodecPool`, typed `Any` because chunked imports
        this module) lets large payloads be encoded in parallel chunks.

        Raises:
            ValueError: the codec cannot encode these arrays (a lossy codec given a non-float32 tensor).
        """
        raise NotImplementedError

    def encode_message_values(self, arrays: Sequence[np.ndarray], names: Sequence[str], stream: str = "",
                              pool: Any = None) -> tuple[list[Buffer], dict[str, Any], np.ndarray | None]:
        """`encode_message`, and the values the receiver will decode when the codec has them at hand:
        a new float32 array (flat, every tensor in order), equal element for element to what
        `decode_message` gives (a zero may be -0.0 here), or None (here: a codec that would have to
        decode its own payload to know them).

        Error feedback needs them (`wiiide.server.pace.feedback`); the blockwise quantizers compute them from
        their codes in one pass instead of unpacking the payload again.

        Raises:
            ValueError: as `encode_message`.
        """
        parts, params = self.encode_message(arrays, names, stream, pool)
        return parts, params, None

    def decode_message(self, wire: memoryview, raw_nbytes: int, params: dict[str, Any], specs: TensorSpecs,
                       pool: Any = None) -> Buffer:
        """Payload -> exactly `raw_nbytes` raw bytes of the tensors `specs` declares.

        Raises:
            ProtocolError: bad `params`, a corrupt payload, or one that decodes to another size.
        """
        raise NotImplementedError


class NoCodec(Codec):
    """Identity: the payload is the raw bytes (no copy), any dtype."""

    wire_id = "none"

    def encode(self, raw: Buffer, itemsize: int = 1) -> Buffer:
        """The raw bytes themselves (no copy)."""
        return raw

    def decode(self, wire: Buffer, raw_nbytes: int) -> Buffer:
        """The wire bytes themselves; raises `ProtocolError` unless there are exactly `raw_nbytes`."""
        if len(wire) != raw_nbytes:
            raise ProtocolError(
                f"codec 'none': payload is {len(wire)} bytes but the header declares {raw_nbytes}"
            )
        return wire

    def encode_message(self, arrays, names, stream="", pool=None):
        """The tensors' own buffers, for sendmsg: no join, no copy; no codec_params."""
        return [byte_view(a) for a in arrays if a.nbytes], {}

    def decode_message(self, wire, raw_nbytes, params, specs, pool=None):
        """The payload itself; raises `ProtocolError` on any codec_params or a size mismatch."""
        check_params("none", params, set())
        return self.decode(wire, raw_nbytes)


def check_params(wire_id: str, params: Any, allowed: set[str], required: set[str] = frozenset()) -> None:
    """Check a header's ``codec_params`` against the keys codec `wire_id` knows.

    Raises:
        ProtocolError: `params` is not a dict, has a key outside `allowed`, or lacks one of `required`.
    """
    if not isinstance(params, dict):
        raise ProtocolError(f"codec {wire_id!r}: codec_params must be an object")
    unknown = set(params) - set(allowed)
    if unknown:
        raise ProtocolError(f"codec {wire_id!r}: unknown codec_params {sorted(unknown)[:5]}")
    missing = set(required) - set(params)
    if missing:
        raise ProtocolError(f"codec {wire_id!r}: codec_params lacks {sorted(missing)}")
