"""Synthetic acceptance over a ragged batch (docs/architecture.md, 'Verification rules'): the
ablation harness that accepts
drafts at given rates whatever they are (vLLM's synthetic acceptance for benchmarking a
deployment at a chosen acceptance; see decode/synthetic.py for the curves).

Layout as kernels/greedy_verify.py: request ``b`` has ``k_b >= 0`` drafts
``draft_token_ids[cu[b-1]:cu[b]]`` and ``k_b + 1`` rows of ``target_token_ids`` (the token the
request's own rule would emit after the committed prefix and the first ``j`` drafts: argmax,
coupled or random sample). Draft ``j`` (flat index ``i``) passes iff
``uniform_samples[i] < accept_rates[min(j, P - 1)]``: ``accept_rates`` ``[P]`` are the
*conditional* acceptance probabilities per draft position (the last one repeats), so
``P(accept_len >= j + 1) = prod(accept_rates[:j + 1])``. ``accept_len`` is the number of drafts
before the first failure; output row ``b`` is ``drafts[:accept_len] + [target[accept_len]]``,
padded with :data:`PLACEHOLDER_TOKEN_ID`. Randomness is the input ``uniform_samples``, so kernel
and reference agree exactly.

Entry points, one signature: :func:`synthetic_accept_ref` (plain torch, the source of truth),
:func:`synthetic_accept_triton` (the kernel: CUDA, or CPU under ``TRITON_INTERPRET=1``) and
:func:`synthetic_accept` (launcher).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmesh.kernels.constants import PLACEHOLDER_TOKEN_ID
from specmesh.kernels.ragged import CU_DTYPES, request_span, resolve_max_num_draft_tokens
from specmesh.kernels.ragged import num_drafts as _num_drafts
from specmesh.kernels.triton_mode import check_runnable, interpret_mode, is_interpreted

_FLOAT_DTYPES = (torch.float32, torch.float64)


def _validate(draft_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
              target_token_ids: torch.Tensor, uniform_samples: torch.Tensor,
              accept_rates: torch.Tensor, max_num_draft_tokens: int | None) -> int:
    """Check the inputs; return ``max_num_draft_tokens`` (computed when None).

    Raises:
        ValueError: wrong rank, dtype, device or sizes; inconsistent ``cu``; no rate, or a
            rate outside ``[0, 1]`` (checked for CPU tensors); a uniform sample outside
            ``[0, 1)`` (CPU).
    """
    tensors = {"draft_token_ids": draft_token_ids, "cu_num_draft_tokens": cu_num_draft_tokens,
               "target_token_ids": target_token_ids, "uniform_samples": uniform_samples,
               "accept_rates": accept_rates}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if draft_token_ids.dtype != torch.int64 or target_token_ids.dtype != torch.int64:
        raise ValueError("draft_token_ids and target_token_ids must be int64")
    if cu_num_draft_tokens.dtype not in CU_DTYPES:
        raise ValueError(f"cu_num_draft_tokens must be int32 or int64, "
                         f"got {cu_num_draft_tokens.dtype}")
    if uniform_samples.dtype not in _FLOAT_DTYPES or accept_rates.dtype not in _FLOAT_DTYPES:
        raise ValueError("uniform_samples and accept_rates must be float32 or float64")
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"inputs are on different devices: {sorted(map(str, devices))}")
    batch, num_draft_total = cu_num_draft_tokens.numel(), draft_token_ids.numel()
    if target_token_ids.numel() != num_draft_total + batch:
        raise ValueError(f"target_token_ids has {target_token_ids.numel()} tokens, expected "
                         f"num_draft_total + batch = {num_draft_total} + {batch}")
    if uniform_samples.numel() != num_draft_total:
        raise ValueError(f"uniform_samples has {uniform_samples.numel()} values for "
                         f"{num_draft_total} drafts")
    if accept_rates.numel() == 0:
        raise ValueError("accept_rates needs at least one rate")
    if not accept_rates.is_cuda:
        if not bool(((accept_rates >= 0) & (accept_rates <= 1)).all()):
            raise ValueError(f"accept_rates must be in [0, 1], got {accept_rates.tolist()}")
        if not bool(((uniform_samples >= 0) & (uniform_samples < 1)).all()):
            raise ValueError("uniform_samples must be in [0, 1)")
    return resolve_max_num_draft_tokens(cu_num_draft_tokens, num_draft_total,
                                        max_num_draft_tokens)[0]


def synthetic_accept_ref(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_token_ids: torch.Tensor,
    uniform_samples: torch.Tensor,
    accept_rates: torch.Tensor,
    max_num_draft_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic acceptance in plain torch (the source of truth).

    Args:
        draft_token_ids: int64 ``[num_draft_total]``.
        cu_num_draft_tokens: int32/int64 ``[batch]``, inclusive cumsum of draft counts.
        target_token_ids: int64 ``[num_draft_total + batch]``, the extra token of each row.
        uniform_samples: float32/float64 ``[num_draft_total]`` in ``[0, 1)``.
        accept_rates: float32/float64 ``[P]``, conditional acceptance per draft position in
            ``[0, 1]``; positions ``>= P`` use the last.
        max_num_draft_tokens: output width minus one; computed when None.

    Returns:
        ``(output_token_ids int64 [batch, max_num_draft_tokens + 1], accept_len int64 [batch])``.

    Raises:
        ValueError: see :func:`_validate`.
    """
    width = _validate(draft_token_ids, cu_num_draft_tokens, target_token_ids, uniform_samples,
                      accept_rates, max_num_draft_tokens) + 1
    device = draft_token_ids.device
    batch = cu_num_draft_tokens.numel()
    num_drafts = _num_drafts(cu_num_draft_tokens)[:, None]  # [batch, 1]
    draft_start = cu_num_draft_tokens.to(torch.int64)[:, None] - num_drafts
    pos = torch.arange(width, device=device)[None, :]  # [1, width]
    pad = torch.full((1,), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    is_draft = pos < num_drafts
    draft_idx = torch.where(is_draft, draft_start + pos, draft_token_ids.numel())
    drafts = torch.cat([draft_token_ids, pad])[draft_idx]
    target_start = draft_start + torch.arange(batch, device=device)[:, None]
    target_idx = torch.where(pos <= num_drafts, target_start + pos, target_token_ids.numel())
    targets = torch.cat([target_token_ids, pad])[target_idx]
    u = torch.cat([uniform_samples.to(torch.float64),
                   torch.ones(1, dtype=torch.float64, device=device)])[draft_idx]
    rates = accept_rates.to(torch.float64)[pos.clamp(max=accept_rates.numel() - 1)]
    passes = (u < rates) & is_draft
    accept_len = passes.to(torch.int64).cumprod(dim=1).sum(dim=1)
    accepted = accept_len[:, None]
    output = torch.where(pos < accepted, drafts, torch.where(pos == accepted, targets, pad))
    return output, accept_len


@triton.jit
def _synthetic_accept_kernel(
    draft_ptr,  # int64 [num_draft_total]
    cu_ptr,  # int32/int64 [batch]
    target_ptr,  # int64 [num_draft_total + batch]
    uniform_ptr,  # float [num_draft_total]
    rates_ptr,  # float [num_rates]
    output_ptr,  # int64 [batch, output_width]
    accept_len_ptr,  # int64 [batch]
    output_width,
    num_rates,
    PLACEHOLDER: tl.constexpr,
    BLOCK: tl.constexpr,  # power of two >= output_width
):
    """One program per request: the first draft whose uniform sample misses its rate."""
    req = tl.program_id(0).to(tl.int64)
    draft_start, num_drafts = request_span(cu_ptr, req)
    pos = tl.arange(0, BLOCK)
    is_draft = pos < num_drafts
    drafts = tl.load(draft_ptr + draft_start + pos, mask=is_draft, other=PLACEHOLDER)
    targets = tl.load(target_ptr + draft_start + req + pos, mask=pos <= num_drafts,
                      other=PLACEHOLDER)
    u = tl.load(uniform_ptr + draft_start + pos, mask=is_draft, other=1.0).to(tl.float64)
    rate = tl.load(rates_ptr + tl.minimum(pos, num_rates - 1)).to(tl.float64)
    stop = (u >= rate) | (pos >= num_drafts)
    accept_len = tl.min(tl.where(stop, pos, BLOCK), axis=0)
    output = tl.where(pos < accept_len, drafts,
                      tl.where(pos == accept_len, targets, PLACEHOLDER))
    tl.store(output_ptr + req * output_width + pos, output, mask=pos < output_width)
    tl.store(accept_len_ptr + req, accept_len.to(tl.int64))


def _kernel_is_interpreted() -> bool:
    """Whether this module's kernel was decorated interpreted (see :mod:`kernels.triton_mode`)."""
    return is_interpreted(_synthetic_accept_kernel)


def synthetic_accept_triton(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_token_ids: torch.Tensor,
    uniform_samples: torch.Tensor,
    accept_rates: torch.Tensor,
    max_num_draft_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`synthetic_accept_ref` computed by the Triton kernel (same arguments, results).

    Raises:
        ValueError: see :func:`_validate`; or CPU tensors while the kernel is compiled.
        RuntimeError: CPU tensors with ``TRITON_INTERPRET=1`` set only after triton was
            imported.
    """
    max_num_draft_tokens = _validate(draft_token_ids, cu_num_draft_tokens, target_token_ids,
                                     uniform_samples, accept_rates, max_num_draft_tokens)
    check_runnable(draft_token_ids.is_cuda, _synthetic_accept_kernel)
    batch = cu_num_draft_tokens.numel()
    width = max_num_draft_tokens + 1
    device = draft_token_ids.device
    output = torch.empty((batch, width), dtype=torch.int64, device=device)
    accept_len = torch.empty((batch,), dtype=torch.int64, device=device)
    if batch == 0:
        return output, accept_len
    _synthetic_accept_kernel[(batch,)](
        draft_token_ids.contiguous(), cu_num_draft_tokens.contiguous(),
        target_token_ids.contiguous(), uniform_samples.contiguous(),
        accept_rates.contiguous(), output, accept_len, width, accept_rates.numel(),
        PLACEHOLDER=PLACEHOLDER_TOKEN_ID, BLOCK=triton.next_power_of_2(width), num_warps=1,
    )
    return output, accept_len


def synthetic_accept(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_token_ids: torch.Tensor,
    uniform_samples: torch.Tensor,
    accept_rates: torch.Tensor,
    max_num_draft_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: the Triton kernel on CUDA (or on CPU under ``TRITON_INTERPRET=1``), else the
    torch reference. Arguments, results and errors as :func:`synthetic_accept_ref`."""
    on_cuda = isinstance(draft_token_ids, torch.Tensor) and draft_token_ids.is_cuda
    fn = synthetic_accept_triton if on_cuda or interpret_mode() else synthetic_accept_ref
    return fn(draft_token_ids, cu_num_draft_tokens, target_token_ids, uniform_samples,
              accept_rates, max_num_draft_tokens)


__all__ = ["synthetic_accept", "synthetic_accept_ref", "synthetic_accept_triton"]
