"""wiiide.wire.tensors: torch <-> wire conversions (no pickle; bfloat16 as 16-bit patterns)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wiiide.wire.tensors import from_wire, to_wire
from wiiide.wire.format import DTYPES
from wiiide.wire.messages import WireTensor

TORCH_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                torch.int16, torch.int8, torch.uint8, torch.bool]


def test_every_wire_dtype_has_a_torch_dtype():
    names = {to_wire("t", torch.zeros(1, dtype=dt)).dtype for dt in TORCH_DTYPES}
    assert names == set(DTYPES)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_roundtrip_in_memory(dtype):
    torch.manual_seed(1)
    t = (torch.randn(3, 5) * 40).to(dtype)
    wt = to_wire("t", t)
    assert wt.array.dtype == DTYPES[wt.dtype]
    assert wt.array.shape == (3, 5)
    back = from_wire(wt)
    assert back.dtype == dtype and torch.equal(back, t)


def test_contiguous_tensor_shares_memory():
    t = torch.arange(10, dtype=torch.float32)
    wt = to_wire("t", t)
    t[0] = 42.0
    assert wt.array[0] == 42.0


def test_bfloat16_shares_memory_as_uint16():
    t = torch.ones(4, dtype=torch.bfloat16)
    wt = to_wire("b", t)
    assert wt.array.dtype == np.uint16
    assert wt.array.tolist() == [0x3F80] * 4  # bfloat16 1.0 is 0x3f80
    t[1] = 2.0
    assert wt.array[1] == 0x4000


def test_non_contiguous_tensor_is_copied_in_logical_order():
    t = torch.arange(6, dtype=torch.int32).reshape(2, 3).t()
    wt = to_wire("t", t)
    assert wt.array.flags.c_contiguous
    assert wt.array.tolist() == t.tolist()


def test_tensor_requiring_grad_is_detached():
    t = torch.ones(3, requires_grad=True)
    back = from_wire(to_wire("t", t))
    assert not back.requires_grad and back.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16 if hasattr(torch, "uint16") else torch.complex128])
def test_unsupported_dtype_rejected(dtype):
    with pytest.raises(ValueError, match="whitelist"):
        to_wire("c", torch.zeros(2, dtype=dtype))


def test_from_wire_copy_semantics():
    arr = np.arange(4, dtype=np.float32)
    wt = WireTensor("a", arr)
    copied = from_wire(wt)
    shared = from_wire(wt, copy=False)
    arr[0] = 9.0
    assert copied[0].item() == 0.0
    assert shared[0].item() == 9.0


def test_from_wire_read_only_array_is_copied_even_without_copy():
    arr = np.frombuffer(np.arange(4, dtype=np.float32).tobytes(), dtype=np.float32)  # read-only
    assert not arr.flags.writeable
    t = from_wire(WireTensor("a", arr), copy=False)
    t[0] = 5.0  # must not fail: the tensor owns a writable copy
    assert arr[0] == 0.0 and t.tolist() == [5.0, 1.0, 2.0, 3.0]
