"""Counter-based exponential noise keyed by ``(seed, position, v)``
(docs/architecture.md, 'Verification rules'): the race
noise of coupled verification and Gumbel-max sampling (:mod:`kernels.coupled_sample`).

The generator: splitmix64 (Steele et al. 2014) in wrapping int64 arithmetic:
``key = mix(mix(seed + GAMMA) ^ position)``, ``h_v = mix(key + (v + 1) * GAMMA)``;
``u_v = (2 * (h_v >>> 12) + 1) * 2**-53`` in ``(0, 1)``; ``E_v = -log(u_v)`` with a logarithm
spelled out in IEEE float64 adds, multiplies and divisions (``log1p``-style atanh series), so
torch and Triton produce the same bits (the kernels are compiled without FMA contraction).

Entry points: :func:`coupled_exponential_noise` (plain torch, the source of truth) and
:func:`coupled_exponential_noise_triton` (the Triton kernel, the same bits), the noise ``E``
itself for exactness tests and drafters; :func:`seed_to_int64` (a request seed as the noise's
int64 key). :func:`row_key_dev` / :func:`noise_dev` are the generator inside other kernels
(with :func:`log_consts` and :data:`NUM_COEFFS`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from specmesh.kernels.race import ieee_div
from specmesh.kernels.triton_mode import check_runnable, is_interpreted


def _signed64(x: int) -> int:
    """A 64-bit pattern as a signed int64 value."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GAMMA = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)
_MANTISSA = (1 << 52) - 1
_ONE_BITS = 1023 << 52
NUM_COEFFS = 13  # atanh series terms: |s| <= 0.1716, z^13/27 < 1e-21
#: float64 constants of the logarithm: ln 2, sqrt 2, then 1/(2k+1) for k = 0..NUM_COEFFS-1
_LOG_CONSTS = (math.log(2.0), math.sqrt(2.0), *(1.0 / (2 * k + 1) for k in range(NUM_COEFFS)))


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
        ValueError: ``vocab_size`` not an int >= 1; see :func:`check_keys`.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    check_keys(seeds, positions, None)
    keys = _row_keys(seeds, positions)[:, None]  # [N, 1]
    v = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seeds.device)[None, :]
    h = _mix64(keys + v * _GAMMA)
    u = (_lsr(h, 12) * 2 + 1).to(torch.float64) * 2.0 ** -53
    return -_log_unit(u)


def check_keys(seeds: torch.Tensor, positions: torch.Tensor, rows: int | None) -> None:
    """Check the noise keys: ``seeds`` and ``positions`` int64 ``[rows]`` (``[N]``, any N,
    when ``rows`` is None) on one device.

    Raises:
        ValueError: when they are not.
    """
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


# --------------------------------------------------------------------------------------------
# Noise in Triton
# --------------------------------------------------------------------------------------------


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
def row_key_dev(seed, position):
    """The row key ``mix(mix(seed + GAMMA) ^ position)`` (int64 scalars)."""
    return _mix64_dev(_mix64_dev(seed + -7046029254386353131) ^ position)  # seed + GAMMA


@triton.jit
def noise_dev(key, cols, consts_ptr, NUM_COEFFS: tl.constexpr):
    """``E`` at vocabulary indices ``cols`` (int64) of the row with ``key``."""
    h = _mix64_dev(key + (cols + 1) * -7046029254386353131)  # key + (v + 1) * GAMMA
    u = (((h >> 12) & 0xFFFFFFFFFFFFF) * 2 + 1).to(tl.float64) * 1.1102230246251565e-16
    return -_log_unit_dev(u, consts_ptr, NUM_COEFFS)


@triton.jit
def _noise_kernel(seeds_ptr, positions_ptr, consts_ptr, out_ptr, vocab_size,
                  NUM_COEFFS: tl.constexpr, BLOCK_V: tl.constexpr):
    """The noise itself, ``[N, V]`` float64 (for exactness tests and model drafters)."""
    row = tl.program_id(0).to(tl.int64)
    key = row_key_dev(tl.load(seeds_ptr + row), tl.load(positions_ptr + row))
    for off in range(0, vocab_size, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V).to(tl.int64)
        tl.store(out_ptr + row * vocab_size + cols, noise_dev(key, cols, consts_ptr, NUM_COEFFS),
                 mask=cols < vocab_size)


_CONSTS_CACHE: dict[torch.device, torch.Tensor] = {}


def log_consts(device: torch.device) -> torch.Tensor:
    """The logarithm's float64 constants ``[2 + NUM_COEFFS]`` on ``device`` (cached)."""
    if device not in _CONSTS_CACHE:
        _CONSTS_CACHE[device] = torch.tensor(_LOG_CONSTS, dtype=torch.float64, device=device)
    return _CONSTS_CACHE[device]


def _kernel_is_interpreted() -> bool:
    """Whether this module's kernel was decorated interpreted (see :mod:`kernels.triton_mode`)."""
    return is_interpreted(_noise_kernel)


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
    check_keys(seeds, positions, None)
    check_runnable(seeds.is_cuda, _noise_kernel)
    out = torch.empty((seeds.numel(), vocab_size), dtype=torch.float64, device=seeds.device)
    if seeds.numel():
        _noise_kernel[(seeds.numel(),)](
            seeds.contiguous(), positions.contiguous(), log_consts(seeds.device), out,
            vocab_size, NUM_COEFFS=NUM_COEFFS,
            BLOCK_V=min(2048, triton.next_power_of_2(vocab_size)), num_warps=4,
            enable_fp_fusion=False)
    return out


__all__ = ["NUM_COEFFS", "check_keys", "coupled_exponential_noise",
           "coupled_exponential_noise_triton", "log_consts", "noise_dev", "row_key_dev",
           "seed_to_int64"]
