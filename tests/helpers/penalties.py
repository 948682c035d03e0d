"""Test-only references for penalties and token constraints (issue 33 item 3): one logits row
processed by hand with Python loops over the vocabulary, from vLLM's definitions, and a plain
autoregressive decode with the Hugging Face model that applies it at every position."""

from __future__ import annotations

import math
from typing import Any

import torch

from specmesh.engine.sampling import GREEDY, processed_probs, sampling_mode
from specmesh.kernels.counter_noise import seed_to_int64
from specmesh.kernels.coupled_sample import gumbel_sample_ref
from specmesh.protocol.messages import SamplingParams


def reference_row(row: list[float], s: SamplingParams, prompt: list[int],
                  output: list[int]) -> list[float]:
    """One row processed by hand: allowed ids, bans (min_tokens, bad words; none when they
    would leave no finite logit), bias, then repetition, frequency and presence penalties
    (vLLM's order)."""
    x = list(row)
    if s.allowed_token_ids is not None:
        x = [v if t in s.allowed_token_ids else -math.inf for t, v in enumerate(x)]
    allowed = list(x)
    if len(output) < s.min_tokens:
        stops = set(s.stop_token_ids) | (set() if s.ignore_eos else set(s.eos_token_ids))
        for t in stops:
            x[t] = -math.inf
    for word in s.bad_words_token_ids:
        pre = list(word[:-1])
        if len(pre) <= len(output) and (not pre or output[len(output) - len(pre):] == pre):
            x[word[-1]] = -math.inf
    if all(v == -math.inf for v in x):  # contradicting constraints: the bans yield
        x = allowed
    for t, b in zip(s.logit_bias_token_ids, s.logit_bias_values):
        x[t] += b
    for t in range(len(x)):
        if t in prompt or t in output:
            r = s.repetition_penalty
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
        c = output.count(t)
        x[t] -= s.frequency_penalty * c
        x[t] -= s.presence_penalty * (1 if c else 0)
    return x


@torch.no_grad()
def penalized_reference(hf: Any, prompt: list[int], sp: SamplingParams,
                        eos_token_ids: tuple[int, ...] = ()) -> list[int]:
    """Plain decode outside the workers: a full forward over the sequence per token, the last
    row processed by :func:`reference_row` (``sp.eos_token_ids`` taken as ``eos_token_ids``),
    then the argmax (greedy) or the Gumbel-max sample keyed by (seed, position) (seeded);
    stops after an EOS / stop token unless ``ignore_eos``."""
    s = sp
    if eos_token_ids and not sp.ignore_eos:
        s = SamplingParams(**{f: getattr(sp, f) for f in sp.__struct_fields__
                              if f != "eos_token_ids"}, eos_token_ids=list(eos_token_ids))
    stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_token_ids))
    seq, out = list(prompt), []
    for i in range(sp.max_tokens):
        logits = hf(torch.tensor([seq])).logits[0, -1].to(torch.float64)
        x = torch.tensor([reference_row(logits.tolist(), s, list(prompt), out)],
                         dtype=torch.float64)
        if sampling_mode(sp) == GREEDY:
            tok = int(x[0].argmax())
        else:
            seed = torch.tensor([seed_to_int64(sp.seed)], dtype=torch.int64)
            tok = int(gumbel_sample_ref(processed_probs(x, [sp]), seed,
                                        torch.tensor([i], dtype=torch.int64))[0])
        out.append(tok)
        seq.append(tok)
        if tok in stops:
            break
    return out
