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

``-inf`` stays ``-inf`` through every step. Units: logits (pre-temperature).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
        x[p.ban_index.to(device), p.ban_ids.to(device)] = float("-inf")
    if p.bias_index is not None and p.bias_index.numel():
        x.index_put_((p.bias_index.to(device), p.bias_ids.to(device)),
                     p.bias_values.to(device=device, dtype=dtype), accumulate=True)
    if p.seen is not None:
        rep = p.repetition.to(device=device, dtype=dtype).unsqueeze(1)
        factor = torch.where(p.seen.to(device), rep, torch.ones_like(rep))
        x = torch.where(x > 0, x / factor, x * factor)
    if p.output_counts is not None:
        counts = p.output_counts.to(device=device, dtype=dtype)
        x -= p.frequency.to(device=device, dtype=dtype).unsqueeze(1) * counts
        x -= p.presence.to(device=device, dtype=dtype).unsqueeze(1) * (counts > 0)
    logits.index_copy_(0, rows, x.to(logits.dtype))
    return logits


__all__ = ["PenaltyInputs", "apply_penalties_", "token_counts"]
