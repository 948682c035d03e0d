"""Linear products on GGUF block-quantized weights (Q4_1, Q8_0), dequantized on the fly in
float32 by compiled CPU code (``kernels/gguf_matmul.cpp``, built as :mod:`kernels.cpu_build`
says), with a torch reference.

Why: a decode step of a small model is bound by the bytes of weight it reads. SmolLM2-135M ships as
a Q4_1 GGUF (token embedding Q8_0); dequantized to float32 its weights are 540 MB per step, most of
a one-token step's time on a CPU without bf16 products (docs/benchmarks.md, 'Compiled kernels').
Held in their GGUF blocks they are about 100 MB, and each block is expanded to float32 in registers
as the product reads it (the approach of llama.cpp's ggml and vLLM's GGUF kernels).

Exactness: every weight the kernel uses equals the float32 weight transformers' GGUF loader
produces (gguf-py's dequantization: ``d * q + m`` for Q4_1, ``d * q`` for Q8_0, with the f16
``d`` and ``m`` widened to float32), bit for bit; :meth:`BlockWeight.dequantize` computes the
same values in torch. Only the accumulation order differs from a dense float32 GEMM, as it
differs between any two BLAS libraries. Each output element is one fixed-order accumulation,
whatever the number of rows, the tiling or the threads, so the products are row-invariant
(batch-invariant) by construction, as the verify forward needs
(docs/architecture.md, 'Batch invariance').

Layout of a :class:`BlockWeight` (blocks of 32 along the input dim K; KB = K / 32):
``scale`` [N, KB] float32, ``minv`` [N, KB] float32 (Q4_1 only), ``qs`` [N, KB, 16] uint8 (Q4_1:
byte j holds q[j] in its low and q[j + 16] in its high nibble, as GGUF stores it) or
[N, KB, 32] int8 (Q8_0).

Whether the engine uses it is the ``gguf_matmul`` choice of its CPU backend (engine/backend.py):
off, the engine keeps dense float32 weights.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from specmesh.kernels.cpu_build import CpuKernel

BLOCK = 32
#: format -> (kernel code, bytes per GGUF block, quant bytes per block)
FORMATS = {"Q4_1": (0, 20, 16), "Q8_0": (1, 34, 32)}
_P, _I = ctypes.c_void_p, ctypes.c_int
KERNEL = CpuKernel(
    Path(__file__).with_name("gguf_matmul.cpp"), "the GGUF matmul kernel",
    "keeping dense float32 weights",
    {"specmesh_q4_1_matmul": ([_P, _I, _I, _P, _P, _P, _I, _P, _I], _I),
     "specmesh_q8_0_matmul": ([_P, _I, _I, _P, _P, _I, _P, _I], _I),
     "specmesh_gguf_dequant": ([_I, _P, _P, _P, _I, _I, _P], _I)})


def available() -> bool:
    """Whether the compiled kernel is built and loaded (a compiler, AVX2 + FMA)."""
    return KERNEL.library() is not None


@dataclass(frozen=True)
class BlockWeight:
    """A linear weight [N, K] kept in a GGUF block format (see the module docstring for the
    tensors' shapes). Rows are output features; blocks run along the input features."""

    fmt: str
    scale: torch.Tensor
    minv: torch.Tensor | None
    qs: torch.Tensor

    def __post_init__(self) -> None:  # what every product passes the kernel, computed once
        object.__setattr__(self, "out_features", self.scale.shape[0])
        object.__setattr__(self, "in_features", self.scale.shape[1] * BLOCK)
        object.__setattr__(self, "_ptrs", (self.scale.data_ptr(), 0 if self.minv is None
                                           else self.minv.data_ptr(), self.qs.data_ptr()))

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads for one product (scales, mins and quants)."""
        return sum(t.numel() * t.element_size() for t in (self.scale, self.minv, self.qs)
                   if t is not None)

    @classmethod
    def from_gguf(cls, fmt: str, raw: torch.Tensor) -> "BlockWeight":
        """From a GGUF tensor's raw bytes ``raw`` [N, KB * block bytes] uint8 (gguf-py's
        ``ReaderTensor.data`` of a quantized tensor, as a torch tensor).

        Raises:
            ValueError: a format other than Q4_1 / Q8_0, or a row size that is not whole blocks.
        """
        if fmt not in FORMATS:
            raise ValueError(f"no kernel for GGUF format {fmt}; have {sorted(FORMATS)}")
        _, block_bytes, quant_bytes = FORMATS[fmt]
        if raw.dim() != 2 or raw.dtype != torch.uint8 or raw.shape[1] % block_bytes:
            raise ValueError(f"{fmt} rows must be whole {block_bytes}-byte blocks of uint8, "
                             f"got {raw.dtype} {tuple(raw.shape)}")
        blocks = raw.reshape(raw.shape[0], -1, block_bytes)

        def f16(col: int) -> torch.Tensor:  # the f16 at byte col of each block, as float32
            return blocks[..., col:col + 2].contiguous().view(torch.float16)[..., 0].float()

        qs = blocks[..., block_bytes - quant_bytes:].contiguous()
        if fmt == "Q4_1":
            return cls(fmt, f16(0), f16(2), qs)
        return cls(fmt, f16(0), None, qs.view(torch.int8))

    @classmethod
    def quantize_q8_0(cls, weight: torch.Tensor) -> "BlockWeight":
        """Round a float32 weight [N, K] (K a multiple of 32) to Q8_0 as llama.cpp's reference
        quantizer does (``quantize_row_q8_0_ref``): per block of 32, ``d = amax / 127`` stored
        as f16 and ``q = round(w / d)`` in [-127, 127], except that ``q`` is rounded against
        the stored f16 ``d``, so :meth:`dequantize` moves each weight by at most half a step
        (d / 2). A weight that came from Q8_0 blocks with a full-range block (amax at
        q = +-127, as llama.cpp writes them) gets those blocks back.

        Raises:
            ValueError: not a 2-D float32 tensor of whole 32-wide blocks.
        """
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % BLOCK:
            raise ValueError(f"Q8_0 takes a float32 [N, K] weight with K a multiple of "
                             f"{BLOCK}, got {weight.dtype} {tuple(weight.shape)}")
        n, k = weight.shape
        w = weight.detach().cpu().reshape(n, k // BLOCK, BLOCK)
        d = (w.abs().amax(dim=-1) / 127.0).half().float()
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round(w / safe[..., None]).clamp_(-127, 127).to(torch.int8)
        return cls("Q8_0", d.contiguous(), None, q.contiguous())

    def take_rows(self, index: torch.Tensor) -> "BlockWeight":
        """The weight of rows ``index`` [N'] (int64), in that order."""
        pick = lambda t: None if t is None else t.index_select(0, index).contiguous()  # noqa
        return BlockWeight(self.fmt, pick(self.scale), pick(self.minv), pick(self.qs))

    @staticmethod
    def cat(weights: list["BlockWeight"]) -> "BlockWeight":
        """Weights of one format and K stacked along the rows (a fused q/k/v or gate/up).

        Raises:
            ValueError: formats or input sizes differ.
        """
        if len({(w.fmt, w.in_features) for w in weights}) != 1:
            raise ValueError("only weights of one format and input size can be stacked")
        minv = None if weights[0].minv is None else torch.cat([w.minv for w in weights])
        return BlockWeight(weights[0].fmt, torch.cat([w.scale for w in weights]), minv,
                           torch.cat([w.qs for w in weights]))

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] (torch reference; gguf-py's values bit for bit)."""
        n, kb = self.scale.shape
        if self.fmt == "Q4_1":
            q = torch.cat([self.qs & 0x0F, self.qs >> 4], dim=-1).float()  # [N, KB, 32]
            w = q * self.scale[..., None] + self.minv[..., None]
        else:
            w = self.qs.float() * self.scale[..., None]
        return w.reshape(n, kb * BLOCK)


def matmul_ref(x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    """Torch reference: x [M, K] float32 @ weight.dequantize().T -> [M, N]."""
    return x @ weight.dequantize().T


def gguf_matmul(x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    """``x`` [M, K] float32 (CPU) @ ``weight``.T -> [M, N] float32 on the compiled kernel, on
    ``torch.get_num_threads()`` threads. Row i of the result does not depend on the other rows.

    Raises:
        ValueError: x is not a 2-D float32 CPU tensor of K columns.
        RuntimeError: the kernel is not available, or it failed (out of memory).
    """
    if x.dtype is not torch.float32 or x.dim() != 2 or not x.is_cpu \
            or x.shape[1] != weight.in_features:
        raise ValueError(f"gguf_matmul takes a float32 CPU [M, {weight.in_features}] input, got "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}")
    lib = KERNEL.lib or KERNEL.library()  # once loaded, one attribute read per product
    if lib is None:
        raise RuntimeError(f"the GGUF matmul kernel is not available: {KERNEL.failed}")
    x = x.contiguous()
    m, k = x.shape
    n = weight.out_features
    y = torch.empty(m, n)
    scale, minv, qs = weight._ptrs
    if weight.fmt == "Q4_1":
        rc = lib.specmesh_q4_1_matmul(x.data_ptr(), m, k, scale, minv, qs, n, y.data_ptr(),
                                      torch.get_num_threads())
    else:
        rc = lib.specmesh_q8_0_matmul(x.data_ptr(), m, k, scale, qs, n, y.data_ptr(),
                                      torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"the GGUF matmul kernel failed (code {rc})")
    return y


def dequantize_compiled(weight: BlockWeight) -> torch.Tensor:
    """The float32 weight [N, K] as the compiled kernel expands it (tests compare it with
    :meth:`BlockWeight.dequantize`).

    Raises:
        RuntimeError: the kernel is not available.
    """
    lib = KERNEL.library()
    if lib is None:
        raise RuntimeError(f"the GGUF matmul kernel is not available: {KERNEL.failed}")
    n, k = weight.out_features, weight.in_features
    w = torch.empty(n, k, dtype=torch.float32)
    minv = 0 if weight.minv is None else weight.minv.data_ptr()
    lib.specmesh_gguf_dequant(FORMATS[weight.fmt][0], weight.scale.data_ptr(), minv,
                              weight.qs.data_ptr(), n, k, w.data_ptr())
    return w


__all__ = ["BLOCK", "FORMATS", "KERNEL", "BlockWeight", "available",
           "dequantize_compiled", "gguf_matmul", "matmul_ref"]
