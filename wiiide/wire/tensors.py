"""Conversions between torch tensors and the wire's numpy arrays (`wiiide.wire.messages.WireTensor`).

No pickle: a tensor becomes its dtype name, shape and raw bytes. bfloat16, which numpy lacks, travels
as its 16-bit patterns in a uint16 array (seed 004, "Handle special types (bfloat16)").
"""

from __future__ import annotations

import numpy as np
import torch

from wiiide.wire.messages import WireTensor

_TORCH_TO_WIRE = {
    torch.float64: "float64", torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8",
    torch.uint8: "uint8", torch.bool: "bool",
}
_WIRE_TO_TORCH = {v: k for k, v in _TORCH_TO_WIRE.items()}


def to_wire(name: str, tensor: torch.Tensor) -> WireTensor:
    """A CPU tensor -> WireTensor sharing its memory when it is already contiguous.

    Raises:
        ValueError: a dtype outside the wire whitelist (e.g. complex64).
    """
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    try:
        dtype = _TORCH_TO_WIRE[tensor.dtype]
    except KeyError:
        raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} is not in the wire whitelist") from None
    if dtype == "bfloat16":
        array = tensor.view(torch.int16).numpy().view(np.uint16)
    else:
        array = tensor.numpy()
    return WireTensor(name, array, dtype)


def from_wire(wt: WireTensor, copy: bool = True) -> torch.Tensor:
    """WireTensor -> torch tensor of the same dtype and shape.

    With ``copy=False`` the tensor shares the frame buffer (it must then be writable and outlive it).
    """
    array = wt.array.copy() if copy or not wt.array.flags.writeable else wt.array
    if wt.dtype == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
