"""A linear layer whose result for a row does not depend on how many rows the call has.

Batch invariance (DESIGN.md §11, kernels/paged_attention.py) needs every op of the verify
forward to compute a row bit for bit as a one-token decode step does. CPU BLAS takes another
kernel for a one-row product than for two or more: on AVX-512 bf16 CPUs (oneDNN / MKL bf16
GEMM) a bf16 row computed alone differs in the last bit from the same row computed among
others, while products of two or more rows agree row by row (measured: SmolLM2's
``down_proj`` on its own activations, every M from 2 to 17 against pairs). After rounding to
bf16 such a bit flips greedy tokens at near-ties, so speculation's output drifted from plain
decoding's. :class:`RowInvariantLinear` computes a one-row bf16 / fp16 input as two rows (the
row twice) and keeps the first. Float32 and float64 keep the one-row fast path (GEMV; a 2-row fp32 GEMM
costs up to 3x on AVX2): float32's last-bit differences are far rarer at argmax than bf16's
(no test or bench prompt has flipped), but they are not ruled out.
"""

from __future__ import annotations

import torch
from torch import nn

#: Dtypes whose one-row products are computed as two rows.
PADDED_DTYPES = (torch.bfloat16, torch.float16)


class RowInvariantLinear(nn.Linear):
    """``nn.Linear`` (same parameters and state-dict names) whose output row i equals what
    any other call containing the same input row computes: inputs ``x`` [M, in] with M == 1
    in bf16 / fp16 run as [2, in]. Other shapes and dtypes are plain ``nn.Linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] -> [M, out_features]."""
        if x.dim() == 2 and x.shape[0] == 1 and x.dtype in PADDED_DTYPES:
            return super().forward(torch.cat([x, x]))[:1]
        return super().forward(x)


__all__ = ["PADDED_DTYPES", "RowInvariantLinear"]
