"""Device helpers of the exponential race (the Gumbel-max trick: ``argmax(p / E)`` with
``E ~ Exp(1)`` samples ``normalize(p)``) that the sampling kernels share: IEEE-rounded scores and
a first-index argmax carried across vocabulary chunks, the same bits compiled (CUDA) and
interpreted as torch's ``(p / E).argmax()``.

Why ``ieee_div``: Triton compiles a float32 ``/`` to an approximate division (``div.full.f32``),
and ``tl.math.fdiv(..., ieee_rounding=True)`` does not compile for float64 operands (Triton 3.9:
"intrinsic call returns double but llvm.nvvm.div.rn.f actually returns float"). A float64 ``/``
is ``div.rn.f64`` (IEEE round-to-nearest), and the float64 quotient of two float32 values
rounded once to float32 is the correctly rounded float32 quotient (53 >= 2 * 24 + 2 bits:
Figueroa, "When is double rounding innocuous?", SIGNUM 1995), i.e. torch's float32 division.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ieee_div(a, b):
    """``a / b`` correctly rounded to ``a``'s dtype (float32 or float64 operands)."""
    return (a.to(tl.float64) / b.to(tl.float64)).to(a.dtype)


@triton.jit
def running_argmax(scores, off, best, best_idx):
    """Fold a chunk of ``scores`` (vocabulary ids ``off ..``) into the running maximum
    ``(best, best_idx)``; the first index wins ties, within the chunk and across chunks."""
    m, i = tl.max(scores, axis=0, return_indices=True, return_indices_tie_break_left=True)
    better = m > best  # strict: an earlier chunk wins ties
    return tl.where(better, m, best), tl.where(better, off + i.to(tl.int64), best_idx)


__all__ = ["ieee_div", "running_argmax"]
