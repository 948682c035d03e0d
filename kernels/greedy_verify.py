"""Greedy chain verification over a ragged batch (docs/architecture.md, 'Verification rules').

Request ``b`` has ``k_b >= 0`` draft tokens ``draft_token_ids[cu[b-1]:cu[b]]`` (``cu[-1]`` read
as 0) and ``k_b + 1`` target tokens ``target_token_ids[cu[b-1] + b : cu[b] + b + 1]``: target
token ``j`` is the target model's argmax after the last committed token and the first ``j``
drafts (one row per position of the verify forward over ``[last committed token] + drafts``).

``accept_len[b]`` is the length of the longest prefix where draft ``j`` equals target ``j``.
Output row ``b`` is ``drafts[:accept_len] + [target[accept_len]]`` (the bonus token when every
draft passed, else the recovered token), padded with :data:`PLACEHOLDER_TOKEN_ID`.

Three entry points, one signature:
- :func:`greedy_verify_ref`: plain torch, the source of truth (any device);
- :func:`greedy_verify_triton`: the Triton kernel (CUDA tensors, or CPU tensors when
  ``TRITON_INTERPRET=1``);
- :func:`greedy_verify`: the launcher: CUDA → kernel; CPU → reference, or the kernel when
  ``TRITON_INTERPRET=1`` is set (it must be set before triton is imported: triton decides
  compiled vs interpreted when it decorates a kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmesh.kernels.constants import PLACEHOLDER_TOKEN_ID
from specmesh.kernels.ragged import CU_DTYPES, request_span, resolve_max_num_draft_tokens
from specmesh.kernels.ragged import num_drafts as _num_drafts
from specmesh.kernels.triton_mode import check_runnable, interpret_mode, is_interpreted

_CU_DTYPES = CU_DTYPES


def _validate(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_token_ids: torch.Tensor,
    max_num_draft_tokens: int | None,
) -> int:
    """Check the inputs; return ``max_num_draft_tokens`` (computed when None).

    Content checks (``cu`` non-decreasing, ending at ``num_draft_total``, counts within
    ``max_num_draft_tokens``) need the values on the host: they run for CPU tensors, and on
    CUDA only the max is computed (one sync) when ``max_num_draft_tokens`` is None.

    Raises:
        ValueError: wrong rank, dtype, device or sizes; inconsistent ``cu``; a request with
            more drafts than ``max_num_draft_tokens``.
    """
    tensors = {"draft_token_ids": draft_token_ids, "cu_num_draft_tokens": cu_num_draft_tokens,
               "target_token_ids": target_token_ids}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if draft_token_ids.dtype != torch.int64 or target_token_ids.dtype != torch.int64:
        raise ValueError(f"token ids must be int64, got {draft_token_ids.dtype} (drafts) and "
                         f"{target_token_ids.dtype} (targets)")
    if cu_num_draft_tokens.dtype not in _CU_DTYPES:
        raise ValueError(f"cu_num_draft_tokens must be int32 or int64, "
                         f"got {cu_num_draft_tokens.dtype}")
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"inputs are on different devices: {sorted(map(str, devices))}")
    batch = cu_num_draft_tokens.numel()
    num_draft_total = draft_token_ids.numel()
    if target_token_ids.numel() != num_draft_total + batch:
        raise ValueError(f"target_token_ids has {target_token_ids.numel()} tokens, expected "
                         f"num_draft_total + batch = {num_draft_total} + {batch}")
    return resolve_max_num_draft_tokens(cu_num_draft_tokens, num_draft_total,
                                        max_num_draft_tokens)[0]


def greedy_verify_ref(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_token_ids: torch.Tensor,
    max_num_draft_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy prefix-match verification in plain torch (the source of truth).

    Args:
        draft_token_ids: int64 ``[num_draft_total]``, the drafts of all requests, concatenated.
        cu_num_draft_tokens: int32/int64 ``[batch]``, inclusive cumsum of per-request draft
            counts (a request may have 0 drafts).
        target_token_ids: int64 ``[num_draft_total + batch]``, the target's argmax tokens,
            ``k_b + 1`` per request, contiguous, in request order.
        max_num_draft_tokens: width of the output minus one; computed when None. Must be
            >= every request's draft count.

    Returns:
        ``(output_token_ids, accept_len)``: int64 ``[batch, max_num_draft_tokens + 1]`` padded
        with ``PLACEHOLDER_TOKEN_ID``, and int64 ``[batch]``.

    Raises:
        ValueError: see :func:`_validate`.
    """
    width = _validate(draft_token_ids, cu_num_draft_tokens, target_token_ids,
                      max_num_draft_tokens) + 1
    device = draft_token_ids.device
    batch = cu_num_draft_tokens.numel()
    num_drafts = _num_drafts(cu_num_draft_tokens)[:, None]  # [batch, 1]
    draft_start = cu_num_draft_tokens.to(torch.int64)[:, None] - num_drafts  # [batch, 1]
    pos = torch.arange(width, device=device)[None, :]  # [1, width]
    pad = torch.full((1,), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)

    # Gather per-request rows; out-of-range positions point at a trailing placeholder.
    is_draft = pos < num_drafts  # [batch, width]
    draft_idx = torch.where(is_draft, draft_start + pos, draft_token_ids.numel())
    drafts = torch.cat([draft_token_ids, pad])[draft_idx]
    target_start = draft_start + torch.arange(batch, device=device)[:, None]
    target_idx = torch.where(pos <= num_drafts, target_start + pos, target_token_ids.numel())
    targets = torch.cat([target_token_ids, pad])[target_idx]

    matches = (drafts == targets) & is_draft
    accept_len = matches.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [batch]
    accepted = accept_len[:, None]
    output = torch.where(pos < accepted, drafts,
                         torch.where(pos == accepted, targets, pad))
    return output, accept_len


@triton.jit
def _greedy_verify_kernel(
    draft_ptr,  # int64 [num_draft_total]
    cu_ptr,  # int32/int64 [batch]
    target_ptr,  # int64 [num_draft_total + batch]
    output_ptr,  # int64 [batch, output_width]
    accept_len_ptr,  # int64 [batch]
    output_width,  # max_num_draft_tokens + 1
    PLACEHOLDER: tl.constexpr,
    BLOCK: tl.constexpr,  # power of two >= output_width
):
    """One program per request: load its drafts and targets, find the first mismatch."""
    req = tl.program_id(0).to(tl.int64)
    draft_start, num_drafts = request_span(cu_ptr, req)

    pos = tl.arange(0, BLOCK)
    is_draft = pos < num_drafts
    drafts = tl.load(draft_ptr + draft_start + pos, mask=is_draft, other=PLACEHOLDER)
    targets = tl.load(target_ptr + draft_start + req + pos, mask=pos <= num_drafts,
                      other=PLACEHOLDER)
    # Position num_drafts (< BLOCK) always counts as a mismatch: accept_len <= num_drafts.
    stop = (drafts != targets) | (pos >= num_drafts)
    accept_len = tl.min(tl.where(stop, pos, BLOCK), axis=0)

    output = tl.where(pos < accept_len, drafts,
                      tl.where(pos == accept_len, targets, PLACEHOLDER))
    tl.store(output_ptr + req * output_width + pos, output, mask=pos < output_width)
    tl.store(accept_len_ptr + req, accept_len.to(tl.int64))


def _interpret_mode() -> bool:
    """See :func:`kernels.triton_mode.interpret_mode`."""
    return interpret_mode()


def _kernel_is_interpreted() -> bool:
    """Whether this module's kernel was decorated interpreted (see :mod:`kernels.triton_mode`)."""
    return is_interpreted(_greedy_verify_kernel)


def greedy_verify_triton(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_token_ids: torch.Tensor,
    max_num_draft_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`greedy_verify_ref` computed by the Triton kernel (same arguments and results).

    Raises:
        ValueError: see :func:`_validate`; or CPU tensors while the kernel is compiled (not
            interpreted).
        RuntimeError: CPU tensors with ``TRITON_INTERPRET=1`` set only after triton was
            imported (the kernel was already decorated for compilation).
    """
    max_num_draft_tokens = _validate(draft_token_ids, cu_num_draft_tokens, target_token_ids,
                                     max_num_draft_tokens)
    check_runnable(draft_token_ids.is_cuda, _greedy_verify_kernel)
    batch = cu_num_draft_tokens.numel()
    width = max_num_draft_tokens + 1
    device = draft_token_ids.device
    output = torch.empty((batch, width), dtype=torch.int64, device=device)
    accept_len = torch.empty((batch,), dtype=torch.int64, device=device)
    if batch == 0:
        return output, accept_len
    _greedy_verify_kernel[(batch,)](
        draft_token_ids.contiguous(), cu_num_draft_tokens.contiguous(),
        target_token_ids.contiguous(), output, accept_len, width,
        PLACEHOLDER=PLACEHOLDER_TOKEN_ID, BLOCK=triton.next_power_of_2(width), num_warps=1,
    )
    return output, accept_len


def greedy_verify(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_token_ids: torch.Tensor,
    max_num_draft_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: the Triton kernel on CUDA (or on CPU under ``TRITON_INTERPRET=1``), else the
    torch reference. Arguments, results and errors as :func:`greedy_verify_ref` (plus the
    RuntimeError of :func:`greedy_verify_triton`)."""
    on_cuda = isinstance(draft_token_ids, torch.Tensor) and draft_token_ids.is_cuda
    if on_cuda or _interpret_mode():
        return greedy_verify_triton(draft_token_ids, cu_num_draft_tokens, target_token_ids,
                                    max_num_draft_tokens)
    return greedy_verify_ref(draft_token_ids, cu_num_draft_tokens, target_token_ids,
                             max_num_draft_tokens)


__all__ = ["greedy_verify", "greedy_verify_ref", "greedy_verify_triton", "PLACEHOLDER_TOKEN_ID"]
