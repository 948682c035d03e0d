"""Output position 0 of a prefilled batch: the first token of each request and of its siblings,
with their logprobs (docs/architecture.md, 'Life of a request').

Position 0 is processed as the verifier processes every later position: penalties and token
constraints with the prompt as history (engine/logits_processors.py), the grammar's initial
mask (engine/grammar.py), then each request's sampling mode (engine/sampling.py: greedy
argmax, coupled Gumbel-max keyed by (seed, 0), or a draw from the worker's generator).
Logprobs are the float32 log_softmax of that processed row (engine/logprobs.py), as vLLM and
OpenAI report them.
"""

from __future__ import annotations

import torch

from specmesh.engine.grammar import GrammarCompiler, apply_masks, first_token_masks
from specmesh.engine.logits_processors import RowsHistory, apply_logits_processors
from specmesh.engine.logprobs import token_logprobs
from specmesh.engine.sampling import sample_tokens
from specmesh.protocol.messages import PrefillRequest, TokenLogprobs


def first_tokens(last: torch.Tensor, reqs: list[PrefillRequest],
                 grammars: GrammarCompiler | None, generator: torch.Generator
                 ) -> tuple[list[int], list[TokenLogprobs | None],
                            list[tuple[list[int] | None, list[TokenLogprobs] | None]]]:
    """Sample output position 0 of every request from ``last`` ([num_requests, vocab]
    logits of each prompt's last position; processed in place). Returns per request its
    first token, its logprobs when asked (SamplingParams.logprobs) and its siblings' first
    tokens with their logprobs when asked (PrefillRequest.sibling_sampling, each by its own
    sampling from the same row; None: it has none)."""
    # penalties and token constraints at output position 0: history = the prompt
    apply_logits_processors(last, [RowsHistory(r.sampling, r.prompt_token_ids, (), i)
                                   for i, r in enumerate(reqs)])
    # structured output: output position 0 under the grammar's initial mask
    rows, allowed = first_token_masks(grammars, [r.sampling.grammar for r in reqs],
                                      last.device)
    for j, i in enumerate(rows):
        apply_masks(last[i:i + 1], allowed[j:j + 1])
    # output position 0, by each request's mode (engine/sampling.py): greedy argmax,
    # coupled Gumbel-max keyed by (seed, 0), or a draw from this worker's generator
    firsts = list(sample_tokens(last, [r.sampling for r in reqs], [0] * len(reqs),
                                generator))
    siblings: list[list[int] | None] = []
    for i, r in enumerate(reqs):
        m = len(r.sibling_sampling or [])
        rows = last[i:i + 1].expand(m, -1).contiguous()
        siblings.append(sample_tokens(rows, r.sibling_sampling, [0] * m, generator)
                        if m else None)
    first_lps = [None if r.sampling.logprobs is None else
                 token_logprobs(last[i:i + 1], [firsts[i]],
                                min(r.sampling.logprobs, last.shape[-1]))
                 for i, r in enumerate(reqs)]
    sibling_parts = []
    for i, (r, toks) in enumerate(zip(reqs, siblings)):
        lps = None
        if toks is not None and any(sp.logprobs is not None for sp in r.sibling_sampling):
            lps = [token_logprobs(last[i:i + 1], [t], min(sp.logprobs or 0, last.shape[-1]))
                   for sp, t in zip(r.sibling_sampling, toks)]
        sibling_parts.append((toks, lps))
    return firsts, first_lps, sibling_parts
