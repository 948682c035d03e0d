"""Coupled verification for seeded requests (DESIGN.md §5).

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

Noise: a counter-based generator (splitmix64, Steele et al. 2014, in wrapping int64
arithmetic): ``key = mix(mix(seed + GAMMA) ^ position)``, ``h_v = mix(key + (v + 1) * GAMMA)``;
``u_v = (2 * (h_v >>> 12) + 1) * 2**-53`` in ``(0, 1)``; ``E_v = -log(u_v)`` with a logarithm
spelled out in IEEE float64 adds, multiplies and divisions (``log1p``-style atanh series), so
torch and Triton produce the same bits (the kernel is compiled without FMA contraction). The
race divides in float64 with IEEE rounding; ties go to the first index.

Entry points (each a reference in plain torch, the source of truth; a Triton version; a
launcher: CUDA or TRITON_INTERPRET → kernel, else reference):
- :func:`gumbel_sample_ref` / :func:`gumbel_sample_triton` / :func:`gumbel_sample`: one token
  per row (plain decode, the prefill worker's first token, a model drafter);
- :func:`coupled_sample_ref` / :func:`coupled_sample_triton` / :func:`coupled_sample`:
  verification of a ragged batch (target tokens of every row, then the greedy prefix match of
  kernels/greedy_verify.py);
- :func:`coupled_exponential_noise` / :func:`coupled_exponential_noise_triton`: the noise
  ``E`` itself, for exactness tests and drafters.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.race import ieee_div, running_argmax
from kernels.triton_mode import check_runnable, interpret_mode, is_interpreted

from kernels.greedy_verify import greedy_verify_ref, greedy_verify_triton
from kernels.ragged import num_drafts as _num_drafts
from kernels.greedy_verify import _validate as _validate_greedy


def _signed64(x: int) -> int:
    """A 64-bit pattern as a signed int64 value."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GAMMA = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)
_MANTISSA = (1 << 52) - 1
_ONE_BITS = 1023 << 52
_NUM_COEFFS = 13  # atanh series terms: |s| <= 0.1716, z^13/27 < 1e-21
#: float64 constants of the logarithm: ln 2, sqrt 2, then 1/(2k+1) for k = 0.._NUM_COEFFS-1
_LOG_CONSTS = (math.log(2.0), math.sqrt(2.0), *(1.0 / (2 * k + 1) for k in range(_NUM_COEFFS)))
_FLOAT_DTYPES = (torch.float32, torch.float64)


def seed_to_int64(seed: int) -> int:
    """A request seed in ``[-2**63, 2**64)`` as the int64 the noise is keyed by (seeds
    ``>= 2**63`` wrap, as their 64-bit pattern).

    Raises:
        ValueError: not an int, or outside ``[-2**63, 2**64)``.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < 1 << 64:
        raise ValueError(f"seed must be an int in [-2**63, 2**64), got {seed!r}")
    return _signed64(seed) if seed >= 0 else seed


# --------------------------------------------------------------------------------------------
# Noise in torch
# --------------------------------------------------------------------------------------------


def _lsr(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer (wrapping int64 arithmetic)."""
    z = (z ^ _lsr(z, 30)) * _MIX1
    z = (z ^ _lsr(z, 27)) * _MIX2
    return z ^ _lsr(z, 31)


def _log_unit(u: torch.Tensor) -> torch.Tensor:
    """``log(u)`` for float64 ``u`` in ``(0, 1)``, in IEEE adds/multiplies/divisions only
    (``u = m 2^e``, ``m`` in ``[sqrt(1/2), sqrt(2))``, ``log m = 2 atanh((m-1)/(m+1))``)."""
    ln2, sqrt2, *coeffs = _LOG_CONSTS
    bits = u.view(torch.int64)
    e = (bits >> 52) - 1023
    m = ((bits & _MANTISSA) | _ONE_BITS).view(torch.float64)
    big = m > sqrt2
    m = torch.where(big, m * 0.5, m)
    e = torch.where(big, e + 1, e)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    poly = torch.full_like(z, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        poly = poly * z
        poly = poly + c
    return e.to(torch.float64) * ln2 + (s + s) * poly


def _row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return _mix64(_mix64(seeds + _GAMMA) ^ positions)


def coupled_exponential_noise(seeds: torch.Tensor, positions: torch.Tensor,
                              vocab_size: int) -> torch.Tensor:
    """The race noise ``E [N, V]`` (float64, ``Exp(1)``, > 0) keyed by ``(seeds[n],
    positions[n], v)``; the Gumbel noise is ``-log(E)``.

    Args:
        seeds, positions: int64 ``[N]`` on one device.
        vocab_size: ``V >= 1``.

    Raises:
        ValueError: see :func:`_validate_rows` (without probabilities).
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    _check_keys(seeds, positions, None)
    keys = _row_keys(seeds, positions)[:, None]  # [N, 1]
    v = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seeds.device)[None, :]
    h = _mix64(keys + v * _GAMMA)
    u = (_lsr(h, 12) * 2 + 1).to(torch.float64) * 2.0 ** -53
    return -_log_unit(u)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _check_keys(seeds: torch.Tensor, positions: torch.Tensor, rows: int | None) -> None:
    for name, t in (("seeds", seeds), ("positions", positions)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1 or t.dtype != torch.int64:
            raise ValueError(f"{name} must be 1-D int64, got {tuple(t.shape)} {t.dtype}")
    if seeds.shape != positions.shape or (rows is not None and seeds.numel() != rows):
        raise ValueError(f"seeds {tuple(seeds.shape)} and positions {tuple(positions.shape)} "
                         f"must both have {rows if rows is not None else 'the same'} entries")
    if seeds.device != positions.device:
        raise ValueError(f"seeds on {seeds.device}, positions on {positions.device}")


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
    _check_keys(seeds, positions, probs.shape[0])
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
        seeds: int64 ``[N]`` (see :func:`seed_to_int64`).
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
def _mix64_dev(z):
    z = (z ^ ((z >> 30) & 0x3FFFFFFFF)) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    z = (z ^ ((z >> 27) & 0x1FFFFFFFFF)) * -7723592293110705685  # 0x94D049BB133111EB
    return z ^ ((z >> 31) & 0x1FFFFFFFF)


@triton.jit
def _log_unit_dev(u, consts_ptr, NUM_COEFFS: tl.constexpr):
    """:func:`_log_unit` (same operations in the same order)."""
    ln2 = tl.load(consts_ptr)
    sqrt2 = tl.load(consts_ptr + 1)
    bits = u.to(tl.int64, bitcast=True)
    e = (bits >> 52) - 1023
    m = ((bits & 0xFFFFFFFFFFFFF) | 0x3FF0000000000000).to(tl.float64, bitcast=True)
    big = m > sqrt2
    m = tl.where(big, m * 0.5, m)
    e = tl.where(big, e + 1, e)
    s = ieee_div(m - 1.0, m + 1.0)
    z = s * s
    poly = tl.zeros_like(z) + tl.load(consts_ptr + 2 + NUM_COEFFS - 1)
    for i in tl.static_range(NUM_COEFFS - 1):
        poly = poly * z
        poly = poly + tl.load(consts_ptr + 2 + NUM_COEFFS - 2 - i)
    return e.to(tl.float64) * ln2 + (s + s) * poly


@triton.jit
def _row_key_dev(seed, position):
    return _mix64_dev(_mix64_dev(seed + -7046029254386353131) ^ position)  # seed + GAMMA


@triton.jit
def _noise_dev(key, cols, consts_ptr, NUM_COEFFS: tl.constexpr):
    """``E`` at vocabulary indices ``cols`` (int64) of the row with ``key``."""
    h = _mix64_dev(key + (cols + 1) * -7046029254386353131)  # key + (v + 1) * GAMMA
    u = (((h >> 12) & 0xFFFFFFFFFFFFF) * 2 + 1).to(tl.float64) * 1.1102230246251565e-16
    return -_log_unit_dev(u, consts_ptr, NUM_COEFFS)


@triton.jit
def _noise_kernel(seeds_ptr, positions_ptr, consts_ptr, out_ptr, vocab_size,
                  NUM_COEFFS: tl.constexpr, BLOCK_V: tl.constexpr):
    """The noise itself, ``[N, V]`` float64 (for exactness tests and model drafters)."""
    row = tl.program_id(0).to(tl.int64)
    key = _row_key_dev(tl.load(seeds_ptr + row), tl.load(positions_ptr + row))
    for off in range(0, vocab_size, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V).to(tl.int64)
        tl.store(out_ptr + row * vocab_size + cols, _noise_dev(key, cols, consts_ptr, NUM_COEFFS),
                 mask=cols < vocab_size)


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
    key = _row_key_dev(seed, position)
    best = tl.full([], -1.0, tl.float64)
    best_idx = tl.zeros([], tl.int64)
    for off in range(0, vocab_size, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V).to(tl.int64)
        in_vocab = cols < vocab_size
        noise = _noise_dev(key, cols, consts_ptr, NUM_COEFFS)
        p = tl.load(probs_ptr + row * vocab_size + cols, mask=in_vocab, other=0).to(tl.float64)
        score = tl.where(in_vocab, ieee_div(p, noise), -1.0)
        best, best_idx = running_argmax(score, off, best, best_idx)
    tl.store(out_ptr + row, best_idx)


_CONSTS_CACHE: dict[torch.device, torch.Tensor] = {}


def _log_consts(device: torch.device) -> torch.Tensor:
    if device not in _CONSTS_CACHE:
        _CONSTS_CACHE[device] = torch.tensor(_LOG_CONSTS, dtype=torch.float64, device=device)
    return _CONSTS_CACHE[device]


def _interpret_mode() -> bool:
    """See :func:`kernels.triton_mode.interpret_mode`."""
    return interpret_mode()


def _kernel_is_interpreted() -> bool:
    """Whether this module's kernel was decorated interpreted (see :mod:`kernels.triton_mode`)."""
    return is_interpreted(_gumbel_sample_kernel)


def _check_kernel_device(t: torch.Tensor) -> None:
    check_runnable(t.is_cuda, _gumbel_sample_kernel)


def coupled_exponential_noise_triton(seeds: torch.Tensor, positions: torch.Tensor,
                                     vocab_size: int) -> torch.Tensor:
    """:func:`coupled_exponential_noise` computed by a Triton kernel (the same bits).

    Raises:
        ValueError: as :func:`coupled_exponential_noise`; or CPU tensors while the kernel is
            compiled.
        RuntimeError: CPU tensors with ``TRITON_INTERPRET=1`` set only after triton was
            imported.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    _check_keys(seeds, positions, None)
    _check_kernel_device(seeds)
    out = torch.empty((seeds.numel(), vocab_size), dtype=torch.float64, device=seeds.device)
    if seeds.numel():
        _noise_kernel[(seeds.numel(),)](
            seeds.contiguous(), positions.contiguous(), _log_consts(seeds.device), out,
            vocab_size, NUM_COEFFS=_NUM_COEFFS,
            BLOCK_V=min(2048, triton.next_power_of_2(vocab_size)), num_warps=4,
            enable_fp_fusion=False)
    return out


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
        _log_consts(probs.device), out, vocab, NUM_COEFFS=_NUM_COEFFS,
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
    _check_keys(seeds, positions, cu_num_draft_tokens.numel())
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
        seeds: int64 ``[batch]``, the request seeds (:func:`seed_to_int64`).
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


__all__ = ["coupled_exponential_noise", "coupled_exponential_noise_triton", "coupled_sample",
           "coupled_sample_ref", "coupled_sample_triton", "gumbel_sample", "gumbel_sample_ref",
           "gumbel_sample_triton", "seed_to_int64"]
