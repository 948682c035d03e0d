"""Per-request logits processing: temperature, top-k, top-p, min-p
(docs/architecture.md, 'Verification rules').

Shared by plain decode, the prefill worker's first token and verification: every verified
position of a request is processed with that request's parameters, so the verification rules
(rejection, coupled) see the distribution the request actually samples from.

Rows ``[N, V]`` are grouped by request through per-row parameter tensors ``[N]`` (a request with
``k_b`` drafts owns ``k_b + 1`` consecutive target rows; :func:`expand_to_rows` repeats a
per-request tensor ``[B]`` to those rows).

Semantics follow vLLM's sampler (the order of vLLM's v0 sampler: temperature, then top-k, then
top-p, then min-p; vLLM's v1 sampler applies min-p before top-k/top-p, which differs only when
min-p and top-p are both set):

- greedy: ``temperature < 1e-5`` (vLLM's ``_SAMPLING_EPS``) gives the one-hot of
  ``argmax(logits)`` (first index among ties) on the raw logits in their own dtype; top-k/p and
  min-p are ignored for that row (the target's own greedy decode is reproduced exactly);
- temperature: ``logits.float() / temperature``;
- top-k: tokens whose (scaled) logit is below the k-th largest are removed (ties with the k-th
  are kept); ``top_k <= 0`` or ``top_k >= V`` disables it;
- top-p (nucleus, Holtzman et al. arXiv 1904.09751): logits sorted ascending (stable), the
  softmax's cumulative sum; tokens with cumulative mass ``<= 1 - top_p`` are removed, the
  largest always stays; ``top_p == 1`` disables it;
- min-p (Nguyen et al. arXiv 2407.01082): tokens with probability ``< min_p * max_prob`` are
  removed; ``min_p == 0`` disables it;
- result: the softmax of the remaining logits, float32.

Entry points, one signature: :func:`process_logits_ref` (plain torch, the source of truth,
any device), :func:`process_logits_triton` (one program per row: CUDA, or CPU under
``TRITON_INTERPRET=1``) and :func:`process_logits` (launcher: the kernel on CUDA or under the
interpreter for vocabularies up to :data:`MAX_KERNEL_VOCAB`, else the reference). The kernel finds the top-k threshold exactly (bisection over
an order-preserving integer image of the float32 logits: the k-th largest value, ties kept) and
the top-p cut without sorting (bisection for the largest value whose inclusive cumulative mass
stays within ``1 - top_p``, then the boundary value's ties in index order, as the reference's
stable ascending sort has them); its sums are tree reductions where the reference's cumulative
sum is sequential, so a token whose cumulative mass lies within float32 rounding of
``1 - top_p`` (or of ``min_p * max``) may fall on the other side, and probabilities agree to
float32 rounding (tests: ``atol`` 1e-6, supports equal on random rows).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from specmesh.kernels.triton_mode import check_runnable, interpret_mode, is_interpreted

#: Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``).
GREEDY_TEMPERATURE_EPS = 1e-5
#: Largest vocabulary the launcher gives the kernel: it holds a whole row in one program (BLOCK_V =
#: next power of two): compiling a 65,536-wide block for sm_90 took many minutes per dtype on a
#: 2-core CPU, a 4,096-wide one seconds (docs/benchmarks.md, 'Protocol, health, installation').
#: Larger vocabularies (SmolLM2's 49,152) take the torch reference on every device until the kernel
#: walks a row in chunks.
MAX_KERNEL_VOCAB = 8192

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = (torch.int32, torch.int64)


def _check_param(name: str, t: torch.Tensor | None, rows: int, device: torch.device,
                 dtypes: tuple[torch.dtype, ...]) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.shape != (rows,):
        raise ValueError(f"{name} must have shape ({rows},), got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, logits on {device}")


def _validate(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
              top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> None:
    """Raises ValueError on wrong shapes, dtypes, devices or out-of-range values
    (``temperature >= 0`` and finite, ``0 < top_p <= 1``, ``0 <= min_p <= 1``; any ``top_k``)."""
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [N, V] with V > 0, got shape {tuple(logits.shape)}")
    if logits.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    rows, device = logits.shape[0], logits.device
    if temperature is None:
        raise ValueError("temperature is required (0 for greedy rows)")
    _check_param("temperature", temperature, rows, device, _FLOAT_DTYPES)
    _check_param("top_k", top_k, rows, device, _INT_DTYPES)
    _check_param("top_p", top_p, rows, device, _FLOAT_DTYPES)
    _check_param("min_p", min_p, rows, device, _FLOAT_DTYPES)
    if not bool(((temperature >= 0) & torch.isfinite(temperature)).all()):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature.tolist()}")
    if top_p is not None and not bool(((top_p > 0) & (top_p <= 1)).all()):
        raise ValueError(f"top_p must be in (0, 1], got {top_p.tolist()}")
    if min_p is not None and not bool(((min_p >= 0) & (min_p <= 1)).all()):
        raise ValueError(f"min_p must be in [0, 1], got {min_p.tolist()}")


def expand_to_rows(values: torch.Tensor, cu_num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """Repeat per-request ``values [B]`` to the request's target rows: ``[num_draft_total + B]``
    (``k_b + 1`` rows for request ``b``; ``cu_num_draft_tokens [B]`` the inclusive cumsum of
    the ``k_b``).

    Raises:
        ValueError: shapes differ, or ``cu_num_draft_tokens`` is not a non-decreasing cumsum.
    """
    if values.dim() != 1 or cu_num_draft_tokens.shape != values.shape:
        raise ValueError(f"values {tuple(values.shape)} and cu_num_draft_tokens "
                         f"{tuple(cu_num_draft_tokens.shape)} must both be [B]")
    cu = cu_num_draft_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    if not cu.is_cuda and bool((counts < 0).any()):
        raise ValueError(f"cu_num_draft_tokens must be a non-decreasing cumsum >= 0, got "
                         f"{cu.tolist()}")
    total = int(cu[-1]) + cu.numel() if cu.numel() else 0
    return torch.repeat_interleave(values, counts + 1, output_size=total)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's ``apply_top_k_top_p`` on float32 logits (a stable sort instead of vLLM's)."""
    vocab = logits.shape[1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False, stable=True)
    if top_k is not None:
        k = top_k.to(torch.int64)
        k = torch.where((k <= 0) | (k > vocab), vocab, k)
        kth = logits_sort.gather(1, (vocab - k).unsqueeze(1))  # the k-th largest
        logits_sort = logits_sort.masked_fill(logits_sort < kth, -math.inf)
    if top_p is not None:
        probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        remove = probs_sum <= 1 - top_p.to(torch.float32).unsqueeze(1)
        remove[:, -1] = False  # the largest always stays
        logits_sort = logits_sort.masked_fill(remove, -math.inf)
    return torch.empty_like(logits_sort).scatter_(1, logits_idx, logits_sort)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's ``_apply_min_p``: remove tokens with probability ``< min_p * max_prob``."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.to(torch.float32).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, -math.inf)


def process_logits_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Processed probabilities of logits rows, in plain torch (the source of truth).

    Args:
        logits: float16/bfloat16/float32/float64 ``[N, V]``, one row per sampled position.
        temperature: float ``[N]``, ``>= 0``; ``< 1e-5`` is greedy (one-hot argmax).
        top_k: int32/int64 ``[N]`` or None; ``<= 0`` or ``>= V`` disables.
        top_p: float ``[N]`` in ``(0, 1]`` or None; ``1`` disables.
        min_p: float ``[N]`` in ``[0, 1]`` or None; ``0`` disables.

    Returns:
        float32 ``[N, V]``: each row a distribution (sums to 1 up to rounding; greedy rows
        exactly one-hot). The input is not modified.

    Raises:
        ValueError: see :func:`_validate`.
    """
    _validate(logits, temperature, top_k, top_p, min_p)
    greedy = temperature < GREEDY_TEMPERATURE_EPS  # [N]
    scaled = logits.to(torch.float32) / torch.where(
        greedy, 1.0, temperature.to(torch.float32)).unsqueeze(1)
    # Rows where an option is disabled skip it exactly (vLLM skips the whole op when no row
    # uses it; a disabled row's sort/cumsum would also leave it unchanged but for rounding).
    if top_k is not None:
        top_k = torch.where((top_k <= 0) | (top_k >= logits.shape[1]), 0, top_k)
        if not bool((top_k > 0).any()):
            top_k = None
    if top_p is not None and not bool((top_p < 1).any()):
        top_p = None
    if top_k is not None or top_p is not None:
        scaled = _apply_top_k_top_p(scaled, top_k, top_p)
    if min_p is not None and bool((min_p > 0).any()):
        scaled = _apply_min_p(scaled, min_p)
    probs = scaled.softmax(dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(
            1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs


@triton.jit
def _order_key(x):
    """float32 -> int32 whose order is the floats' order (-inf lowest)."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _process_logits_kernel(
    logits_ptr,  # [N, V], any float dtype
    temperature_ptr,  # float32 [N]
    top_k_ptr,  # int64 [N] (0: off)
    top_p_ptr,  # float32 [N] (1: off)
    min_p_ptr,  # float32 [N] (0: off)
    out_ptr,  # float32 [N, V]
    vocab,
    GREEDY_EPS: tl.constexpr,
    FLOAT64: tl.constexpr,  # the logits are float64
    BLOCK_V: tl.constexpr,  # power of two >= vocab
):
    """One program per row: temperature, top-k, top-p, min-p, softmax (module docstring)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    valid = cols < vocab
    raw = tl.load(logits_ptr + row * vocab + cols, mask=valid, other=float("-inf"))
    t = tl.load(temperature_ptr + row)
    greedy = t < GREEDY_EPS
    x = raw.to(tl.float32) / tl.where(greedy, 1.0, t)
    x = tl.where(valid, x, float("-inf"))
    lowest = -2147483647 - 1  # below every float's key: lanes past the vocabulary
    key = tl.where(valid, _order_key(x), lowest).to(tl.int64)
    k = tl.load(top_k_ptr + row)
    if (k > 0) & (k < vocab):  # the k-th largest key: the largest c with #(key >= c) >= k
        lo = tl.min(tl.where(valid, key, 2147483647), axis=0)
        hi = tl.max(key, axis=0)
        for _ in range(34):
            mid = lo + (hi - lo + 1) // 2
            ok = tl.sum(tl.where(valid & (key >= mid), 1, 0), axis=0) >= k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        kept = key >= lo
        x = tl.where(kept, x, float("-inf"))
        key = tl.where(kept, key, lowest)
    p = tl.load(top_p_ptr + row)
    if p < 1.0:
        e = tl.exp(x - tl.max(x, axis=0))
        probs = e / tl.sum(e, axis=0)
        limit = 1.0 - p
        # the largest key c whose inclusive mass stays within the limit: all of it goes
        lo = tl.min(tl.where(valid, key, 2147483647), axis=0) - 1  # (nothing goes)
        hi = tl.max(key, axis=0)
        for _ in range(34):
            mid = lo + (hi - lo + 1) // 2
            ok = tl.sum(tl.where(valid & (key <= mid), probs, 0.0), axis=0) <= limit
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        below = tl.sum(tl.where(valid & (key <= lo), probs, 0.0), axis=0)
        # the next value's ties go in index order while the mass stays within the limit
        nxt = tl.min(tl.where(valid & (key > lo), key, 2147483647), axis=0)
        tie = valid & (key == nxt)
        within = tl.cumsum(tl.where(tie, probs, 0.0), axis=0)
        remove = valid & ((key <= lo) | (tie & (below + within <= limit)))
        # the largest token (the last of the largest value's ties) always stays
        top = tl.max(key, axis=0)
        last = tl.max(tl.where(valid & (key == top), cols, -1), axis=0)
        x = tl.where(remove & (cols != last), float("-inf"), x)
    mp = tl.load(min_p_ptr + row)
    if mp > 0.0:
        e = tl.exp(x - tl.max(x, axis=0))
        probs = e / tl.sum(e, axis=0)
        x = tl.where(probs < mp * tl.max(probs, axis=0), float("-inf"), x)
    e = tl.exp(x - tl.max(x, axis=0))
    out = e / tl.sum(e, axis=0)
    # greedy rows: one-hot at the raw argmax (first among ties); half-precision logits are
    # compared in float32 (exact), float64 ones as they are (float32 could merge values)
    if FLOAT64:
        best = tl.argmax(raw, axis=0)
    else:
        best = tl.argmax(raw.to(tl.float32), axis=0)
    out = tl.where(greedy, tl.where(cols == best, 1.0, 0.0), out)
    tl.store(out_ptr + row * vocab + cols, out, mask=valid)


def _kernel_is_interpreted() -> bool:
    """Whether this module's kernel was decorated interpreted (see :mod:`kernels.triton_mode`)."""
    return is_interpreted(_process_logits_kernel)


def process_logits_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`process_logits_ref` computed by the Triton kernel (same arguments and results, to
    float32 rounding: see the module docstring).

    Raises:
        ValueError: see :func:`_validate`; or CPU tensors while the kernel is compiled.
        RuntimeError: CPU tensors with ``TRITON_INTERPRET=1`` set only after triton was
            imported.
    """
    _validate(logits, temperature, top_k, top_p, min_p)
    check_runnable(logits.is_cuda, _process_logits_kernel)
    rows, vocab = logits.shape
    device = logits.device
    out = torch.empty((rows, vocab), dtype=torch.float32, device=device)
    if rows == 0:
        return out
    k = torch.zeros(rows, dtype=torch.int64, device=device) if top_k is None else \
        torch.where((top_k <= 0) | (top_k >= vocab), 0, top_k).to(torch.int64)
    p = torch.ones(rows, dtype=torch.float32, device=device) if top_p is None else \
        top_p.to(torch.float32)
    m = torch.zeros(rows, dtype=torch.float32, device=device) if min_p is None else \
        min_p.to(torch.float32)
    _process_logits_kernel[(rows,)](
        logits.contiguous(), temperature.to(torch.float32).contiguous(), k.contiguous(),
        p.contiguous(), m.contiguous(), out, vocab, GREEDY_EPS=GREEDY_TEMPERATURE_EPS,
        FLOAT64=logits.dtype == torch.float64, BLOCK_V=triton.next_power_of_2(vocab),
        num_warps=8)
    return out


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launcher: the Triton kernel on CUDA (or on CPU under ``TRITON_INTERPRET=1``) for
    vocabularies up to :data:`MAX_KERNEL_VOCAB`, else the torch reference. Arguments, results
    and errors as :func:`process_logits_ref`."""
    on_cuda = isinstance(logits, torch.Tensor) and logits.is_cuda
    fits = isinstance(logits, torch.Tensor) and logits.dim() == 2 \
        and logits.shape[1] <= MAX_KERNEL_VOCAB
    fn = process_logits_triton if (on_cuda or interpret_mode()) and fits else process_logits_ref
    return fn(logits, temperature, top_k, top_p, min_p)


__all__ = ["GREEDY_TEMPERATURE_EPS", "MAX_KERNEL_VOCAB", "expand_to_rows", "process_logits", "process_logits_ref",
           "process_logits_triton"]
