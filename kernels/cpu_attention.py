"""Paged attention on the CPU as compiled code: ``kernels/cpu_attention.cpp``, built on first use
with the machine's C++ compiler and loaded with ctypes (DESIGN.md §11).

Why: the torch reference (:func:`kernels.paged_attention.paged_attention_ref`) gathers every
request's KV into fixed tiles and converts it to float32 in each layer of each step, and runs a
dozen small ops around two batched products. On a 2-core CPU that made attention grow with
context far beyond the bytes it reads (SmolLM2 bf16, one decode step: 26 ms at 128 positions,
34 ms at 2,048). The compiled kernel reads the cache in place through the block table, one work
item per (query row, KV head), with every reduction in a fixed order, so it keeps the
reference's batch invariance by construction (see the .cpp file's header). Its results equal
the reference's up to float rounding (both accumulate in float32, float64 for a float64 model),
not bit for bit; the engine uses one of them for every step, so output with speculation still
equals output without it.

Build: ``g++ -O3 -march=native -ffp-contract=off -fopenmp -shared`` (``$CXX`` if set) into
``$SPECMESH_KERNEL_CACHE`` (default ``~/.cache/specmesh/kernels``), named by a hash of the
source, the flags, the compiler and the CPU's feature flags, so a shared home across machines
never loads code built for another CPU; written to a temporary name and renamed, so concurrent
processes can build at once. The OpenMP runtime is the one torch already loaded
(``libgomp.so.1``), so the kernel runs on torch's threads (``torch.get_num_threads()``).
Without a compiler, or with ``SPECMESH_CPU_ATTENTION=0``, :func:`available` is False and the
engine uses the torch reference.

Dtypes: float32, bfloat16, float64 (others: the reference).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from kernels.paged_attention_plan import PagedAttentionPlan, check_block_ids, resolve_plan

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared",
         "-std=c++17")
_ENTRIES = {torch.float32: "specmesh_paged_attention_f32",
            torch.bfloat16: "specmesh_paged_attention_bf16",
            torch.float64: "specmesh_paged_attention_f64"}
_ARGTYPES = [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] \
    + [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_double, ctypes.c_int]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None


def enabled() -> bool:
    """False when ``SPECMESH_CPU_ATTENTION=0`` (the engine then keeps the torch reference)."""
    return os.environ.get("SPECMESH_CPU_ATTENTION", "1") != "0"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def cache_dir() -> Path:
    """Where built kernels are kept (``$SPECMESH_KERNEL_CACHE``, else ``$XDG_CACHE_HOME`` or
    ``~/.cache``, then ``specmesh/kernels``)."""
    root = os.environ.get("SPECMESH_KERNEL_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specmesh" / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def has_compiler() -> bool:
    """Whether a C++ compiler is there to build the kernel (``$CXX``, g++ or c++)."""
    return _compiler() is not None


def build() -> Path:
    """Compile the kernel (once per source, flags, compiler and CPU) and return the library's
    path.

    Raises:
        RuntimeError: no C++ compiler, or the compiler failed (its output in the message).
    """
    cxx = _compiler()
    if not cxx:
        raise RuntimeError("no C++ compiler (g++ / $CXX) to build the CPU attention kernel")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version,
                                    platform.machine(), _cpu_flags()]).encode()).hexdigest()
    out = cache_dir() / f"cpu_attention-{key[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building the CPU attention kernel failed ({cxx}):\n"
                               f"{done.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first call; None when disabled or when it cannot be
    built (logged once, the engine then uses the torch reference)."""
    global _lib, _failed
    if not enabled():
        return None
    if _lib is not None or _failed is not None:
        return _lib
    with _lock:
        if _lib is None and _failed is None:
            try:
                lib = ctypes.CDLL(str(build()))
                for fn in _ENTRIES.values():
                    getattr(lib, fn).argtypes = _ARGTYPES
                    getattr(lib, fn).restype = None
                _lib = lib
            except (RuntimeError, OSError) as e:
                _failed = str(e)
                log.warning("CPU attention kernel unavailable, using the torch reference: %s", e)
    return _lib


def available() -> bool:
    """Whether :func:`paged_attention_cpu` can run (enabled, and built and loaded)."""
    return library() is not None


def supports(q: torch.Tensor) -> bool:
    """Whether the kernel takes this query tensor (CPU, a supported dtype) and is available."""
    return q.device.type == "cpu" and q.dtype in _ENTRIES and available()


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

    Shapes: ``q`` [T, H, D]; ``k_cache``/``v_cache`` [num_blocks, block_size, Hkv, D], all CPU
    tensors of one dtype (float32, bfloat16 or float64). Returns [T, H, D] in q's dtype.

    Raises:
        ValueError: see :func:`plan_paged_attention`; shapes or dtypes that do not match, a
            dtype the kernel lacks, a plan for another batch or block size, or a block id
            outside the cache (the compiled code reads through the ids unchecked).
        RuntimeError: the kernel is not available (:func:`available`).
    """
    if q.dtype not in _ENTRIES or q.device.type != "cpu":
        raise ValueError(f"the CPU attention kernel takes CPU {sorted(map(str, _ENTRIES))}, "
                         f"got {q.dtype} on {q.device}")
    lib = library()
    if lib is None:
        raise RuntimeError(f"the CPU attention kernel is not available: {_failed or 'disabled'}")
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
    getattr(lib, _ENTRIES[q.dtype])(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        tables.data_ptr(), tables.shape[1], plan.token_batch.data_ptr(),
        plan.token_visible.data_ptr(), _ptr(path), path.shape[1] if path is not None else 0,
        _ptr(start), t, h, hkv, d, block_size, float(scale), torch.get_num_threads())
    return out


__all__ = ["available", "build", "cache_dir", "enabled", "has_compiler", "library",
           "paged_attention_cpu", "supports"]
