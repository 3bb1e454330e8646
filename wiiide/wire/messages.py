"""The wire's values: a named tensor (`WireTensor`), a decoded message (`Message`), an encoded frame
ready to send (`Frame`). No codec is imported here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from wiiide.errors import ProtocolError
from wiiide.wire.format import _NUMPY_TO_WIRE, DTYPES


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
