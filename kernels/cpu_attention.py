"""Paged attention on the CPU as compiled code: ``kernels/cpu_attention.cpp``, built on first use
with the machine's C++ compiler and loaded with ctypes (docs/architecture.md, 'Running on CPU').

Why: the torch reference (:func:`kernels.paged_attention.paged_attention_ref`) gathers every
request's KV into fixed tiles and converts it to float32 in each layer of each step, and runs a
dozen small ops around two batched products. On a small CPU that made attention grow with
context far beyond the bytes it reads (docs/benchmarks.md, 'Attention'). The compiled kernel
reads the cache in place through the block table, one work item per (query row, KV head), with every
reduction in a fixed order, so it keeps the reference's batch invariance by construction (see the
.cpp file's header). Its results equal the reference's up to float rounding (both accumulate in
float32, float64 for a float64 model), not bit for bit; the engine uses one of them for every step,
so output with speculation still equals output without it.

Build: see :mod:`kernels.cpu_build` (without a compiler :func:`available` is False and the
engine uses the torch reference). Whether the engine uses it is the ``cpu_attention`` choice of
its CPU backend (engine/backend.py), passed to :func:`kernels.paged_attention.paged_attention`.

Dtypes (q and out; the cache): float32, bfloat16, float64 over a cache of the same dtype, and
float32 over a bfloat16 or float16 cache (``--kv-cache-dtype``: 16-bit K/V widened to float32 as
they are read, every product and sum in float32); others: the reference.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from specmesh.kernels.cpu_build import CpuKernel, cache_dir, compiler
from specmesh.kernels.paged_attention_plan import PagedAttentionPlan, check_block_ids, resolve_plan

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
#: (q dtype, cache dtype) -> the kernel's entry point
_ENTRIES = {(torch.float32, torch.float32): "specmesh_paged_attention_f32",
            (torch.bfloat16, torch.bfloat16): "specmesh_paged_attention_bf16",
            (torch.float64, torch.float64): "specmesh_paged_attention_f64",
            (torch.float32, torch.bfloat16): "specmesh_paged_attention_f32_kv_bf16",
            (torch.float32, torch.float16): "specmesh_paged_attention_f32_kv_f16"}
_ARGTYPES = [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] \
    + [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_double, ctypes.c_int]
KERNEL = CpuKernel(SOURCE, "the CPU attention kernel", "using the torch reference",
                   {name: (_ARGTYPES, None) for name in _ENTRIES.values()})


def has_compiler() -> bool:
    """Whether a C++ compiler is there to build the kernel (``$CXX``, g++ or c++)."""
    return compiler() is not None


def build() -> Path:
    """Compile the kernel (once per source, flags, compiler and CPU) and return the library's
    path.

    Raises:
        RuntimeError: no C++ compiler, or the compiler failed (its output in the message).
    """
    return KERNEL.build()


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first call; None when it cannot be built (logged
    once, the engine then uses the torch reference)."""
    return KERNEL.library()


def available() -> bool:
    """Whether :func:`paged_attention_cpu` can run (built and loaded)."""
    return library() is not None


def supports(q: torch.Tensor, *, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether the kernel takes this query tensor (CPU, a supported dtype) over a cache of
    ``kv_dtype`` (None: q's dtype) and is available."""
    key = (q.dtype, q.dtype if kv_dtype is None else kv_dtype)
    return q.device.type == "cpu" and key in _ENTRIES and available()


def entry_name(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> str:
    """The library's entry point for queries of ``q_dtype`` over a cache of ``kv_dtype`` (what
    engine/compiled_stack.py calls through a pointer).

    Raises:
        ValueError: a pair the kernel lacks.
    """
    try:
        return _ENTRIES[(q_dtype, kv_dtype)]
    except KeyError:
        raise ValueError(f"the CPU attention kernel has no entry for {q_dtype} queries over a "
                         f"{kv_dtype} cache") from None


def _ptr(x: torch.Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor | list[list[int]],
    query_lens: torch.Tensor | list[int],
    kv_lens: torch.Tensor | list[int],
    scale: float,
    plan: PagedAttentionPlan | None = None,
    tree_masks: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Attention of every query row over its visible cached positions, with the layout and
    masks of :mod:`kernels.paged_attention_plan` (chains and token trees); the signature of
    :func:`kernels.paged_attention.paged_attention_ref` (``plan`` saves rebuilding the index
    tensors in every layer; ``tree_masks`` is used only to build one when none is given).

    Shapes: ``q`` [T, H, D]; ``k_cache``/``v_cache`` [num_blocks, block_size, Hkv, D], CPU
    tensors of one dtype (float32, bfloat16 or float64), or float32 queries over a bfloat16 or
    float16 cache. Returns [T, H, D] in q's dtype.

    Raises:
        ValueError: see :func:`plan_paged_attention`; shapes or dtypes that do not match, a
            dtype the kernel lacks, a plan for another batch or block size, or a block id
            outside the cache (the compiled code reads through the ids unchecked).
        RuntimeError: the kernel is not available (:func:`available`).
    """
    if (q.dtype, k_cache.dtype) not in _ENTRIES or q.device.type != "cpu":
        pairs = sorted(f"{a}/{b}" for a, b in _ENTRIES)
        raise ValueError(f"the CPU attention kernel takes CPU (q / cache dtype) {pairs}, "
                         f"got {q.dtype} / {k_cache.dtype} on {q.device}")
    lib = library()
    if lib is None:
        raise RuntimeError(f"the CPU attention kernel is not available: "
                           f"{KERNEL.failed}")
    plan = resolve_plan(q, k_cache, v_cache, block_tables, query_lens, kv_lens, plan,
                        tree_masks)
    check_block_ids(plan, k_cache.shape[0])
    t, h, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    tables = plan.block_tables.contiguous()
    q = q.contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    path = plan.token_path.contiguous() if plan.token_path is not None else None
    start = plan.token_chunk_start.contiguous() if plan.token_chunk_start is not None else None
    out = torch.empty_like(q)
    getattr(lib, _ENTRIES[(q.dtype, k_cache.dtype)])(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        tables.data_ptr(), tables.shape[1], plan.token_batch.data_ptr(),
        plan.token_visible.data_ptr(), _ptr(path), path.shape[1] if path is not None else 0,
        _ptr(start), t, h, hkv, d, block_size, float(scale), torch.get_num_threads())
    return out


__all__ = ["available", "build", "cache_dir", "entry_name", "has_compiler", "library",
           "paged_attention_cpu", "supports"]
