"""A decoder layer's small float32 ops as compiled CPU code: RMSNorm fused with the residual add
before it, and RoPE of q / k (``kernels/cpu_layer_ops.cpp``, built on first use as
:mod:`kernels.cpu_build` builds the other CPU kernels).

Why: in torch each is five to ten dispatches of a few microseconds (RMSNorm: pow, mean, add,
rsqrt, mul, mul; RoPE: two slices, neg, cat, two muls, add), which on a one-token SmolLM2
float32 step cost more than its attention. Each call here is one ctypes call.

Numerics: each row is computed alone in one fixed order (row-invariant, so the verify forward
stays batch-invariant: see the .cpp header). RoPE is the same bits as the torch expression
``x * cos + rotate_half(x) * sin``; RMSNorm differs from torch only in the summation order of
its mean of squares (rounding).

Without a compiler :func:`available` is False and the engine keeps the torch ops; whether it
uses these at all is the ``layer_ops`` choice of its CPU backend (engine/backend.py).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from specmesh.kernels.cpu_build import CpuKernel

_P, _L, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
KERNEL = CpuKernel(
    Path(__file__).with_name("cpu_layer_ops.cpp"), "the CPU layer-ops kernel",
    "keeping the torch ops",
    {"specmesh_add_rms_norm_f32": ([_P, _L, _P, _L, _P, _L, _P, _P, _L, _L, ctypes.c_float, _I],
                                   _I),
     "specmesh_rope_f32": ([_P, _L, _P, _P, _P, _L, _L, _L, _I], _I),
     "specmesh_silu_mul_f32": ([_P, _L, _P, _L, _L, _I], _I),
     # engine/compiled_stack.py
     "specmesh_decoder_layers_f32": ([_P, _L, _L, _P, _L, _P, _P, _P, _P, _L, _L, _L, _L,
                                      ctypes.c_float, ctypes.c_double, _P, _P, _P, _P, _I, _I],
                                     _I),
     "specmesh_f32_to_kv16": ([_P, _P, _L, _I], _I)})

#: KV storage kinds of the compiled code (``kv_kind`` of ``specmesh_decoder_layers_f32``)
KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def available() -> bool:
    """Whether the compiled ops are built and loaded (a compiler that built them)."""
    return KERNEL.library() is not None


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the compiled ops take these tensors: all float32 on the CPU, none needing a
    gradient (autograd keeps the torch ops), and the kernel available."""
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t.dtype is not torch.float32 or not t.is_cpu or (grad and t.requires_grad):
            return False
    return (KERNEL.lib or KERNEL.library()) is not None


def _rows(x: torch.Tensor, width: int, name: str) -> torch.Tensor:
    """x as [M, width] with unit stride along the row (a copy only when it is not)."""
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"{name} must be [M, {width}], got {tuple(x.shape)}")
    return x if x.stride(1) == 1 else x.contiguous()


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``h = x + residual`` (or of ``x``): returns ``(h, weight * h / rms(h))``,
    both [M, H] float32. ``weight`` [H]; ``eps`` is added to the mean of squares
    (transformers' LlamaRMSNorm, arXiv 1910.07467).

    Raises:
        ValueError: shapes that do not match, or a tensor the ops do not take (see
            :func:`applies`).
        RuntimeError: the kernel is not available or failed.
    """
    tensors = (x, weight) if residual is None else (x, weight, residual)
    lib = KERNEL.lib or KERNEL.library()
    if lib is None:
        raise RuntimeError(f"the CPU layer-ops kernel is not available: {KERNEL.failed}")
    if any(t.dtype is not torch.float32 or not t.is_cpu for t in tensors):
        raise ValueError("add_rms_norm takes float32 CPU tensors")
    hidden = weight.shape[-1]
    if weight.dim() != 1:
        raise ValueError(f"weight must be [H], got {tuple(weight.shape)}")
    x = _rows(x, hidden, "x")
    weight = weight.contiguous()
    m = x.shape[0]
    y = torch.empty(m, hidden)
    if residual is None:
        h = x
        rc = lib.specmesh_add_rms_norm_f32(x.data_ptr(), x.stride(0), None, 0, None, 0,
                                           weight.data_ptr(), y.data_ptr(), m, hidden, eps,
                                           torch.get_num_threads())
    else:
        residual = _rows(residual, hidden, "residual")
        if residual.shape[0] != m:
            raise ValueError(f"residual has {residual.shape[0]} rows, x has {m}")
        h = torch.empty(m, hidden)
        rc = lib.specmesh_add_rms_norm_f32(x.data_ptr(), x.stride(0), residual.data_ptr(),
                                           residual.stride(0), h.data_ptr(), hidden,
                                           weight.data_ptr(), y.data_ptr(), m, hidden, eps,
                                           torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"the CPU layer-ops kernel failed (code {rc})")
    return h, y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (arXiv 2104.09864, transformers' rotate_half form) of ``x`` [T, heads, D] (any row
    stride; heads and D contiguous, as a column slice of a fused q/k/v product) with ``cos`` /
    ``sin`` [T, 1, D] or [T, D]: returns a new contiguous [T, heads, D] float32 tensor equal
    bit for bit to ``x * cos + rotate_half(x) * sin``.

    Raises:
        ValueError: shapes that do not match, an odd D, or not float32 CPU tensors.
        RuntimeError: the kernel is not available or failed.
    """
    lib = KERNEL.lib or KERNEL.library()
    if lib is None:
        raise RuntimeError(f"the CPU layer-ops kernel is not available: {KERNEL.failed}")
    if any(t.dtype is not torch.float32 or not t.is_cpu for t in (x, cos, sin)):
        raise ValueError("rope takes float32 CPU tensors")
    if x.dim() != 3 or x.shape[2] % 2:
        raise ValueError(f"x must be [T, heads, D] with an even D, got {tuple(x.shape)}")
    t, heads, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d:
        x = x.contiguous()
    cos, sin = (c.reshape(t, d).contiguous() if c.numel() == t * d else None for c in (cos, sin))
    if cos is None or sin is None:
        raise ValueError(f"cos / sin must hold [T={t}, D={d}] values")
    out = torch.empty(t, heads, d)
    rc = lib.specmesh_rope_f32(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(),
                               out.data_ptr(), t, heads, d, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"the CPU layer-ops kernel failed (code {rc})")
    return out


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [M, 2 * inter] float32 (gate in the first ``inter``
    columns, as the fused gate/up product returns them; any row stride): returns [M, inter].
    SiLU (arXiv 1702.03118) as ``g / (1 + exp(-g))`` with the kernel's own exp (within 2 ulp
    of torch's ``F.silu``, the same bits in every row).

    Raises:
        ValueError: not a float32 CPU [M, 2 * inter] tensor.
        RuntimeError: the kernel is not available or failed.
    """
    lib = KERNEL.lib or KERNEL.library()
    if lib is None:
        raise RuntimeError(f"the CPU layer-ops kernel is not available: {KERNEL.failed}")
    if gate_up.dtype is not torch.float32 or not gate_up.is_cpu:
        raise ValueError("silu_mul takes a float32 CPU tensor")
    gate_up = _rows(gate_up, 2 * inter, "gate_up")
    m = gate_up.shape[0]
    y = torch.empty(m, inter)
    rc = lib.specmesh_silu_mul_f32(gate_up.data_ptr(), gate_up.stride(0), y.data_ptr(), m, inter,
                                   torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"the CPU layer-ops kernel failed (code {rc})")
    return y


def to_kv16(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32, CPU) rounded to ``dtype`` (bfloat16 or float16) by the compiled
    conversion the compiled decoder layers write a 16-bit KV cache with
    (engine/compiled_stack.py): equal bit for bit to ``x.to(dtype)`` for every non-NaN value
    (round to nearest, ties to even; float16 subnormals and overflow to infinity). Returns a
    new contiguous tensor of x's shape.

    Raises:
        ValueError: not a float32 CPU tensor, or another dtype.
        RuntimeError: the kernel is not available or failed.
    """
    lib = KERNEL.lib or KERNEL.library()
    if lib is None:
        raise RuntimeError(f"the CPU layer-ops kernel is not available: {KERNEL.failed or 'off'}")
    if x.dtype is not torch.float32 or not x.is_cpu:
        raise ValueError("to_kv16 takes a float32 CPU tensor")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"to_kv16 rounds to bfloat16 or float16, got {dtype}")
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=dtype)
    if lib.specmesh_f32_to_kv16(x.data_ptr(), out.data_ptr(), x.numel(), KV_KINDS[dtype]) != 0:
        raise RuntimeError("the CPU layer-ops kernel failed")
    return out


__all__ = ["KERNEL", "KV_KINDS", "add_rms_norm", "applies", "available", "rope", "silu_mul",
           "to_kv16"]
