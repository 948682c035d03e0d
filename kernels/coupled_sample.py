"""Coupled verification for seeded requests (docs/architecture.md, 'Verification rules').

The target token at absolute output position ``i`` of a seeded request is the Gumbel-max sample
of the processed target distribution with noise keyed by ``(seed, i)``:
``argmax_v(log target_probs[v] + g_v)`` with ``g_v = -log(E_v)`` Gumbel noise, computed as the
equivalent exponential race ``argmax_v(target_probs[v] / E_v)`` (Gumbel 1954; the Gumbel-max
trick as used for coupled speculative sampling, e.g. arXiv 2408.05374). A draft is accepted iff
it equals that token, so the output is the target-token sequence itself: identical with
speculation on or off and whatever the drafter proposed (a drafter sampling its own
distribution with the same noise simply gets accepted more often). Greedy rows (one-hot
probabilities) sample their argmax.

Positions: ``i`` is the index of the token in the request's output (0 for the prefill
worker's first token); prefill, verifier, drafter and plain decode must use the same
convention. Request ``b`` with ``k_b`` drafts verifies rows at positions
``positions[b] + j``, ``j = 0..k_b``.

Noise: the counter-based generator of :mod:`kernels.counter_noise` (splitmix64, Steele et al.
2014), keyed by ``(seed, position, v)``, with the same bits in torch and Triton. The race
divides in float64 with IEEE rounding; ties go to the first index.

Entry points (each a reference in plain torch, the source of truth; a Triton version; a
launcher: CUDA or TRITON_INTERPRET → kernel, else reference):
- :func:`gumbel_sample_ref` / :func:`gumbel_sample_triton` / :func:`gumbel_sample`: one token
  per row (plain decode, the prefill worker's first token, a model drafter);
- :func:`coupled_sample_ref` / :func:`coupled_sample_triton` / :func:`coupled_sample`:
  verification of a ragged batch (target tokens of every row, then the greedy prefix match of
  kernels/greedy_verify.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmesh.kernels.counter_noise import (
    NUM_COEFFS,
    check_keys,
    coupled_exponential_noise,
    log_consts,
    noise_dev,
    row_key_dev,
)
from specmesh.kernels.greedy_verify import _validate as _validate_greedy
from specmesh.kernels.greedy_verify import greedy_verify_ref, greedy_verify_triton
from specmesh.kernels.race import ieee_div, running_argmax
from specmesh.kernels.ragged import num_drafts as _num_drafts
from specmesh.kernels.triton_mode import check_runnable, interpret_mode, is_interpreted

_FLOAT_DTYPES = (torch.float32, torch.float64)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _validate_rows(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> None:
    """Checks of :func:`gumbel_sample_ref`.

    Raises:
        ValueError: ``probs`` not float32/float64 ``[N, V]`` with ``V >= 1``; ``seeds`` or
            ``positions`` not int64 ``[N]``; tensors on different devices.
    """
    if not isinstance(probs, torch.Tensor):
        raise ValueError(f"probs must be a torch.Tensor, got {type(probs).__name__}")
    if probs.dim() != 2 or probs.shape[1] == 0:
        raise ValueError(f"probs must be [N, V] with V >= 1, got {tuple(probs.shape)}")
    if probs.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"probs must be float32 or float64, got {probs.dtype}")
    check_keys(seeds, positions, probs.shape[0])
    if seeds.device != probs.device:
        raise ValueError(f"seeds on {seeds.device}, probs on {probs.device}")


# --------------------------------------------------------------------------------------------
# One token per row
# --------------------------------------------------------------------------------------------


def gumbel_sample_ref(probs: torch.Tensor, seeds: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
    """Gumbel-max sample of each row keyed by ``(seed, position)``, in plain torch.

    Args:
        probs: float32/float64 ``[N, V]``, non-negative (e.g. kernels/logits_processing.py's
            output; need not be normalized).
        seeds: int64 ``[N]`` (see :func:`kernels.counter_noise.seed_to_int64`).
        positions: int64 ``[N]``, the absolute output position of each row's token.

    Returns:
        int64 ``[N]``: ``argmax_v(probs[n, v] / E[n, v])`` (first index among ties).

    Raises:
        ValueError: see :func:`_validate_rows`.
    """
    _validate_rows(probs, seeds, positions)
    noise = coupled_exponential_noise(seeds, positions, probs.shape[1])
    return (probs.to(torch.float64) / noise).argmax(dim=1)


@triton.jit
def _gumbel_sample_kernel(
    probs_ptr,  # float32/float64 [N, V]
    seeds_ptr,  # int64 [N]
    positions_ptr,  # int64 [N]
    consts_ptr,  # float64 [2 + NUM_COEFFS]
    out_ptr,  # int64 [N]
    vocab_size,
    NUM_COEFFS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per row: noise and race over vocabulary chunks, running first-index
    argmax."""
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seeds_ptr + row)
    position = tl.load(positions_ptr + row)
    key = row_key_dev(seed, position)
    best = tl.full([], -1.0, tl.float64)
    best_idx = tl.zeros([], tl.int64)
    for off in range(0, vocab_size, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V).to(tl.int64)
        in_vocab = cols < vocab_size
        noise = noise_dev(key, cols, consts_ptr, NUM_COEFFS)
        p = tl.load(probs_ptr + row * vocab_size + cols, mask=in_vocab, other=0).to(tl.float64)
        score = tl.where(in_vocab, ieee_div(p, noise), -1.0)
        best, best_idx = running_argmax(score, off, best, best_idx)
    tl.store(out_ptr + row, best_idx)


def _interpret_mode() -> bool:
    """See :func:`kernels.triton_mode.interpret_mode`."""
    return interpret_mode()


def _kernel_is_interpreted() -> bool:
    """Whether this module's kernel was decorated interpreted (see :mod:`kernels.triton_mode`)."""
    return is_interpreted(_gumbel_sample_kernel)


def _check_kernel_device(t: torch.Tensor) -> None:
    check_runnable(t.is_cuda, _gumbel_sample_kernel)


def gumbel_sample_triton(probs: torch.Tensor, seeds: torch.Tensor,
                         positions: torch.Tensor) -> torch.Tensor:
    """:func:`gumbel_sample_ref` computed by the Triton kernel (same arguments and result).

    Raises:
        ValueError: see :func:`_validate_rows`; or CPU tensors while the kernel is compiled.
        RuntimeError: CPU tensors with ``TRITON_INTERPRET=1`` set only after triton was
            imported.
    """
    _validate_rows(probs, seeds, positions)
    _check_kernel_device(probs)
    rows, vocab = probs.shape
    out = torch.empty((rows,), dtype=torch.int64, device=probs.device)
    if rows == 0:
        return out
    _gumbel_sample_kernel[(rows,)](
        probs.contiguous(), seeds.contiguous(), positions.contiguous(),
        log_consts(probs.device), out, vocab, NUM_COEFFS=NUM_COEFFS,
        BLOCK_V=min(2048, triton.next_power_of_2(vocab)), num_warps=4,
        enable_fp_fusion=False,  # no FMA contraction: the reference's rounding, op for op
    )
    return out


def gumbel_sample(probs: torch.Tensor, seeds: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """Launcher: the Triton kernel on CUDA (or on CPU under ``TRITON_INTERPRET=1``), else the
    torch reference. Arguments, result and errors as :func:`gumbel_sample_ref` (plus the
    RuntimeError of :func:`gumbel_sample_triton`)."""
    on_cuda = isinstance(probs, torch.Tensor) and probs.is_cuda
    fn = gumbel_sample_triton if on_cuda or _interpret_mode() else gumbel_sample_ref
    return fn(probs, seeds, positions)


# --------------------------------------------------------------------------------------------
# Coupled verification of a ragged batch
# --------------------------------------------------------------------------------------------


def _row_seeds_positions(cu_num_draft_tokens: torch.Tensor, seeds: torch.Tensor,
                         positions: torch.Tensor, num_rows: int,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row seeds and positions ``[num_draft_total + batch]``: row ``j`` of request ``b``
    gets ``(seeds[b], positions[b] + j)``."""
    batch = cu_num_draft_tokens.numel()
    rows_per_req = _num_drafts(cu_num_draft_tokens) + 1
    row_start = cu_num_draft_tokens.to(torch.int64) - rows_per_req + 1 + torch.arange(
        batch, device=seeds.device)
    row_seeds = torch.repeat_interleave(seeds, rows_per_req, output_size=num_rows)
    offsets = torch.arange(num_rows, device=seeds.device) - torch.repeat_interleave(
        row_start, rows_per_req, output_size=num_rows)
    row_positions = torch.repeat_interleave(positions, rows_per_req, output_size=num_rows)
    return row_seeds, row_positions + offsets


def _validate_coupled(draft_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                      target_probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                      max_num_draft_tokens: int | None) -> int:
    """Checks of :func:`coupled_sample_ref`; returns ``max_num_draft_tokens``.

    Raises:
        ValueError: the errors of kernels/greedy_verify.py's validation (drafts, ``cu``,
            ``max_num_draft_tokens``); ``target_probs`` not float32/float64
            ``[num_draft_total + batch, V]``; ``seeds``/``positions`` not int64 ``[batch]``;
            tensors on different devices.
    """
    if not isinstance(target_probs, torch.Tensor):
        raise ValueError(f"target_probs must be a torch.Tensor, got {type(target_probs).__name__}")
    if target_probs.dim() != 2 or target_probs.shape[1] == 0:
        raise ValueError(f"target_probs must be [rows, V] with V >= 1, "
                         f"got {tuple(target_probs.shape)}")
    if target_probs.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"target_probs must be float32 or float64, got {target_probs.dtype}")
    # the greedy rule's checks, with a stand-in for the target tokens of the right length
    stand_in = target_probs.new_zeros(target_probs.shape[0], dtype=torch.int64)
    width = _validate_greedy(draft_token_ids, cu_num_draft_tokens, stand_in,
                             max_num_draft_tokens)
    check_keys(seeds, positions, cu_num_draft_tokens.numel())
    if seeds.device != target_probs.device or draft_token_ids.device != target_probs.device:
        raise ValueError("inputs are on different devices")
    return width


def coupled_sample_ref(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    max_num_draft_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Coupled verification in plain torch (the source of truth).

    Args:
        draft_token_ids: int64 ``[num_draft_total]``, the drafts of all requests, concatenated.
        cu_num_draft_tokens: int32/int64 ``[batch]``, inclusive cumsum of ``num_draft_tokens``.
        target_probs: float32/float64 ``[num_draft_total + batch, V]``, ``k_b + 1`` processed
            target rows per request (the last the bonus position).
        seeds: int64 ``[batch]``, the request seeds (:func:`kernels.counter_noise.seed_to_int64`).
        positions: int64 ``[batch]``, the absolute output position of each request's first
            verified row (row ``j`` is at ``positions[b] + j``).
        max_num_draft_tokens: width of the output minus one; computed when None.

    Returns:
        ``(output_token_ids, accept_len)``: int64 ``[batch, max_num_draft_tokens + 1]``
        (accepted drafts, then the target token at the first mismatch, the
        ``recovered_token_id``, or after the last draft, the ``bonus_token_id``; padded with
        ``PLACEHOLDER_TOKEN_ID``) and int64 ``[batch]``.

    Raises:
        ValueError: see :func:`_validate_coupled`.
    """
    width = _validate_coupled(draft_token_ids, cu_num_draft_tokens, target_probs, seeds,
                              positions, max_num_draft_tokens)
    row_seeds, row_positions = _row_seeds_positions(cu_num_draft_tokens, seeds, positions,
                                                    target_probs.shape[0])
    target_token_ids = gumbel_sample_ref(target_probs, row_seeds, row_positions)
    return greedy_verify_ref(draft_token_ids, cu_num_draft_tokens, target_token_ids, width)


def coupled_sample_triton(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    max_num_draft_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`coupled_sample_ref` computed by the Triton kernels (the Gumbel-max kernel on every
    row, then kernels/greedy_verify.py's kernel). Same arguments and results.

    Raises:
        ValueError: see :func:`_validate_coupled`; or CPU tensors while the kernel is compiled.
        RuntimeError: CPU tensors with ``TRITON_INTERPRET=1`` set only after triton was
            imported.
    """
    width = _validate_coupled(draft_token_ids, cu_num_draft_tokens, target_probs, seeds,
                              positions, max_num_draft_tokens)
    _check_kernel_device(target_probs)
    row_seeds, row_positions = _row_seeds_positions(cu_num_draft_tokens, seeds, positions,
                                                    target_probs.shape[0])
    target_token_ids = gumbel_sample_triton(target_probs, row_seeds, row_positions)
    return greedy_verify_triton(draft_token_ids, cu_num_draft_tokens, target_token_ids, width)


def coupled_sample(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    max_num_draft_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: the Triton kernels on CUDA (or on CPU under ``TRITON_INTERPRET=1``), else the
    torch reference. Arguments, results and errors as :func:`coupled_sample_ref` (plus the
    RuntimeError of :func:`coupled_sample_triton`)."""
    on_cuda = isinstance(target_probs, torch.Tensor) and target_probs.is_cuda
    fn = coupled_sample_triton if on_cuda or _interpret_mode() else coupled_sample_ref
    return fn(draft_token_ids, cu_num_draft_tokens, target_probs, seeds, positions,
              max_num_draft_tokens)


__all__ = ["coupled_sample", "coupled_sample_ref", "coupled_sample_triton", "gumbel_sample",
           "gumbel_sample_ref", "gumbel_sample_triton"]
