"""Tree rejection sampling over a ragged batch (docs/architecture.md, 'Verification rules'):
SpecInfer's multi-step
speculative sampling (Miao et al., "SpecInfer", arXiv 2305.09781, Algorithm 2 "multi-step
speculative sampling"; the sibling-by-sibling residual of Chen et al. 2302.01318), in the layout
of :mod:`kernels.tree_layout` (node numbering, ``parents``, target rows, results).

:func:`tree_rejection_sample` (sampled requests): at node ``u`` the residual ``r`` starts as
target row ``u``; child ``c`` (token ``x``, drawn from ``q = draft_probs[c]``, or ``q = e_x``
for one-hot drafts when ``draft_probs`` is None) is accepted iff ``uniform[c] * q[x] < r[x]``
(``u < min(1, r[x] / q[x])``, in float64); on acceptance the walk moves to ``c``, else
``r <- normalize(max(r - q, 0))`` (one-hot: ``r`` with ``x`` removed) and the next sibling is
tried. When no child is accepted the extra token is sampled from ``r``: the recovered token
after a rejection, else the bonus token from the target row. Each step is a speculative
sampling step whose target is the distribution still owed, so the emitted tokens follow the
target exactly when the siblings are drawn independently, each from its ``draft_probs`` row
(i.i.d. from one ``q`` included), and for any fixed tokens with one-hot drafts (distinct or
repeated: a repeated rejected token has ``r[x] = 0``).

Arithmetic of :func:`tree_rejection_sample` (kernel and reference alike). The residual is kept
as a row ``R`` in the probabilities' dtype and a float64 mass ``S``, ``r = R / S`` (float64
division, rounded to the dtype). At node ``u``: ``R = target row u``, ``S = 1`` (so ``r`` is the
target row itself, bit for bit). A rejection computes ``D = max(r - q, 0)`` in the dtype
(one-hot: ``r`` with ``x`` zeroed) and ``Z = sum(D)`` in float64; ``R, S = D, Z`` when ``Z > 0``.
When ``Z == 0`` (``r <= q`` everywhere: with exact sums ``r == q``, and the rejection had
probability 0 unless ``x`` was a token ``q`` cannot draw, so it comes from rounding or a bad
drafter) the rejection leaves ``r`` as it was: the distribution still owed is unchanged (``r`` is
within rounding of ``q``); falling back to the target row would over-weight the siblings already
rejected. The extra token is the exponential race of :mod:`kernels.race` over ``R``, as
:mod:`kernels.rejection_sample` draws it: ``argmax(R / exponential_noise[row])`` (IEEE division
in the dtype, first index among ties; the scale ``S`` does not change the argmax); when every
score is 0 (underflow) the target row of the stop node is raced instead. On a chain all of
this is :func:`kernels.rejection_sample.rejection_sample_ref` bit for bit: the first child of a
node always sees ``S = 1``.

The noise: ``exponential_noise`` has one row per target row (``[num_draft_total + batch, V]``,
the row of the stop node is read) or one per request (``[batch, V]``, as rejection sampling).
Either is exact: the stop node is decided by the uniforms only, so the row raced is independent
of the noise. The kernel sums ``Z`` in another order than torch; a decision differs only when a
uniform or a score lies within float64 rounding of its threshold (probability ~1e-16 per test,
~1e-9 per token for float32 rows).

Entry points: :func:`tree_rejection_sample_ref` (plain torch, the source of truth, any device),
:func:`tree_rejection_sample_triton` (the kernel: CUDA, or CPU under ``TRITON_INTERPRET=1``)
and :func:`tree_rejection_sample` (the launcher: CUDA or TRITON_INTERPRET -> kernel, else
reference); :func:`tree_rejection_sample_noise` draws the random inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmesh.kernels.constants import PLACEHOLDER_TOKEN_ID
from specmesh.kernels.race import ieee_div, running_argmax
from specmesh.kernels.rejection_sample import _validate as _validate_rejection
from specmesh.kernels.rejection_sample import rejection_sample_noise
from specmesh.kernels.tree_layout import (
    TreeResult,
    Walk,
    allocate_result,
    check_parents,
    request_span,
    store_result,
    use_kernel,
)
from specmesh.kernels.triton_mode import check_runnable, is_interpreted


def _validate_sample(draft_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                     parents: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, uniform_samples: torch.Tensor,
                     exponential_noise: torch.Tensor, max_depth: int | None) -> int:
    """Rejection sampling's checks (noise per request or per row), then
    :func:`kernels.tree_layout.check_parents`; returns ``max_depth``."""
    _validate_rejection(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs,
                         uniform_samples, exponential_noise, None, noise_per_row=True)
    return check_parents(parents, draft_token_ids, cu_num_draft_tokens, max_depth)


def tree_rejection_sample_noise(
    cu_num_draft_tokens: torch.Tensor,
    vocab_size: int,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
    per_row: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The random inputs of :func:`tree_rejection_sample`: ``(uniform_samples,
    exponential_noise)``: float64 ``[num_draft_total]`` uniform in ``[0, 1)``, one per node,
    and ``dtype`` ``Exp(1)`` rows clamped to the smallest normal, ``[num_draft_total + batch,
    V]`` (one per target row) or, with ``per_row=False``, ``[batch, V]`` (one per request,
    :func:`kernels.rejection_sample.rejection_sample_noise` exactly: V times fewer draws per
    node, equally exact). On ``cu_num_draft_tokens``' device (``generator`` must be there)."""
    if not per_row:
        return rejection_sample_noise(cu_num_draft_tokens, vocab_size, dtype,
                                                 generator)
    device = cu_num_draft_tokens.device
    batch = cu_num_draft_tokens.numel()
    total = int(cu_num_draft_tokens[-1]) if batch else 0
    uniform = torch.rand(total, dtype=torch.float64, device=device, generator=generator)
    noise = torch.empty((total + batch, vocab_size), dtype=dtype, device=device)
    noise.exponential_(generator=generator).clamp_(min=torch.finfo(dtype).tiny)
    return uniform, noise


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def tree_rejection_sample_ref(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniform_samples: torch.Tensor,
    exponential_noise: torch.Tensor,
    max_depth: int | None = None,
) -> TreeResult:
    """Multi-step speculative sampling over trees in plain torch (the source of truth). See the
    module docstring for the rule and its arithmetic.

    Args:
        draft_token_ids, cu_num_draft_tokens, parents, max_depth: as
            :func:`kernels.tree_walk.tree_walk_ref`.
        draft_probs: ``[num_draft_total, V]`` (target_probs' dtype): row ``c`` is the
            distribution node ``c`` was drawn from (given its parent); None for one-hot drafts.
        target_probs: float32/float64 ``[num_draft_total + batch, V]``, ``k_b + 1`` rows per
            request (row 0: after the root; row ``1 + j``: after node ``j``).
        uniform_samples: float32/float64 ``[num_draft_total]`` in ``[0, 1)``, one per node.
        exponential_noise: ``Exp(1)`` samples ``> 0`` (target_probs' dtype), ``[num_draft_total
            + batch, V]`` (per row) or ``[batch, V]`` (per request).

    Returns:
        ``(output_token_ids [batch, max_depth + 1], accept_len [batch],
        accepted_node_ids [batch, max_depth])``, int64.

    Raises:
        ValueError: see :func:`kernels.rejection_sample._validate` and
            :func:`kernels.tree_layout.check_parents`.
    """
    width = _validate_sample(draft_token_ids, cu_num_draft_tokens, parents, draft_probs,
                             target_probs, uniform_samples, exponential_noise, max_depth) + 1
    device = draft_token_ids.device
    batch = cu_num_draft_tokens.numel()
    if batch == 0:
        return allocate_result(0, width, device)
    f64, dtype = torch.float64, target_probs.dtype
    walk = Walk(cu_num_draft_tokens, width, device)
    residual = target_probs[walk.row]  # R [batch, V]
    mass = torch.ones(batch, dtype=f64, device=device)  # S: the residual is R / S
    vocab_ids = torch.arange(target_probs.shape[1], device=device)[None, :]
    for j in range(int(walk.counts.max())):
        child, index = walk.children(j, parents)
        if not bool(child.any()):
            continue
        tokens = draft_token_ids[index]
        r = (residual.to(f64) / mass[:, None]).to(dtype)  # [batch, V]
        r_at = r.gather(1, tokens[:, None])[:, 0].to(f64)
        if draft_probs is None:
            draft_at = torch.ones_like(r_at)
            rest = torch.where(vocab_ids == tokens[:, None], 0.0, r)
        else:
            q = draft_probs[index]
            draft_at = q.gather(1, tokens[:, None])[:, 0].to(f64)
            rest = torch.clamp(r - q, min=0)
        accepted = child & (uniform_samples[index].to(f64) * draft_at < r_at)
        rest_mass = rest.to(f64).sum(dim=1)
        update = child & ~accepted & (rest_mass > 0)
        residual = torch.where(update[:, None], rest, residual)
        mass = torch.where(update, rest_mass, mass)
        walk.move(accepted, j, tokens)
        residual = torch.where(accepted[:, None], target_probs[walk.row], residual)
        mass = torch.where(accepted, 1.0, mass)
    per_row = exponential_noise.shape[0] != batch
    noise = exponential_noise[walk.row if per_row else walk.req]
    target_row = target_probs[walk.row]
    scores = residual / noise
    fallback = scores.amax(dim=1) == 0  # every score underflowed: race the target row
    scores = torch.where(fallback[:, None], target_row / noise, scores)
    return walk.result(scores.argmax(dim=1))  # first index among ties


# --------------------------------------------------------------------------------------------
# Triton kernel, entry and launcher
# --------------------------------------------------------------------------------------------


@triton.jit
def _rest_chunk(residual_ptr, scratch_row, in_scratch, mass, draft_row, token, cols, vocab_size,
                HAS_DRAFT_PROBS: tl.constexpr):
    """``max(r - q, 0)`` (one-hot: ``r`` with ``token`` zeroed) on the vocabulary chunk
    ``cols``, with ``r = R / S`` rounded to the dtype and ``R`` in the scratch row or at
    ``residual_ptr`` (the target row); 0 past the vocabulary."""
    in_vocab = cols < vocab_size
    from_scratch = tl.load(scratch_row + cols, mask=cols < tl.where(in_scratch, vocab_size, 0),
                           other=0)
    from_target = tl.load(residual_ptr + cols, mask=cols < tl.where(in_scratch, 0, vocab_size),
                          other=0)
    stored = tl.where(in_scratch, from_scratch, from_target)
    r = (stored.to(tl.float64) / mass).to(stored.dtype)
    if HAS_DRAFT_PROBS:
        q = tl.load(draft_row + cols, mask=in_vocab, other=0)
        rest = tl.maximum(r - q, 0.0)
    else:
        rest = tl.where(cols == token, 0.0, r)
    return tl.where(in_vocab, rest, 0.0)


@triton.jit
def _tree_rejection_sample_kernel(
    draft_ptr,  # int64 [num_draft_total]
    cu_ptr,  # int32/int64 [batch]
    parents_ptr,  # int64 [num_draft_total]
    draft_probs_ptr,  # [num_draft_total, V] (unused without HAS_DRAFT_PROBS)
    target_probs_ptr,  # [num_draft_total + batch, V]
    uniform_ptr,  # float32/float64 [num_draft_total]
    noise_ptr,  # [num_draft_total + batch, V] or [batch, V]
    scratch_ptr,  # [batch, V], target_probs' dtype: the residual after a rejection
    output_ptr,  # int64 [batch, output_width]
    accept_len_ptr,  # int64 [batch]
    node_ids_ptr,  # int64 [batch, output_width - 1]
    output_width,  # max_depth + 1
    vocab_size,
    HAS_DRAFT_PROBS: tl.constexpr,
    NOISE_PER_ROW: tl.constexpr,
    PLACEHOLDER: tl.constexpr,
    BLOCK_D: tl.constexpr,  # power of two >= output_width
    BLOCK_V: tl.constexpr,  # vocabulary chunk
):
    """One program per request: one pass over its nodes in index order; a rejected child costs
    two passes over the vocabulary (the residual's mass, then the residual into the request's
    scratch row, only when the mass is > 0), the extra token one more."""
    req = tl.program_id(0).to(tl.int64)
    start, count = request_span(cu_ptr, req)
    pos = tl.arange(0, BLOCK_D)
    node = tl.full([], -1, tl.int64)
    row = start + req
    depth = tl.zeros([], tl.int64)
    path_tokens = tl.full([BLOCK_D], PLACEHOLDER, tl.int64)
    path_nodes = tl.full([BLOCK_D], -1, tl.int64)
    mass = tl.full([], 1.0, tl.float64)  # S
    in_scratch = tl.zeros([], tl.int32)  # R: the scratch row (1) or the target row (0)
    scratch_row = scratch_ptr + req * vocab_size
    for i in range(start, start + count):  # global node index (a Python int when interpreted)
        j = i - start  # within-request node index, an int64 scalar tensor
        if tl.load(parents_ptr + i) == node:
            token = tl.load(draft_ptr + i)
            target_row = target_probs_ptr + row * vocab_size
            stored = tl.where(in_scratch != 0, tl.load(scratch_row + token),
                              tl.load(target_row + token))
            r_at = (stored.to(tl.float64) / mass).to(stored.dtype).to(tl.float64)
            draft_row = draft_probs_ptr + i * vocab_size
            if HAS_DRAFT_PROBS:
                draft_at = tl.load(draft_row + token).to(tl.float64)
            else:
                draft_at = tl.full([], 1.0, tl.float64)
            u = tl.load(uniform_ptr + i).to(tl.float64)
            if u * draft_at < r_at:  # accepted: move to node j
                path_tokens = tl.where(pos == depth, token, path_tokens)
                path_nodes = tl.where(pos == depth, j, path_nodes)
                node = j
                row = i + req + 1
                depth += 1
                mass = tl.full([], 1.0, tl.float64)
                in_scratch = tl.zeros([], tl.int32)
            else:  # rejected: r <- normalize(max(r - q, 0)) unless that vanishes
                rest_mass = tl.zeros([], tl.float64)
                for off in range(0, vocab_size, BLOCK_V):
                    cols = off + tl.arange(0, BLOCK_V).to(tl.int64)
                    rest = _rest_chunk(target_row, scratch_row, in_scratch != 0, mass,
                                       draft_row, token, cols, vocab_size, HAS_DRAFT_PROBS)
                    rest_mass += tl.sum(rest.to(tl.float64), axis=0)
                if rest_mass > 0:
                    tl.debug_barrier()  # every thread has read R before it is overwritten
                    for off in range(0, vocab_size, BLOCK_V):
                        cols = off + tl.arange(0, BLOCK_V).to(tl.int64)
                        rest = _rest_chunk(target_row, scratch_row, in_scratch != 0, mass,
                                           draft_row, token, cols, vocab_size,
                                           HAS_DRAFT_PROBS)
                        tl.store(scratch_row + cols, rest, mask=cols < vocab_size)
                    tl.debug_barrier()  # the new R is visible to every thread
                    mass = rest_mass
                    in_scratch = tl.full([], 1, tl.int32)

    # The extra token: the exponential race over R, the target row if every score is 0.
    target_row = target_probs_ptr + row * vocab_size
    if NOISE_PER_ROW:
        noise_row = noise_ptr + row * vocab_size
    else:
        noise_row = noise_ptr + req * vocab_size
    best_res = tl.full([], -1.0, target_probs_ptr.dtype.element_ty)
    best_res_idx = tl.zeros([], tl.int64)
    best_tgt = tl.full([], -1.0, target_probs_ptr.dtype.element_ty)
    best_tgt_idx = tl.zeros([], tl.int64)
    for off in range(0, vocab_size, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V).to(tl.int64)
        in_vocab = cols < vocab_size
        t = tl.load(target_row + cols, mask=in_vocab, other=0)
        s = tl.load(scratch_row + cols, mask=cols < tl.where(in_scratch != 0, vocab_size, 0),
                    other=0)
        res = tl.where(in_scratch != 0, s, t)
        e = tl.load(noise_row + cols, mask=in_vocab, other=1)
        s_res = tl.where(in_vocab, ieee_div(res, e), -1.0)
        s_tgt = tl.where(in_vocab, ieee_div(t, e), -1.0)
        best_res, best_res_idx = running_argmax(s_res, off, best_res, best_res_idx)
        best_tgt, best_tgt_idx = running_argmax(s_tgt, off, best_tgt, best_tgt_idx)
    extra = tl.where(best_res == 0, best_tgt_idx, best_res_idx)
    store_result(output_ptr, accept_len_ptr, node_ids_ptr, req, output_width, depth, extra,
                 path_tokens, path_nodes, PLACEHOLDER, BLOCK_D)


def _kernel_is_interpreted() -> bool:
    """Whether this module's kernel was decorated interpreted (see :mod:`kernels.triton_mode`)."""
    return is_interpreted(_tree_rejection_sample_kernel)


def tree_rejection_sample_triton(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniform_samples: torch.Tensor,
    exponential_noise: torch.Tensor,
    max_depth: int | None = None,
) -> TreeResult:
    """:func:`tree_rejection_sample_ref` computed by the Triton kernel (same arguments and
    results; a ``[batch, V]`` scratch row per request in target_probs' dtype).

    Raises:
        ValueError: as :func:`tree_rejection_sample_ref`; or CPU tensors while the kernel is
            compiled.
        RuntimeError: CPU tensors with ``TRITON_INTERPRET=1`` set only after triton was
            imported (the kernel was already decorated for compilation).
    """
    width = _validate_sample(draft_token_ids, cu_num_draft_tokens, parents, draft_probs,
                             target_probs, uniform_samples, exponential_noise, max_depth) + 1
    check_runnable(draft_token_ids.is_cuda, _tree_rejection_sample_kernel)
    batch = cu_num_draft_tokens.numel()
    device = draft_token_ids.device
    output, accept_len, node_ids = allocate_result(batch, width, device)
    if batch == 0:
        return output, accept_len, node_ids
    vocab = target_probs.shape[1]
    target_probs = target_probs.contiguous()
    has_draft_probs = draft_probs is not None
    scratch = torch.empty((batch, vocab), dtype=target_probs.dtype, device=device)
    _tree_rejection_sample_kernel[(batch,)](
        draft_token_ids.contiguous(), cu_num_draft_tokens.contiguous(), parents.contiguous(),
        draft_probs.contiguous() if has_draft_probs else target_probs, target_probs,
        uniform_samples.contiguous(), exponential_noise.contiguous(), scratch, output,
        accept_len, node_ids, width, vocab, HAS_DRAFT_PROBS=has_draft_probs,
        NOISE_PER_ROW=exponential_noise.shape[0] != batch, PLACEHOLDER=PLACEHOLDER_TOKEN_ID,
        BLOCK_D=triton.next_power_of_2(width), BLOCK_V=min(4096, triton.next_power_of_2(vocab)),
        num_warps=4, enable_fp_fusion=False,  # no fused multiply-add: torch's rounding, op for op
    )
    return output, accept_len, node_ids


def tree_rejection_sample(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniform_samples: torch.Tensor,
    exponential_noise: torch.Tensor,
    max_depth: int | None = None,
) -> TreeResult:
    """Launcher: the Triton kernel on CUDA (or on CPU under ``TRITON_INTERPRET=1``), else the
    torch reference. Arguments, results and errors as :func:`tree_rejection_sample_ref` (plus
    the RuntimeError of :func:`tree_rejection_sample_triton`)."""
    fn = (tree_rejection_sample_triton if use_kernel(draft_token_ids)
          else tree_rejection_sample_ref)
    return fn(draft_token_ids, cu_num_draft_tokens, parents, draft_probs, target_probs,
              uniform_samples, exponential_noise, max_depth)


__all__ = ["tree_rejection_sample", "tree_rejection_sample_noise",
           "tree_rejection_sample_ref", "tree_rejection_sample_triton"]
