"""A linear layer whose result for a row does not depend on how many rows the call has.

Batch invariance (DESIGN.md §11, kernels/paged_attention.py) needs every op of the verify
forward to compute a row bit for bit as a one-token decode step does. CPU BLAS takes another
kernel for a one-row product than for two or more: on AVX-512 bf16 CPUs (oneDNN / MKL bf16
GEMM) a bf16 row computed alone differs in the last bit from the same row computed among
others, while products of two or more rows agree row by row (measured: SmolLM2's
``down_proj`` on its own activations, every M from 2 to 17 against pairs). After rounding to
bf16 such a bit flips greedy tokens at near-ties, so speculation's output drifted from plain
decoding's. :class:`RowInvariantLinear` computes a one-row bf16 / fp16 input as two rows (the
row twice) and keeps the first. On F.linear, float32 and float64 keep the one-row fast path
(GEMV; a 2-row fp32 GEMM costs up to 3x on AVX2): float32's last-bit differences are far
rarer at argmax than bf16's (no test or bench prompt has flipped), but they are not ruled out.
Inference on CPU in float32 and bf16 runs on prepacked oneDNN weights instead
(engine/onednn.py), where one-row inputs also run as two rows, which rules them out for
float32 too.
"""

from __future__ import annotations

import torch
from torch import nn

from engine import onednn

#: Dtypes whose one-row products are computed as two rows.
PADDED_DTYPES = (torch.bfloat16, torch.float16)


class RowInvariantLinear(nn.Linear):
    """``nn.Linear`` (same parameters and state-dict names) whose output row i equals what
    any other call containing the same input row computes: inputs ``x`` [M, in] with M == 1
    in bf16 / fp16 run as [2, in].

    Inference on CPU in fp32 / bf16 (no autograd) runs on a prepacked oneDNN copy of the
    weight (:mod:`engine.onednn`: 2-3x faster decode-size products, row-invariant in fp32
    too), packed on first use and again whenever the weight or bias changes (a new tensor, an
    in-place update such as ``load_state_dict``, another dtype). Other cases are plain
    ``nn.Linear``.
    """

    def __init__(self, *args, **kwargs) -> None:  # nn.Linear's arguments
        super().__init__(*args, **kwargs)
        self._pack_cache = onednn.PackCache()

    @property
    def _packed(self) -> torch.Tensor | None:
        """The current oneDNN pack of the weight (None before first use or where unused)."""
        return self._pack_cache.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] -> [M, out_features]."""
        packed = self._pack_cache.get(x, self.weight, self.bias)
        if packed is not None:
            return onednn.linear(x, packed, self.bias)
        if x.dim() == 2 and x.shape[0] == 1 and x.dtype in PADDED_DTYPES:
            return super().forward(torch.cat([x, x]))[:1]
        return super().forward(x)


def prepack(model: nn.Module) -> int:
    """Pack every :class:`RowInvariantLinear` of ``model`` for CPU inference now, at load time,
    so the first request does not pay it (SmolLM2: ~0.4 s, packing and the pack checks).
    Returns how many weights were packed (0 on GPU, in float64, or with packing off)."""
    packed = 0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RowInvariantLinear):
                w = module.weight
                probe = torch.empty(2, module.in_features, dtype=w.dtype, device=w.device)
                packed += module._pack_cache.get(probe, w, module.bias) is not None
    return packed


__all__ = ["PADDED_DTYPES", "RowInvariantLinear", "prepack"]
