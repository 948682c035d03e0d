"""The ragged draft layout every verification op shares: request ``b`` has
``k_b = cu[b] - cu[b-1]`` drafts (``cu`` = ``cu_num_draft_tokens``, an inclusive cumsum,
``cu[-1]`` read as 0) and ``k_b + 1`` target rows; its output row is ``max_k + 1`` wide.
The checks here are the ones greedy, rejection and coupled verification make alike, and
:func:`request_span` is how every Triton kernel finds its request's drafts."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: dtypes of ``cu_num_draft_tokens``.
CU_DTYPES = (torch.int32, torch.int64)


def num_drafts(cu_num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """Per-request draft counts ``[batch]`` (int64) from the inclusive cumsum."""
    cu = cu_num_draft_tokens.to(torch.int64)
    return torch.diff(cu, prepend=cu.new_zeros(1))


def resolve_max_num_draft_tokens(
    cu_num_draft_tokens: torch.Tensor, num_draft_total: int, max_num_draft_tokens: int | None,
) -> tuple[int, list[int] | None]:
    """Check ``max_num_draft_tokens`` and ``cu`` against ``num_draft_total`` drafts; return the
    output width minus one (computed when None) and the per-request counts (None on CUDA, where
    only the max is computed, one sync, and only when it is None).

    Raises:
        ValueError: ``max_num_draft_tokens`` not an int >= 0; drafts for an empty batch; a
            ``cu`` that decreases or does not end at ``num_draft_total``; a request with more
            drafts than ``max_num_draft_tokens``.
    """
    if max_num_draft_tokens is not None and (
            isinstance(max_num_draft_tokens, bool) or not isinstance(max_num_draft_tokens, int)
            or max_num_draft_tokens < 0):
        raise ValueError(f"max_num_draft_tokens must be an int >= 0, got {max_num_draft_tokens!r}")
    if cu_num_draft_tokens.numel() == 0:
        if num_draft_total:
            raise ValueError("drafts given for an empty batch")
        return max_num_draft_tokens or 0, []
    if cu_num_draft_tokens.is_cuda:
        if max_num_draft_tokens is None:
            max_num_draft_tokens = int(num_drafts(cu_num_draft_tokens).max())
        return max_num_draft_tokens, None
    cu = cu_num_draft_tokens.tolist()
    counts = [cu[0]] + [b - a for a, b in zip(cu, cu[1:])]
    if min(counts) < 0:
        raise ValueError(f"cu_num_draft_tokens must be a non-decreasing cumsum >= 0, got {cu}")
    if cu[-1] != num_draft_total:
        raise ValueError(f"cu_num_draft_tokens ends at {cu[-1]}, draft_token_ids has "
                         f"{num_draft_total} tokens")
    if max_num_draft_tokens is None:
        return max(counts), counts
    if max(counts) > max_num_draft_tokens:
        raise ValueError(f"a request has {max(counts)} drafts > max_num_draft_tokens="
                         f"{max_num_draft_tokens}")
    return max_num_draft_tokens, counts


@triton.jit
def request_span(cu_ptr, req):
    """``(start, count)`` of request ``req``'s drafts (tree nodes) in the ragged layout, int64
    scalars, read from the inclusive cumsum at ``cu_ptr`` (int32 or int64)."""
    end = tl.load(cu_ptr + req).to(tl.int64)
    prev_end = tl.load(cu_ptr + tl.maximum(req - 1, 0)).to(tl.int64)
    start = tl.where(req > 0, prev_end, 0)
    return start, end - start
