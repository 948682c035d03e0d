"""Tensor <-> protocol Buffer conversion (bf16-safe, zero-copy on send)."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine.frames import buffer_to_tensor, tensor_to_buffer
from specmesh.protocol.messages import Buffer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64])
def test_round_trip(dtype):
    t = (torch.randn(3, 5, 7) * 100).to(dtype)
    buf = tensor_to_buffer(t)
    assert buf.dtype == str(dtype).removeprefix("torch.")
    assert buf.shape == (3, 5, 7) and len(buf.data) == buf.nbytes
    back = buffer_to_tensor(buf)
    assert back.dtype == dtype and torch.equal(back, t)
    # as it arrives from the wire: read-only bytes
    again = buffer_to_tensor(Buffer(dtype=buf.dtype, shape=buf.shape, data=bytes(buf.data)))
    assert torch.equal(again, t)


def test_non_contiguous_and_scalar_and_empty():
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, 1:4]
    assert torch.equal(buffer_to_tensor(tensor_to_buffer(t)), t)
    s = torch.tensor(3.5, dtype=torch.bfloat16)
    assert torch.equal(buffer_to_tensor(tensor_to_buffer(s)), s)
    e = torch.empty(0, 4, dtype=torch.float64)
    back = buffer_to_tensor(tensor_to_buffer(e))
    assert back.shape == (0, 4) and back.dtype == torch.float64


def test_send_side_is_zero_copy():
    t = torch.zeros(4, dtype=torch.float32)
    buf = tensor_to_buffer(t)
    t[1] = 2.0  # the buffer views the tensor's memory
    assert buffer_to_tensor(buf)[1].item() == 2.0
    assert isinstance(buf.data, memoryview) and buf.data.readonly


def test_writable_receive_buffer_is_shared():
    data = bytearray(16)
    t = buffer_to_tensor(Buffer(dtype="float32", shape=(4,), data=memoryview(data)))
    t[0] = 1.0
    assert data[:4] != bytearray(4)


def test_size_mismatch_and_unknown_dtype_raise():
    with pytest.raises(ValueError, match="bytes"):
        buffer_to_tensor(Buffer(dtype="float32", shape=(2, 3), data=bytes(20)))
    with pytest.raises(ValueError, match="dtype"):
        buffer_to_tensor(Buffer(dtype="complex64", shape=(1,), data=bytes(8)))
    with pytest.raises(ValueError):
        tensor_to_buffer(torch.zeros(2, dtype=torch.complex64))
