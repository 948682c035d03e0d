"""Block verification over a ragged batch (docs/architecture.md, 'Verification rules'): Algorithm 2
("block verification") of
Sun et al., "Block Verification Accelerates Speculative Decoding" (arXiv 2403.10444).

Inputs are those of :mod:`kernels.rejection_sample` (checked by its validator): request ``b``
has ``k_b >= 0`` drafts ``draft_token_ids[s_b : s_b + k_b]`` (``s_b = cu[b-1]``, ``cu[-1]``
read as 0) and ``k_b + 1`` target rows ``target_probs[s_b + b : s_b + b + k_b + 1]``; row ``j``
(``t_j``) is the target's distribution after the committed prefix and the first ``j`` drafts,
row ``k_b`` the bonus position. ``draft_probs[s_b + j]`` (``q_j``) is the distribution draft
``j`` (``x_j``) was sampled from; ``None`` means one-hot drafts (``q_j = onehot(x_j)``: n-gram
or greedy drafters). ``uniform_samples[s_b + j]`` is ``eta_{j+1}``, ``exponential_noise[b]``
the noise of the request's one extra token.

The rule (the paper's notation with 1-based ``i``: ``X_i = x_{i-1}``, ``M_b(.|X^{i-1}) = t_{i-1}``,
``M_s(.|X^{i-1}) = q_{i-1}``), all in float64:

- residual weights along the block: ``p_0 = 1``,
  ``p_i = min(p_{i-1} * t_{i-1}[x_{i-1}] / q_{i-1}[x_{i-1}], 1)`` for ``i = 1..k``
  (``0`` when the numerator is 0, ``1`` when it reaches the denominator; one-hot drafts:
  ``p_i = p_{i-1} * t_{i-1}[x_{i-1}]``);
- the residual mass at position ``i < k``: ``S_i = sum_x max(p_i * t_i[x] - q_i[x], 0)`` and the
  stopping probability ``h_i = S_i / (S_i + 1 - p_i)`` (``h_i = 1`` when ``S_i + 1 - p_i = 0``,
  i.e. ``p_i = 1`` and ``t_i <= q_i`` everywhere: nothing is owed to earlier positions);
  at the last position ``h_k = p_k``;
- position ``i`` passes iff ``eta_i < h_i``, tested as ``eta_i * (S_i + (1 - p_i)) < S_i``
  (or a zero denominator) for ``i < k`` and as ``eta_k * q_{k-1}[x_{k-1}] < p_{k-1} *
  t_{k-1}[x_{k-1}]`` for ``i = k`` (so a single draft is tested exactly as rejection sampling
  tests it);
- ``accept_len = tau = max {i in 1..k : position i passes}`` (0 when none does): the tests
  are not a prefix chain, a later pass accepts every draft before it (the block is accepted
  jointly);
- the extra token: ``tau = k``: the bonus token sampled from ``t_k``; ``tau < k``: the
  recovered token sampled from ``normalize(max(p_tau * t_tau - q_tau, 0))`` (``p_0 = 1``:
  rejection sampling's residual at ``tau = 0``).

The committed tokens ``x_0 .. x_{tau-1}, y`` continued by the target model follow the target's
distribution (the paper's guarantee; checked by exact enumeration and chi-square in the tests);
the expected ``accept_len`` is never below rejection sampling's and is optimal among valid
verifiers (the paper's example: ``t = (1/3, 2/3)``, ``q = (2/3, 1/3)`` context free, ``k = 2``:
11/9 against 10/9). With one-hot drafts both rules accept ``prod t_j[x_j]`` in expectation.

The extra token is the exponential race of :mod:`kernels.rejection_sample`, in float64:
``argmax(residual / exponential_noise[b])`` (first index among ties); when every residual
score is 0 (the residual vanished to rounding) the target row ``t_tau`` is sampled with the
same noise. Output row ``b``: ``drafts[:tau] + [recovered or bonus]`` padded with
:data:`PLACEHOLDER_TOKEN_ID` to ``max_num_draft_tokens + 1``.

The kernel sums ``S_i`` in another order than torch; a decision can differ only when
``eta_i`` lies within float64 rounding of ``h_i`` (probability ~1e-16 per test).

Entry points, one signature: :func:`block_verify_ref` (plain torch, the source of truth),
:func:`block_verify_triton` (the kernel: CUDA, or CPU under ``TRITON_INTERPRET=1``) and
:func:`block_verify` (launcher: CUDA or TRITON_INTERPRET -> kernel, else reference).
:func:`block_verify_noise` (= :func:`kernels.rejection_sample.rejection_sample_noise`) draws
the random inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmesh.kernels.constants import PLACEHOLDER_TOKEN_ID
from specmesh.kernels.race import running_argmax
from specmesh.kernels.ragged import num_drafts as _num_drafts
from specmesh.kernels.ragged import request_span
from specmesh.kernels.rejection_sample import _validate, rejection_sample_noise
from specmesh.kernels.triton_mode import check_runnable, interpret_mode, is_interpreted

#: The random inputs of :func:`block_verify`: ``(uniform_samples, exponential_noise)`` (one
#: uniform per draft, one noise row per request), as rejection sampling draws them.
block_verify_noise = rejection_sample_noise

#: Elements of one chunk of residual rows in the reference (bounds its float64 temporaries).
_REF_CHUNK_ELEMS = 1 << 22


def _residual_weight(p_prev: torch.Tensor, target_at: torch.Tensor,
                     draft_at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p_i, numerator)``: ``min(p_{i-1} * target / draft, 1)`` with its edge cases."""
    num = p_prev * target_at
    p = torch.where(num <= 0, 0.0, torch.where(num >= draft_at, 1.0, num / draft_at))
    return p, num


def block_verify_ref(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniform_samples: torch.Tensor,
    exponential_noise: torch.Tensor,
    max_num_draft_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification in plain torch (the source of truth). See the module docstring.

    Args:
        draft_token_ids: int64 ``[num_draft_total]``, the drafts of all requests, concatenated.
        cu_num_draft_tokens: int32/int64 ``[batch]``, inclusive cumsum of per-request draft
            counts (a request may have 0 drafts).
        draft_probs: ``[num_draft_total, V]`` (target_probs' dtype), the distributions the
            drafts were sampled from; None for one-hot drafts.
        target_probs: float32/float64 ``[num_draft_total + batch, V]``, ``k_b + 1`` rows per
            request, the last one the bonus position.
        uniform_samples: float32/float64 ``[num_draft_total]`` in ``[0, 1)``: ``eta_1 ..
            eta_k`` of each request.
        exponential_noise: ``[batch, V]`` (target_probs' dtype), ``Exp(1)`` samples ``> 0``,
            for the recovered or bonus token of each request.
        max_num_draft_tokens: width of the output minus one; computed when None. Must be
            >= every request's draft count.

    Returns:
        ``(output_token_ids, accept_len)``: int64 ``[batch, max_num_draft_tokens + 1]`` padded
        with ``PLACEHOLDER_TOKEN_ID``, and int64 ``[batch]``.

    Raises:
        ValueError: see :func:`kernels.rejection_sample._validate`.
    """
    width = _validate(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs,
                      uniform_samples, exponential_noise, max_num_draft_tokens) + 1
    device = draft_token_ids.device
    batch = cu_num_draft_tokens.numel()
    num_draft_total = draft_token_ids.numel()
    vocab = target_probs.shape[1]
    f64 = torch.float64
    if batch == 0:
        return (torch.empty((0, width), dtype=torch.int64, device=device),
                torch.empty((0,), dtype=torch.int64, device=device))
    num_drafts = _num_drafts(cu_num_draft_tokens)  # [batch]
    draft_start = cu_num_draft_tokens.to(torch.int64) - num_drafts  # [batch]
    req_ids = torch.arange(batch, device=device)
    req_of_draft = torch.repeat_interleave(req_ids, num_drafts, output_size=num_draft_total)
    draft_idx = torch.arange(num_draft_total, device=device)
    pos_of_draft = draft_idx - draft_start[req_of_draft]  # j: draft x_j tests position j + 1
    is_last = pos_of_draft == num_drafts[req_of_draft] - 1

    target_at = target_probs[draft_idx + req_of_draft, draft_token_ids].to(f64)
    if draft_probs is None:
        draft_at = torch.ones_like(target_at)
    else:
        draft_at = draft_probs[draft_idx, draft_token_ids].to(f64)
    u = uniform_samples.to(f64)

    # p_{j+1} and its numerator for every draft x_j: the recurrence runs along each block,
    # one position of every request at a time.
    p_after = torch.empty(num_draft_total, dtype=f64, device=device)
    num_at = torch.empty(num_draft_total, dtype=f64, device=device)
    p_prev = torch.ones(batch, dtype=f64, device=device)
    for j in range(int(num_drafts.max()) if num_draft_total else 0):
        active = num_drafts > j
        idx = (draft_start + j)[active]
        p, num = _residual_weight(p_prev[active], target_at[idx], draft_at[idx])
        p_after[idx], num_at[idx] = p, num
        p_prev[active] = p

    # Position i = j + 1 < k: eta_i < h_i = S_i / (S_i + 1 - p_i), S_i over target row i (the
    # row after x_j) and draft row i (the distribution of x_{j+1}).
    passed = torch.zeros(num_draft_total, dtype=torch.bool, device=device)
    inner = (~is_last).nonzero()[:, 0]
    rows_per_chunk = max(1, _REF_CHUNK_ELEMS // vocab)
    vocab_ids = torch.arange(vocab, device=device)[None, :]
    for c in range(0, inner.numel(), rows_per_chunk):
        g = inner[c: c + rows_per_chunk]
        t_next = target_probs[g + req_of_draft[g] + 1].to(f64)
        if draft_probs is None:
            q_next = (vocab_ids == draft_token_ids[g + 1][:, None]).to(f64)
        else:
            q_next = draft_probs[g + 1].to(f64)
        s = torch.clamp(p_after[g][:, None] * t_next - q_next, min=0).sum(dim=1)
        den = s + (1.0 - p_after[g])
        passed[g] = (den == 0) | (u[g] * den < s)
    # Position k: eta_k < h_k = p_k, as eta_k * q < p_{k-1} * t.
    last = is_last.nonzero()[:, 0]
    passed[last] = u[last] * draft_at[last] < num_at[last]

    # accept_len = the last passing position (0 when none passes).
    score = torch.where(passed, pos_of_draft + 1, 0)
    accept_len = torch.zeros(batch, dtype=torch.int64, device=device)
    accept_len.scatter_reduce_(0, req_of_draft, score, reduce="amax")

    # The extra token: the residual at tau < k with weight p_tau, the bonus row at tau = k.
    recovered = accept_len < num_drafts
    target_row = target_probs[draft_start + req_ids + accept_len].to(f64)  # [batch, V]
    stop_idx = torch.where(recovered, draft_start + accept_len, 0)  # draft row tau
    p_tau = torch.ones(batch, dtype=f64, device=device)
    passed_tau = accept_len > 0
    if num_draft_total:
        p_tau = torch.where(passed_tau, p_after[(draft_start + accept_len - 1).clamp(min=0)],
                            p_tau)
        if draft_probs is None:
            draft_row = (vocab_ids == draft_token_ids[stop_idx][:, None]).to(f64)
        else:
            draft_row = draft_probs[stop_idx].to(f64)
        residual = torch.clamp(p_tau[:, None] * target_row - draft_row, min=0)
        residual = torch.where(recovered[:, None], residual, target_row)
    else:
        residual = target_row
    noise = exponential_noise.to(f64)
    scores = residual / noise
    fallback = scores.amax(dim=1) == 0  # residual vanished: sample the target row
    scores = torch.where(fallback[:, None], target_row / noise, scores)
    extra = scores.argmax(dim=1)  # first index among ties

    pos = torch.arange(width, device=device)[None, :]
    is_draft = pos < num_drafts[:, None]
    padded_idx = torch.where(is_draft, draft_start[:, None] + pos, num_draft_total)
    drafts = torch.cat([draft_token_ids, draft_token_ids.new_full((1,), PLACEHOLDER_TOKEN_ID)])
    drafts = drafts[padded_idx]
    accepted_pos = accept_len[:, None]
    output = torch.where(pos < accepted_pos, drafts,
                         torch.where(pos == accepted_pos, extra[:, None], PLACEHOLDER_TOKEN_ID))
    return output, accept_len


@triton.jit
def _block_verify_kernel(
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
    """One program per request: the residual weights along the block with one pass over the
    vocabulary per inner position (``S_i``), the last passing position, then one pass for the
    recovered or bonus token (running first-index argmax, float64)."""
    req = tl.program_id(0).to(tl.int64)
    draft_start, num_drafts = request_span(cu_ptr, req)

    p = tl.full([], 1.0, tl.float64)  # p_j before draft x_j
    tau = tl.zeros([], tl.int64)
    p_tau = tl.full([], 1.0, tl.float64)
    # inner positions i = j + 1 < k
    for j in range(0, num_drafts - 1):
        g = draft_start + j
        tok = tl.load(draft_ptr + g)
        t_at = tl.load(target_probs_ptr + (g + req) * vocab_size + tok).to(tl.float64)
        if HAS_DRAFT_PROBS:
            q_at = tl.load(draft_probs_ptr + g * vocab_size + tok).to(tl.float64)
        else:
            q_at = tl.full([], 1.0, tl.float64)
        num = p * t_at
        p = tl.where(num <= 0, 0.0, tl.where(num >= q_at, 1.0, num / q_at))
        next_tok = tl.load(draft_ptr + g + 1)
        t_next = target_probs_ptr + (g + req + 1) * vocab_size
        q_next = draft_probs_ptr + (g + 1) * vocab_size
        s = tl.zeros([], tl.float64)
        for off in range(0, vocab_size, BLOCK_V):
            cols = off + tl.arange(0, BLOCK_V).to(tl.int64)
            in_vocab = cols < vocab_size
            t = tl.load(t_next + cols, mask=in_vocab, other=0).to(tl.float64)
            if HAS_DRAFT_PROBS:
                q = tl.load(q_next + cols, mask=in_vocab, other=0).to(tl.float64)
            else:
                q = tl.where(cols == next_tok, 1.0, 0.0).to(tl.float64)
            s += tl.sum(tl.maximum(p * t - q, 0.0), axis=0)
        den = s + (1.0 - p)
        u = tl.load(uniform_ptr + g).to(tl.float64)
        passed = (den == 0) | (u * den < s)
        tau = tl.where(passed, j + 1, tau)
        p_tau = tl.where(passed, p, p_tau)
    # last position k: eta_k * q < p_{k-1} * t
    has_drafts = num_drafts > 0
    g = draft_start + tl.maximum(num_drafts - 1, 0)
    tok = tl.load(draft_ptr + g, mask=has_drafts, other=0)
    t_at = tl.load(target_probs_ptr + (g + req) * vocab_size + tok, mask=has_drafts,
                   other=0).to(tl.float64)
    if HAS_DRAFT_PROBS:
        q_at = tl.load(draft_probs_ptr + g * vocab_size + tok, mask=has_drafts,
                       other=1).to(tl.float64)
    else:
        q_at = tl.full([], 1.0, tl.float64)
    u = tl.load(uniform_ptr + g, mask=has_drafts, other=1).to(tl.float64)
    passed = has_drafts & (u * q_at < p * t_at)
    tau = tl.where(passed, num_drafts, tau)

    recovered = tau < num_drafts
    p_tau = tl.where(tau > 0, p_tau, 1.0)
    target_row = target_probs_ptr + (draft_start + req + tau) * vocab_size
    stop_row = draft_start + tl.where(recovered, tau, 0)
    stop_tok = tl.load(draft_ptr + stop_row, mask=recovered, other=-1)
    draft_row = draft_probs_ptr + stop_row * vocab_size
    noise_row = noise_ptr + req * vocab_size

    best_res = tl.full([], -1.0, tl.float64)
    best_res_idx = tl.zeros([], tl.int64)
    best_tgt = tl.full([], -1.0, tl.float64)
    best_tgt_idx = tl.zeros([], tl.int64)
    for off in range(0, vocab_size, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V).to(tl.int64)
        in_vocab = cols < vocab_size
        t = tl.load(target_row + cols, mask=in_vocab, other=0).to(tl.float64)
        e = tl.load(noise_row + cols, mask=in_vocab, other=1).to(tl.float64)
        if HAS_DRAFT_PROBS:
            # draft row only after a rejection (the bonus position has none)
            q = tl.load(draft_row + cols, mask=cols < tl.where(recovered, vocab_size, 0),
                        other=0).to(tl.float64)
        else:
            q = tl.where(cols == stop_tok, 1.0, 0.0).to(tl.float64)
        res = tl.where(recovered, tl.maximum(p_tau * t - q, 0.0), t)
        s_res = tl.where(in_vocab, res / e, -1.0)
        s_tgt = tl.where(in_vocab, t / e, -1.0)
        best_res, best_res_idx = running_argmax(s_res, off, best_res, best_res_idx)
        best_tgt, best_tgt_idx = running_argmax(s_tgt, off, best_tgt, best_tgt_idx)
    extra = tl.where(best_res == 0, best_tgt_idx, best_res_idx)

    pos = tl.arange(0, BLOCK)
    is_draft = pos < num_drafts
    drafts = tl.load(draft_ptr + draft_start + pos, mask=is_draft, other=PLACEHOLDER)
    output = tl.where(pos < tau, drafts, tl.where(pos == tau, extra, PLACEHOLDER))
    tl.store(output_ptr + req * output_width + pos, output, mask=pos < output_width)
    tl.store(accept_len_ptr + req, tau)


def _interpret_mode() -> bool:
    """See :func:`kernels.triton_mode.interpret_mode`."""
    return interpret_mode()


def _kernel_is_interpreted() -> bool:
    """Whether this module's kernel was decorated interpreted (see :mod:`kernels.triton_mode`)."""
    return is_interpreted(_block_verify_kernel)


def block_verify_triton(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniform_samples: torch.Tensor,
    exponential_noise: torch.Tensor,
    max_num_draft_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_verify_ref` computed by the Triton kernel (same arguments, results).

    Raises:
        ValueError: see :func:`kernels.rejection_sample._validate`; or CPU tensors while the
            kernel is compiled (not interpreted).
        RuntimeError: CPU tensors with ``TRITON_INTERPRET=1`` set only after triton was
            imported (the kernel was already decorated for compilation).
    """
    max_num_draft_tokens = _validate(draft_token_ids, cu_num_draft_tokens, draft_probs,
                                     target_probs, uniform_samples, exponential_noise,
                                     max_num_draft_tokens)
    check_runnable(draft_token_ids.is_cuda, _block_verify_kernel)
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
    # enable_fp_fusion=False: no fused multiply-add, so p * t - q rounds as torch's does
    _block_verify_kernel[(batch,)](
        draft_token_ids.contiguous(), cu_num_draft_tokens.contiguous(),
        draft_probs.contiguous() if has_draft_probs else target_probs, target_probs,
        uniform_samples.contiguous(), exponential_noise.contiguous(), output, accept_len,
        width, vocab, HAS_DRAFT_PROBS=has_draft_probs, PLACEHOLDER=PLACEHOLDER_TOKEN_ID,
        BLOCK=triton.next_power_of_2(width),
        BLOCK_V=min(2048, triton.next_power_of_2(vocab)), num_warps=4,
        enable_fp_fusion=False,
    )
    return output, accept_len


def block_verify(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniform_samples: torch.Tensor,
    exponential_noise: torch.Tensor,
    max_num_draft_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: the Triton kernel on CUDA (or on CPU under ``TRITON_INTERPRET=1``), else the
    torch reference. Arguments, results and errors as :func:`block_verify_ref` (plus the
    RuntimeError of :func:`block_verify_triton`)."""
    on_cuda = isinstance(draft_token_ids, torch.Tensor) and draft_token_ids.is_cuda
    fn = block_verify_triton if on_cuda or _interpret_mode() else block_verify_ref
    return fn(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, uniform_samples,
              exponential_noise, max_num_draft_tokens)


__all__ = ["block_verify", "block_verify_noise", "block_verify_ref", "block_verify_triton"]
