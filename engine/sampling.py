"""Sampling a request's tokens from the target's logits
(docs/architecture.md, 'Verification rules'): the one place that turns
:class:`~protocol.messages.SamplingParams` into the per-row inputs of
kernels/logits_processing.py and samples one token per request (the prefill worker's first
token; plain decode). The verifier's rules (decode/verification.py) use :func:`processed_probs`
for every verified row.

Three sampling modes, decided per request by :func:`sampling_mode`:

- ``greedy`` (``temperature < 1e-5``): the argmax of the raw logits (first index among ties),
  exactly the target's own greedy decode;
- ``coupled`` (sampled, ``seed`` set): the Gumbel-max sample of the processed distribution
  with noise keyed by ``(seed, output position)`` (kernels/coupled_sample.py), so the token at
  each output position depends only on the prefix, the parameters and the seed, never on who
  computes it (prefill worker, verifier, speculation on or off);
- ``random`` (sampled, no seed): an exponential race ``argmax(probs / E)`` with ``E ~ Exp(1)``
  drawn from the caller's ``torch.Generator`` (the same distribution as
  ``torch.multinomial(probs, 1)``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specmesh.engine.row_argmax import row_argmax
from specmesh.kernels.counter_noise import seed_to_int64
from specmesh.kernels.coupled_sample import gumbel_sample
from specmesh.kernels.logits_processing import GREEDY_TEMPERATURE_EPS, process_logits
from specmesh.protocol.messages import SamplingParams

GREEDY = "greedy"
COUPLED = "coupled"
RANDOM = "random"


def sampling_mode(sampling: SamplingParams) -> str:
    """``"greedy"`` (temperature below 1e-5, vLLM's epsilon), else ``"coupled"`` when the request
    has a seed, else ``"random"``."""
    if sampling.temperature < GREEDY_TEMPERATURE_EPS:
        return GREEDY
    return COUPLED if sampling.seed is not None else RANDOM


def _repeat(values: list, rows: Sequence[int], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype)
    return torch.repeat_interleave(t, torch.tensor(list(rows), dtype=torch.long)).to(device)


def processed_probs(logits: torch.Tensor, sampling: Sequence[SamplingParams],
                    rows_per_request: Sequence[int] | None = None) -> torch.Tensor:
    """Processed target probabilities of every row (temperature, top-k, top-p, min-p of the
    row's request; greedy rows one-hot at the argmax).

    Args:
        logits: float ``[N, V]``; request ``b`` owns ``rows_per_request[b]`` consecutive rows
            (the verify step: ``k_b + 1``).
        sampling: one SamplingParams per request, ``[B]``.
        rows_per_request: ``[B]`` row counts summing to ``N``; None = one row per request.

    Returns:
        float32 ``[N, V]`` distributions (kernels.logits_processing.process_logits).

    Raises:
        ValueError: row counts that do not add up to ``N``, or parameters out of range.
    """
    rows = [1] * len(sampling) if rows_per_request is None else list(rows_per_request)
    if len(rows) != len(sampling) or sum(rows) != logits.shape[0]:
        raise ValueError(f"{len(sampling)} requests with rows {rows} do not cover "
                         f"{logits.shape[0]} logits rows")
    device = logits.device
    return process_logits(
        logits,
        _repeat([float(s.temperature) for s in sampling], rows, torch.float32, device),
        top_k=_repeat([int(s.top_k) for s in sampling], rows, torch.int64, device),
        top_p=_repeat([float(s.top_p) for s in sampling], rows, torch.float32, device),
        min_p=_repeat([float(s.min_p) for s in sampling], rows, torch.float32, device))


def seeds_tensor(sampling: Sequence[SamplingParams], device: torch.device) -> torch.Tensor:
    """int64 ``[B]`` noise keys of seeded requests (kernels.counter_noise.seed_to_int64).

    Raises:
        ValueError: a request without a seed, or one outside ``[-2**63, 2**64)``.
    """
    if any(s.seed is None for s in sampling):
        raise ValueError("every request of a coupled batch needs a seed")
    return torch.tensor([seed_to_int64(s.seed) for s in sampling], dtype=torch.int64,
                        device=device)


def sample_tokens(logits: torch.Tensor, sampling: Sequence[SamplingParams],
                  positions: Sequence[int], generator: torch.Generator | None = None,
                  ) -> list[int]:
    """One token per request from its logits row, by the request's :func:`sampling_mode`.

    Args:
        logits: float ``[B, V]``, the row that predicts each request's next token.
        sampling: ``[B]`` SamplingParams.
        positions: ``[B]`` output positions of the tokens being sampled (0 = the prefill
            worker's first token); the noise key of coupled requests.
        generator: randomness of unseeded sampled requests (on ``logits``' device); torch's
            default generator when None.

    Returns:
        ``B`` token ids.

    Raises:
        ValueError: mismatched lengths or parameters out of range.
    """
    if logits.dim() != 2 or logits.shape[0] != len(sampling) or len(positions) != len(sampling):
        raise ValueError(f"logits {tuple(logits.shape)}, {len(sampling)} sampling params and "
                         f"{len(positions)} positions do not match")
    out = row_argmax(logits)  # greedy rows: the raw argmax, as the target's own decode
    modes = [sampling_mode(s) for s in sampling]
    sampled = [b for b, m in enumerate(modes) if m != GREEDY]
    if sampled:
        idx = torch.tensor(sampled, dtype=torch.long, device=logits.device)
        probs = processed_probs(logits[idx], [sampling[b] for b in sampled])
        tokens = torch.empty(len(sampled), dtype=torch.long, device=logits.device)
        coupled = [i for i, b in enumerate(sampled) if modes[b] == COUPLED]
        rand = [i for i, b in enumerate(sampled) if modes[b] == RANDOM]
        if coupled:
            ci = torch.tensor(coupled, dtype=torch.long, device=logits.device)
            seeds = seeds_tensor([sampling[sampled[i]] for i in coupled], logits.device)
            pos = torch.tensor([positions[sampled[i]] for i in coupled], dtype=torch.int64,
                               device=logits.device)
            tokens[ci] = gumbel_sample(probs[ci].contiguous(), seeds, pos)
        if rand:
            ri = torch.tensor(rand, dtype=torch.long, device=logits.device)
            noise = torch.empty((len(rand), probs.shape[1]), dtype=torch.float32,
                                device=logits.device)
            noise.exponential_(generator=generator).clamp_(min=torch.finfo(torch.float32).tiny)
            tokens[ri] = (probs[ri] / noise).argmax(dim=-1)
        out[idx] = tokens
    return [int(t) for t in out.tolist()]


__all__ = ["COUPLED", "GREEDY", "RANDOM", "processed_probs", "sample_tokens", "sampling_mode",
           "seeds_tensor"]
