"""The WIIIIIDE frame format: length-prefixed frames with a JSON header and raw tensor bytes.

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

This module holds the format's constants and dtype whitelist; it imports no codec (the codecs and their
policy build on it).
"""

from __future__ import annotations

import struct

import numpy as np

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
# 16-bit patterns in a uint16 array; `wiiide.wire.tensors` converts to and from torch.
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


class DeadlineExceeded(TimeoutError):
    """A read's absolute deadline passed before the frame was complete (a `TimeoutError`, hence an
    OSError: callers that treat a socket timeout as a lost peer treat this one alike)."""



def byte_view(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, any shape (also zero-dim or empty), as a flat memoryview (no copy).

    Raises:
        ValueError: a non-contiguous array (numpy refuses the reshape view's buffer).
    """
    try:
        return memoryview(array).cast("B")  # any C-contiguous array without a zero in its shape; no reshape
    except (TypeError, ValueError):
        return memoryview(array.reshape(-1)).cast("B")
