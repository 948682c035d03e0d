"""Standard rejection sampling over a ragged batch (docs/architecture.md, 'Verification rules'):
speculative sampling of
Leviathan et al. (arXiv 2211.17192) and Chen et al. (arXiv 2302.01318), as vLLM's rejection
sampler.

Request ``b`` has ``k_b >= 0`` drafts ``draft_token_ids[cu[b-1]:cu[b]]`` (``cu[-1]`` read as 0)
and ``k_b + 1`` target rows ``target_probs[cu[b-1] + b : cu[b] + b + 1]``: row ``j`` is the
target's (processed) distribution after the committed prefix and the first ``j`` drafts; the
last row is the bonus position. ``draft_probs[i]`` is the distribution draft ``i`` was sampled
from; ``None`` means one-hot drafts (n-gram or greedy drafters: the draft was proposed with
probability 1).

Draft ``j`` (token ``x``) is accepted iff ``uniform_samples[i] * draft_probs[i, x] <
target_probs[row, x]`` (i.e. ``u < min(1, target/draft)``; computed in float64, for one-hot
drafts ``u < target_probs[row, x]``); ``accept_len`` is the number of drafts before the first
rejection. One more token follows the accepted drafts:

- after a rejection at ``j``, the ``recovered_token_id`` sampled from
  ``normalize(max(target_probs[row_j] - draft_probs[i_j], 0))`` (one-hot drafts: the target
  with the rejected token removed);
- when every draft passed, the ``bonus_token_id`` sampled from the last target row.

That token is the exponential race (the Gumbel-max trick: ``argmax(p / E)`` with ``E ~ Exp(1)``
is a sample of ``normalize(p)``) over ``exponential_noise[b]``: the row's scores are
``residual / exponential_noise[b]`` divided with IEEE rounding in the probabilities' dtype,
argmax first index among ties. One noise row per request suffices (as in vLLM): exactly one
token per request is drawn from it, at a position fixed by the acceptance tests, which do not
look at that noise. When every residual score is 0 (the residual vanished, e.g. rounding with
target ≈ draft), the target row itself is sampled with the same noise.

Output row ``b``: ``drafts[:accept_len] + [recovered or bonus]`` padded with
:data:`PLACEHOLDER_TOKEN_ID` to ``max_num_draft_tokens + 1``.

Entry points, one signature: :func:`rejection_sample_ref` (plain torch, the source of truth),
:func:`rejection_sample_triton` (the kernel: CUDA, or CPU under ``TRITON_INTERPRET=1``) and
:func:`rejection_sample` (launcher: CUDA or TRITON_INTERPRET → kernel, else reference).
:func:`rejection_sample_noise` draws the random inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmesh.kernels.constants import PLACEHOLDER_TOKEN_ID
from specmesh.kernels.race import ieee_div, running_argmax
from specmesh.kernels.ragged import CU_DTYPES, request_span, resolve_max_num_draft_tokens
from specmesh.kernels.ragged import num_drafts as _num_drafts
from specmesh.kernels.triton_mode import check_runnable, interpret_mode, is_interpreted

_CU_DTYPES = CU_DTYPES
_PROB_DTYPES = (torch.float32, torch.float64)
_UNIFORM_DTYPES = (torch.float32, torch.float64)


def _validate(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniform_samples: torch.Tensor,
    exponential_noise: torch.Tensor,
    max_num_draft_tokens: int | None,
    noise_per_row: bool = False,
) -> int:
    """Check the inputs; return ``max_num_draft_tokens`` (computed when None).
    ``noise_per_row`` also admits ``exponential_noise`` with one row per target row
    (``[num_draft_total + batch, V]``, tree verification's layout).

    Content checks (``cu`` a non-decreasing cumsum ending at ``num_draft_total``, counts within
    ``max_num_draft_tokens``, draft ids in ``[0, V)``, ``0 <= uniform_samples < 1``,
    ``exponential_noise > 0`` and finite) need the values on the host: they run for CPU tensors;
    on CUDA only the max count is computed (one sync) when ``max_num_draft_tokens`` is None.

    Raises:
        ValueError: wrong type, rank, dtype, device or sizes; inconsistent ``cu``; a request
            with more drafts than ``max_num_draft_tokens``; out-of-range values (CPU).
    """
    tensors = {"draft_token_ids": draft_token_ids, "cu_num_draft_tokens": cu_num_draft_tokens,
               "target_probs": target_probs, "uniform_samples": uniform_samples,
               "exponential_noise": exponential_noise}
    if draft_probs is not None:
        tensors["draft_probs"] = draft_probs
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name in ("draft_token_ids", "cu_num_draft_tokens", "uniform_samples"):
        if tensors[name].dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(tensors[name].shape)}")
    for name in ("target_probs", "exponential_noise", "draft_probs"):
        if name in tensors and tensors[name].dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(tensors[name].shape)}")
    if draft_token_ids.dtype != torch.int64:
        raise ValueError(f"draft_token_ids must be int64, got {draft_token_ids.dtype}")
    if cu_num_draft_tokens.dtype not in _CU_DTYPES:
        raise ValueError(f"cu_num_draft_tokens must be int32 or int64, "
                         f"got {cu_num_draft_tokens.dtype}")
    if target_probs.dtype not in _PROB_DTYPES:
        raise ValueError(f"target_probs must be float32 or float64, got {target_probs.dtype}")
    for name in ("draft_probs", "exponential_noise"):
        if name in tensors and tensors[name].dtype != target_probs.dtype:
            raise ValueError(f"{name} must have target_probs' dtype {target_probs.dtype}, "
                             f"got {tensors[name].dtype}")
    if uniform_samples.dtype not in _UNIFORM_DTYPES:
        raise ValueError(f"uniform_samples must be float32 or float64, "
                         f"got {uniform_samples.dtype}")
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"inputs are on different devices: {sorted(map(str, devices))}")
    batch = cu_num_draft_tokens.numel()
    num_draft_total = draft_token_ids.numel()
    vocab = target_probs.shape[1]
    if vocab == 0:
        raise ValueError("target_probs has an empty vocabulary")
    if target_probs.shape[0] != num_draft_total + batch:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows, expected "
                         f"num_draft_total + batch = {num_draft_total} + {batch}")
    if draft_probs is not None and tuple(draft_probs.shape) != (num_draft_total, vocab):
        raise ValueError(f"draft_probs must be [{num_draft_total}, {vocab}], "
                         f"got {tuple(draft_probs.shape)}")
    if uniform_samples.numel() != num_draft_total:
        raise ValueError(f"uniform_samples has {uniform_samples.numel()} values, expected "
                         f"num_draft_total = {num_draft_total}")
    noise_rows = (batch, num_draft_total + batch) if noise_per_row else (batch,)
    if exponential_noise.shape[0] not in noise_rows or exponential_noise.shape[1] != vocab:
        raise ValueError(f"exponential_noise must be [{' or '.join(map(str, noise_rows))}, "
                         f"{vocab}], got {tuple(exponential_noise.shape)}")
    max_num_draft_tokens, counts = resolve_max_num_draft_tokens(
        cu_num_draft_tokens, num_draft_total, max_num_draft_tokens)
    if counts is None:  # CUDA: content checks need the values on the host
        return max_num_draft_tokens
    if num_draft_total and not bool(((draft_token_ids >= 0) & (draft_token_ids < vocab)).all()):
        raise ValueError(f"draft_token_ids must be in [0, {vocab})")
    if not bool(((uniform_samples >= 0) & (uniform_samples < 1)).all()):
        raise ValueError("uniform_samples must be in [0, 1)")
    if not bool(((exponential_noise > 0) & torch.isfinite(exponential_noise)).all()):
        raise ValueError("exponential_noise must be finite and > 0")
    return max_num_draft_tokens


def rejection_sample_noise(
    cu_num_draft_tokens: torch.Tensor,
    vocab_size: int,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The random inputs of :func:`rejection_sample`: ``(uniform_samples, exponential_noise)``.

    Returns:
        float64 ``[num_draft_total]`` uniform in ``[0, 1)`` and ``dtype`` ``[batch, V]``
        ``Exp(1)`` samples clamped to the smallest normal (never 0), on
        ``cu_num_draft_tokens``' device (``generator`` must be on that device).
    """
    device = cu_num_draft_tokens.device
    batch = cu_num_draft_tokens.numel()
    total = int(cu_num_draft_tokens[-1]) if batch else 0
    uniform = torch.rand(total, dtype=torch.float64, device=device, generator=generator)
    noise = torch.empty((batch, vocab_size), dtype=dtype, device=device)
    noise.exponential_(generator=generator).clamp_(min=torch.finfo(dtype).tiny)
    return uniform, noise


def rejection_sample_ref(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniform_samples: torch.Tensor,
    exponential_noise: torch.Tensor,
    max_num_draft_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling in plain torch (the source of truth). See the module docstring.

    Args:
        draft_token_ids: int64 ``[num_draft_total]``, the drafts of all requests, concatenated.
        cu_num_draft_tokens: int32/int64 ``[batch]``, inclusive cumsum of per-request draft
            counts ``num_draft_tokens`` (a request may have 0 drafts).
        draft_probs: ``[num_draft_total, V]`` (target_probs' dtype), the distributions the
            drafts were sampled from; None for one-hot drafts.
        target_probs: float32/float64 ``[num_draft_total + batch, V]``, ``k_b + 1`` rows per
            request, the last one the bonus position.
        uniform_samples: float32/float64 ``[num_draft_total]`` in ``[0, 1)``, one acceptance
            test per draft.
        exponential_noise: ``[batch, V]`` (target_probs' dtype), ``Exp(1)`` samples ``> 0``,
            for the recovered or bonus token of each request.
        max_num_draft_tokens: width of the output minus one; computed when None. Must be
            >= every request's draft count.

    Returns:
        ``(output_token_ids, accept_len)``: int64 ``[batch, max_num_draft_tokens + 1]`` padded
        with ``PLACEHOLDER_TOKEN_ID``, and int64 ``[batch]``.

    Raises:
        ValueError: see :func:`_validate`.
    """
    width = _validate(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs,
                      uniform_samples, exponential_noise, max_num_draft_tokens) + 1
    device = draft_token_ids.device
    batch = cu_num_draft_tokens.numel()
    num_draft_total = draft_token_ids.numel()
    if batch == 0:
        return (torch.empty((0, width), dtype=torch.int64, device=device),
                torch.empty((0,), dtype=torch.int64, device=device))
    num_drafts = _num_drafts(cu_num_draft_tokens)  # [batch]
    draft_start = cu_num_draft_tokens.to(torch.int64) - num_drafts  # [batch]
    req_ids = torch.arange(batch, device=device)

    # Acceptance test of every draft, in float64.
    req_of_draft = torch.repeat_interleave(req_ids, num_drafts, output_size=num_draft_total)
    draft_idx = torch.arange(num_draft_total, device=device)
    target_at_draft = target_probs[draft_idx + req_of_draft, draft_token_ids].to(torch.float64)
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
    else:
        draft_at_draft = draft_probs[draft_idx, draft_token_ids].to(torch.float64)
    accepted = uniform_samples.to(torch.float64) * draft_at_draft < target_at_draft

    # accept_len: drafts before the first rejection ([batch, width] padded matrix).
    pos = torch.arange(width, device=device)[None, :]
    is_draft = pos < num_drafts[:, None]
    padded_idx = torch.where(is_draft, draft_start[:, None] + pos, num_draft_total)
    pad_false = torch.zeros(1, dtype=torch.bool, device=device)
    accept_matrix = torch.cat([accepted, pad_false])[padded_idx] & is_draft
    accept_len = accept_matrix.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [batch]

    # The extra token: recovered (rejection at accept_len) or bonus (accept_len == k).
    recovered = accept_len < num_drafts  # [batch]
    target_row = target_probs[draft_start + req_ids + accept_len]  # [batch, V]
    rejected_idx = torch.where(recovered, draft_start + accept_len, 0)
    if draft_probs is None:
        rejected_tok = draft_token_ids[rejected_idx] if num_draft_total else \
            torch.zeros(batch, dtype=torch.int64, device=device)
        vocab_ids = torch.arange(target_probs.shape[1], device=device)[None, :]
        residual = torch.where(vocab_ids == rejected_tok[:, None], 0.0, target_row)
    else:
        draft_row = draft_probs[rejected_idx] if num_draft_total else torch.zeros_like(target_row)
        residual = torch.clamp(target_row - draft_row, min=0)
    residual = torch.where(recovered[:, None], residual, target_row)
    scores = residual / exponential_noise
    fallback = scores.amax(dim=1) == 0  # residual vanished: sample the target row
    scores = torch.where(fallback[:, None], target_row / exponential_noise, scores)
    extra = scores.argmax(dim=1)  # first index among ties

    drafts = torch.cat([draft_token_ids, draft_token_ids.new_full((1,), PLACEHOLDER_TOKEN_ID)])
    drafts = drafts[padded_idx]
    accepted_pos = accept_len[:, None]
    output = torch.where(pos < accepted_pos, drafts,
                         torch.where(pos == accepted_pos, extra[:, None], PLACEHOLDER_TOKEN_ID))
    return output, accept_len


@triton.jit
def _rejection_sample_kernel(
    draft_ptr,  # int64 [num_draft_total]
    cu_ptr,  # int32/int64 [batch]
    draft_probs_ptr,  # [num_draft_total, V] (unused without HAS_DRAFT_PROBS)
    target_probs_ptr,  # [num_draft_total + batch, V]
    uniform_ptr,  # float32/float64 [num_draft_total]
    noise_ptr,  # [batch, V]
    output_ptr,  # int64 [batch, output_width]
    accept_len_ptr,  # int64 [batch]
    output_width,  # max_num_draft_tokens + 1
    vocab_size,
    HAS_DRAFT_PROBS: tl.constexpr,
    PLACEHOLDER: tl.constexpr,
    BLOCK: tl.constexpr,  # power of two >= output_width
    BLOCK_V: tl.constexpr,  # vocabulary chunk
):
    """One program per request: acceptance tests of its drafts (vectorized), then one pass
    over the vocabulary for the recovered or bonus token (running first-index argmax)."""
    req = tl.program_id(0).to(tl.int64)
    draft_start, num_drafts = request_span(cu_ptr, req)

    pos = tl.arange(0, BLOCK)
    is_draft = pos < num_drafts
    drafts = tl.load(draft_ptr + draft_start + pos, mask=is_draft, other=PLACEHOLDER)
    safe_drafts = tl.where(is_draft, drafts, 0)
    target_at = tl.load(target_probs_ptr + (draft_start + req + pos) * vocab_size + safe_drafts,
                        mask=is_draft, other=0).to(tl.float64)
    if HAS_DRAFT_PROBS:
        draft_at = tl.load(draft_probs_ptr + (draft_start + pos) * vocab_size + safe_drafts,
                           mask=is_draft, other=0).to(tl.float64)
    else:
        draft_at = tl.full([BLOCK], 1.0, tl.float64)
    u = tl.load(uniform_ptr + draft_start + pos, mask=is_draft, other=0).to(tl.float64)
    accepted = (u * draft_at < target_at) & is_draft
    # Position num_drafts (< BLOCK) always stops: accept_len <= num_drafts.
    accept_len = tl.min(tl.where(accepted, BLOCK, pos), axis=0).to(tl.int64)

    recovered = accept_len < num_drafts
    target_row = target_probs_ptr + (draft_start + req + accept_len) * vocab_size
    rejected_row = draft_start + tl.where(recovered, accept_len, 0)
    rejected_tok = tl.load(draft_ptr + rejected_row, mask=recovered, other=-1)
    draft_row = draft_probs_ptr + rejected_row * vocab_size
    noise_row = noise_ptr + req * vocab_size

    best_res = tl.full([], -1.0, target_probs_ptr.dtype.element_ty)
    best_res_idx = tl.zeros([], tl.int64)
    best_tgt = tl.full([], -1.0, target_probs_ptr.dtype.element_ty)
    best_tgt_idx = tl.zeros([], tl.int64)
    for off in range(0, vocab_size, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V).to(tl.int64)
        in_vocab = cols < vocab_size
        t = tl.load(target_row + cols, mask=in_vocab, other=0)
        q = tl.load(noise_row + cols, mask=in_vocab, other=1)
        if HAS_DRAFT_PROBS:
            # draft row only after a rejection (the bonus position has none)
            d = tl.load(draft_row + cols, mask=cols < tl.where(recovered, vocab_size, 0),
                        other=0)
            res = tl.maximum(t - d, 0.0)
        else:
            res = tl.where(cols == rejected_tok, 0.0, t)
        res = tl.where(recovered, res, t)
        s_res = tl.where(in_vocab, ieee_div(res, q), -1.0)
        s_tgt = tl.where(in_vocab, ieee_div(t, q), -1.0)
        best_res, best_res_idx = running_argmax(s_res, off, best_res, best_res_idx)
        best_tgt, best_tgt_idx = running_argmax(s_tgt, off, best_tgt, best_tgt_idx)
    extra = tl.where(best_res == 0, best_tgt_idx, best_res_idx)

    output = tl.where(pos < accept_len, drafts, tl.where(pos == accept_len, extra, PLACEHOLDER))
    tl.store(output_ptr + req * output_width + pos, output, mask=pos < output_width)
    tl.store(accept_len_ptr + req, accept_len)


def _interpret_mode() -> bool:
    """See :func:`kernels.triton_mode.interpret_mode`."""
    return interpret_mode()


def _kernel_is_interpreted() -> bool:
    """Whether this module's kernel was decorated interpreted (see :mod:`kernels.triton_mode`)."""
    return is_interpreted(_rejection_sample_kernel)


def rejection_sample_triton(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniform_samples: torch.Tensor,
    exponential_noise: torch.Tensor,
    max_num_draft_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rejection_sample_ref` computed by the Triton kernel (same arguments, results).

    Raises:
        ValueError: see :func:`_validate`; or CPU tensors while the kernel is compiled (not
            interpreted).
        RuntimeError: CPU tensors with ``TRITON_INTERPRET=1`` set only after triton was
            imported (the kernel was already decorated for compilation).
    """
    max_num_draft_tokens = _validate(draft_token_ids, cu_num_draft_tokens, draft_probs,
                                     target_probs, uniform_samples, exponential_noise,
                                     max_num_draft_tokens)
    check_runnable(draft_token_ids.is_cuda, _rejection_sample_kernel)
    batch = cu_num_draft_tokens.numel()
    width = max_num_draft_tokens + 1
    device = draft_token_ids.device
    output = torch.empty((batch, width), dtype=torch.int64, device=device)
    accept_len = torch.empty((batch,), dtype=torch.int64, device=device)
    if batch == 0:
        return output, accept_len
    vocab = target_probs.shape[1]
    target_probs = target_probs.contiguous()
    has_draft_probs = draft_probs is not None
    _rejection_sample_kernel[(batch,)](
        draft_token_ids.contiguous(), cu_num_draft_tokens.contiguous(),
        draft_probs.contiguous() if has_draft_probs else target_probs, target_probs,
        uniform_samples.contiguous(), exponential_noise.contiguous(), output, accept_len,
        width, vocab, HAS_DRAFT_PROBS=has_draft_probs, PLACEHOLDER=PLACEHOLDER_TOKEN_ID,
        BLOCK=triton.next_power_of_2(width),
        BLOCK_V=min(4096, triton.next_power_of_2(vocab)), num_warps=4,
    )
    return output, accept_len


def rejection_sample(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniform_samples: torch.Tensor,
    exponential_noise: torch.Tensor,
    max_num_draft_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: the Triton kernel on CUDA (or on CPU under ``TRITON_INTERPRET=1``), else the
    torch reference. Arguments, results and errors as :func:`rejection_sample_ref` (plus the
    RuntimeError of :func:`rejection_sample_triton`)."""
    on_cuda = isinstance(draft_token_ids, torch.Tensor) and draft_token_ids.is_cuda
    fn = rejection_sample_triton if on_cuda or _interpret_mode() else rejection_sample_ref
    return fn(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, uniform_samples,
              exponential_noise, max_num_draft_tokens)


__all__ = ["rejection_sample", "rejection_sample_noise", "rejection_sample_ref",
           "rejection_sample_triton"]
