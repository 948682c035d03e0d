"""The argmax of each row of a logits matrix, first index among ties: the greedy token.

Why: on CPU ``torch.argmax`` over a 49,152-wide float32 row is many times slower than NumPy's
vectorised ``argmax`` on the same memory, and greedy verification and greedy sampling take one
per logits row of every step, which made it a visible share of a large verify step
(docs/benchmarks.md, 'Linear layers'). On CUDA it stays ``torch.argmax``.

Same result as ``torch.argmax(x, dim=-1)``: the first index of the row maximum, a NaN counting
as the maximum (both libraries return the first NaN). bf16 / fp16 rows are widened to float32
first (exact and order-preserving).
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY_DTYPES = (torch.float32, torch.float64)
_WIDENED = (torch.bfloat16, torch.float16)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """int64 ``[...]``: per row of ``x`` ``[..., V]`` (any float dtype, any device) the first
    index of its maximum, as ``torch.argmax(x, dim=-1)``.

    Raises:
        ValueError: ``x`` has no elements along its last dimension.
    """
    if x.shape[-1] == 0:
        raise ValueError("argmax of empty rows")
    if x.device.type != "cpu" or x.requires_grad:
        return torch.argmax(x, dim=-1)
    if x.dtype in _WIDENED:
        x = x.float()
    elif x.dtype not in _NUMPY_DTYPES:
        return torch.argmax(x, dim=-1)
    return torch.from_numpy(np.asarray(np.argmax(x.numpy(), axis=-1), dtype=np.int64))


__all__ = ["row_argmax"]
