"""torch.Tensor <-> protocol Buffer (dtype name, shape, raw bytes); bf16-safe, no numpy."""

from __future__ import annotations

import ctypes

import torch

from specmesh.engine.dtypes import dtype_name, torch_dtype
from specmesh.protocol.messages import Buffer, buffer_nbytes


def tensor_to_buffer(t: torch.Tensor) -> Buffer:
    """Wrap a tensor's bytes (C order) in a :class:`Buffer` without copying a contiguous CPU tensor.

    ``data`` is a read-only memoryview that keeps the tensor's storage alive; a non-contiguous
    or non-CPU tensor is first copied to a contiguous CPU tensor.

    Raises:
        ValueError: a dtype with no wire name.
    """
    name = dtype_name(t.dtype)
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    if flat.numel() == 0:
        return Buffer(dtype=name, shape=tuple(t.shape), data=b"")
    raw = (ctypes.c_ubyte * flat.numel()).from_address(flat.data_ptr())
    raw._keepalive = flat  # the memoryview holds ``raw``, which holds the tensor
    return Buffer(dtype=name, shape=tuple(t.shape), data=memoryview(raw).cast("B").toreadonly())


def buffer_to_tensor(buf: Buffer, device: str | torch.device = "cpu") -> torch.Tensor:
    """Tensor of ``buf.shape`` and ``buf.dtype`` over ``buf.data``.

    A writable buffer is shared (zero-copy on CPU); a read-only one (bytes, a read-only
    memoryview) is copied once into a bytearray first.

    Raises:
        ValueError: unknown dtype, a negative dimension, or ``len(data)`` != prod(shape) * itemsize.
    """
    expected = buffer_nbytes(buf.dtype, tuple(buf.shape))
    dtype = torch_dtype(buf.dtype)
    shape = tuple(buf.shape)
    view = memoryview(buf.data).cast("B")
    if view.nbytes != expected:
        raise ValueError(
            f"buffer holds {view.nbytes} bytes, {buf.dtype}{list(shape)} needs {expected}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    if view.readonly:
        view = bytearray(view)
    t = torch.frombuffer(view, dtype=torch.uint8).view(dtype).reshape(shape)
    return t.to(device)
