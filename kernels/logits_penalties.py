"""Penalties and token constraints on logits rows, vectorized over rows and vocabulary
(issue 33 item 3; vLLM's v1 sampler semantics, ``vllm/v1/sample/sampler.py``
``apply_logits_processors`` and ``vllm/model_executor/layers/utils.py`` ``apply_penalties``).

Tensor-only: engine/logits_processors.py turns each row's request parameters and token
history (prompt + output committed before the row's position) into the inputs below. Each row
of ``logits`` [N, V] is processed independently of the others, so a verify step's rows give
the same values as processing the positions one by one (speculation on equals off).

Order (vLLM's): (1) ``allowed`` rows keep only their allowed ids (every other logit ``-inf``),
(2) ``banned`` ids (bad words, EOS / stop ids under ``min_tokens``) become ``-inf``, (3) logit
bias is added, (4) penalties:

- repetition (Keskar et al. arXiv 1909.05858, vLLM's form): for ids ``seen`` in the prompt or
  the output so far, a positive logit is divided by the penalty, a non-positive one multiplied;
- frequency: ``logit -= frequency_penalty * count`` (count in the output so far);
- presence: ``logit -= presence_penalty * (count > 0)``.

``-inf`` stays ``-inf`` through every step. A row the bans would leave without a finite logit
(constraints that contradict each other, e.g. ``allowed_token_ids`` only EOS under
``min_tokens``) keeps its values from before the bans, so no row is ever an empty distribution
(which would make NaN probabilities). Units: logits (pre-temperature).

Entry points of the dense step (4, the one that touches every column): :func:`dense_penalties_ref`
(plain torch, the source of truth), :func:`dense_penalties_triton` (one program per row and
block of :data:`BLOCK_V` columns: CUDA, or CPU under ``TRITON_INTERPRET=1``) and
:func:`dense_penalties` (the launcher: the kernel on CUDA or under the interpreter, else the
reference). Both do the same float operations in the same order on each element (bit for bit
under the interpreter; to float rounding where a GPU's division may round differently). Steps
1-3 are sparse scatters and stay in torch (:func:`apply_penalties_`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specmesh.kernels.triton_mode import check_runnable, interpret_mode, is_interpreted

#: columns per program of the dense kernel
BLOCK_V = 1024


@dataclass(frozen=True)
class PenaltyInputs:
    """Inputs for ``R`` processed rows of a logits tensor ``[N, V]``.

    ``rows`` int64 [R]: which rows of the logits (distinct). Dense per processed row:
    ``presence`` / ``frequency`` / ``repetition`` float32 [R] (neutral 0, 0, 1),
    ``output_counts`` float32 [R, V] (each id's count in the output before the row's position;
    None when no row has a presence or frequency penalty) and ``seen`` bool [R, V] (ids in the
    prompt or that output; None when no row has a repetition penalty). Sparse, as (index into
    ``rows``, token id) pairs of int64 [P] tensors: ``bias_index`` / ``bias_ids`` /
    ``bias_values`` (float32 [P]; repeated pairs add up), ``ban_index`` / ``ban_ids``,
    ``allow_index`` / ``allow_ids`` (a row with at least one pair keeps only its pairs' ids).
    """

    rows: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    output_counts: torch.Tensor | None = None
    seen: torch.Tensor | None = None
    bias_index: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    ban_index: torch.Tensor | None = None
    ban_ids: torch.Tensor | None = None
    allow_index: torch.Tensor | None = None
    allow_ids: torch.Tensor | None = None


def token_counts(index: torch.Tensor, token_ids: torch.Tensor, num_rows: int,
                 vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 ``[num_rows, vocab_size]``: how often each id occurs per row, from int64 [T]
    (row index, token id) pairs (one scatter-add, no loop)."""
    out = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
    if index.numel():
        flat = index.to(device) * vocab_size + token_ids.to(device)
        out.index_add_(0, flat, torch.ones(flat.shape[0], dtype=torch.float32, device=device))
    return out.view(num_rows, vocab_size)


def apply_penalties_(logits: torch.Tensor, p: PenaltyInputs) -> torch.Tensor:
    """Process rows ``p.rows`` of ``logits`` [N, V] in place (module docstring: the order)
    and return ``logits``. The rows are computed in float32 (float64 for float64 logits) and
    written back in the logits' dtype.

    Raises:
        ValueError: ``logits`` not 2-D, or per-row tensors whose length is not ``R``.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got {tuple(logits.shape)}")
    r = p.rows.shape[0]
    if r == 0:
        return logits
    if any(t.shape[0] != r for t in (p.presence, p.frequency, p.repetition)):
        raise ValueError(f"per-row penalties must have {r} entries")
    device = logits.device
    rows = p.rows.to(device)
    # float32 (float64 logits stay float64: the tests' exact references)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.index_select(0, rows).to(dtype)
    vocab = x.shape[1]
    if p.allow_index is not None and p.allow_index.numel():
        keep = torch.zeros(r, vocab, dtype=torch.bool, device=device)
        keep[p.allow_index.to(device), p.allow_ids.to(device)] = True
        restricted = keep.any(dim=1, keepdim=True)
        x.masked_fill_(restricted & ~keep, float("-inf"))
    if p.ban_index is not None and p.ban_index.numel():
        before = x.clone()
        x[p.ban_index.to(device), p.ban_ids.to(device)] = float("-inf")
        emptied = torch.isneginf(x).all(dim=1)  # contradicting constraints: bans yield
        x = torch.where(emptied.unsqueeze(1), before, x)
    if p.bias_index is not None and p.bias_index.numel():
        x.index_put_((p.bias_index.to(device), p.bias_ids.to(device)),
                     p.bias_values.to(device=device, dtype=dtype), accumulate=True)
    if p.seen is not None or p.output_counts is not None:
        x = dense_penalties(x, p.output_counts, p.seen, p.presence, p.frequency, p.repetition)
    logits.index_copy_(0, rows, x.to(logits.dtype))
    return logits


def _check_dense(x: torch.Tensor, counts: torch.Tensor | None, seen: torch.Tensor | None,
                 *per_row: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"x must be float32 / float64 [R, V], got {x.dtype} {tuple(x.shape)}")
    for name, t in (("output_counts", counts), ("seen", seen)):
        if t is not None and tuple(t.shape) != tuple(x.shape):
            raise ValueError(f"{name} {tuple(t.shape)} does not match x {tuple(x.shape)}")
    if any(t.shape != (x.shape[0],) for t in per_row):
        raise ValueError(f"per-row penalties must have {x.shape[0]} entries")


def dense_penalties_ref(x: torch.Tensor, counts: torch.Tensor | None,
                        seen: torch.Tensor | None, presence: torch.Tensor,
                        frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Step 4 of the module docstring on ``x`` float32 / float64 [R, V] (a new tensor):
    repetition where ``seen`` (bool [R, V], None: nowhere), then frequency and presence from
    ``counts`` (float [R, V], None: all zero); per-row penalties [R].

    Raises:
        ValueError: shapes or dtypes that do not fit.
    """
    _check_dense(x, counts, seen, presence, frequency, repetition)
    dtype, device = x.dtype, x.device
    if seen is not None:
        rep = repetition.to(device=device, dtype=dtype).unsqueeze(1)
        factor = torch.where(seen.to(device), rep, torch.ones_like(rep))
        x = torch.where(x > 0, x / factor, x * factor)
    if counts is not None:
        c = counts.to(device=device, dtype=dtype)
        x = x - frequency.to(device=device, dtype=dtype).unsqueeze(1) * c
        x = x - presence.to(device=device, dtype=dtype).unsqueeze(1) * (c > 0).to(dtype)
    return x


@triton.jit
def _dense_penalties_kernel(x_ptr, counts_ptr, seen_ptr, presence_ptr, frequency_ptr,
                            repetition_ptr, out_ptr, vocab, HAS_COUNTS: tl.constexpr,
                            HAS_SEEN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < vocab
    offs = row.to(tl.int64) * vocab + cols
    x = tl.load(x_ptr + offs, mask=valid, other=0.0)
    if HAS_SEEN:
        rep = tl.load(repetition_ptr + row).to(x.dtype)
        seen = tl.load(seen_ptr + offs, mask=valid, other=0) != 0
        factor = tl.where(seen, rep, 1.0).to(x.dtype)
        x = tl.where(x > 0, x / factor, x * factor)
    if HAS_COUNTS:
        c = tl.load(counts_ptr + offs, mask=valid, other=0.0).to(x.dtype)
        freq = tl.load(frequency_ptr + row).to(x.dtype)
        pres = tl.load(presence_ptr + row).to(x.dtype)
        x = x - freq * c
        x = x - pres * tl.where(c > 0, 1.0, 0.0).to(x.dtype)
    tl.store(out_ptr + offs, x, mask=valid)


def _kernel_is_interpreted() -> bool:
    """Whether this module's kernel was decorated interpreted (kernels/triton_mode.py)."""
    return is_interpreted(_dense_penalties_kernel)


def dense_penalties_triton(x: torch.Tensor, counts: torch.Tensor | None,
                           seen: torch.Tensor | None, presence: torch.Tensor,
                           frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """:func:`dense_penalties_ref` computed by the Triton kernel (same arguments and result).

    Raises:
        ValueError: see :func:`dense_penalties_ref`; or CPU tensors while the kernel is
            compiled.
        RuntimeError: CPU tensors with ``TRITON_INTERPRET=1`` set only after triton was
            imported.
    """
    _check_dense(x, counts, seen, presence, frequency, repetition)
    check_runnable(x.is_cuda, _dense_penalties_kernel)
    rows, vocab = x.shape
    out = torch.empty_like(x)
    if rows == 0 or vocab == 0:
        return out
    dtype, device = x.dtype, x.device
    c = counts.to(device=device, dtype=dtype).contiguous() if counts is not None else x
    s = seen.to(device=device, dtype=torch.int8).contiguous() if seen is not None else x
    _dense_penalties_kernel[(rows, triton.cdiv(vocab, BLOCK_V))](
        x.contiguous(), c, s, presence.to(device=device, dtype=dtype).contiguous(),
        frequency.to(device=device, dtype=dtype).contiguous(),
        repetition.to(device=device, dtype=dtype).contiguous(), out, vocab,
        HAS_COUNTS=counts is not None, HAS_SEEN=seen is not None, BLOCK=BLOCK_V)
    return out


def dense_penalties(x: torch.Tensor, counts: torch.Tensor | None, seen: torch.Tensor | None,
                    presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """Launcher: the Triton kernel on CUDA (or on CPU under ``TRITON_INTERPRET=1``), else the
    torch reference. Arguments, result and errors as :func:`dense_penalties_ref`."""
    fn = dense_penalties_triton if (x.is_cuda or interpret_mode()) else dense_penalties_ref
    return fn(x, counts, seen, presence, frequency, repetition)


__all__ = ["BLOCK_V", "PenaltyInputs", "apply_penalties_", "dense_penalties",
           "dense_penalties_ref", "dense_penalties_triton", "token_counts"]
