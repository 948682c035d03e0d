"""Token logprobs from target logits, as vLLM and OpenAI report them (issue 33, item 1).

Which distribution: the float32 ``log_softmax`` of the logits the verification rule sees for
that position (on the verifier, ``RuleBatch.target_logits`` after any in-place logits
processing such as penalties, logit_bias or grammar masks; on the prefill role, the prompt
forward's logits), *before* temperature, top-k, top-p and min-p. That is vLLM's default
(``logprobs_mode="raw_logprobs"``): the model's own distribution, so a loglikelihood is the
model's and does not change with the sampling settings. Never the drafter's: a drafted token
gets the logprob the target gives it at its position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specmesh.protocol.messages import TokenLogprobs

#: rows whose log_softmax is computed at once (bounds the temporary of a long prompt's)
ROWS_PER_BLOCK = 256


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], k: int) -> TokenLogprobs:
    """Logprobs of ``token_ids`` under ``logits`` row by row, with each row's top ``k``.

    Args:
        logits: [n, vocab] target logits (any float dtype; computed in float32), row i the
            distribution token i was chosen from.
        token_ids: n token ids (row i's chosen token).
        k: top logprobs per row (0: none), at most the vocabulary.

    Returns:
        n entries; ``top_*`` empty lists when ``k`` is 0; ``ranks`` the chosen tokens' ranks
        (1 + the tokens strictly more likely).

    Raises:
        ValueError: a row count that is not ``len(token_ids)``, or ``k`` out of ``[0, vocab]``.
    """
    n, vocab = logits.shape
    if n != len(token_ids):
        raise ValueError(f"{n} logits rows for {len(token_ids)} tokens")
    if not 0 <= k <= vocab:
        raise ValueError(f"k must be in [0, {vocab}], got {k}")
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device)
    out = TokenLogprobs(token_logprobs=[], top_token_ids=[], top_logprobs=[], ranks=[])
    # a block of rows at a time: a long prompt's log_softmax never doubles its logits' memory
    for lo in range(0, n, ROWS_PER_BLOCK):
        lp = torch.log_softmax(logits[lo:lo + ROWS_PER_BLOCK].float(), dim=-1)
        rows = lp.shape[0]
        chosen = lp.gather(1, ids[lo:lo + rows, None])
        out.token_logprobs.extend(chosen[:, 0].cpu().tolist())
        out.ranks.extend(((lp > chosen).sum(dim=-1) + 1).cpu().tolist())
        if k == 0:
            out.top_token_ids.extend([] for _ in range(rows))
            out.top_logprobs.extend([] for _ in range(rows))
            continue
        top = lp.topk(k, dim=-1)
        out.top_token_ids.extend(top.indices.cpu().tolist())
        out.top_logprobs.extend(top.values.cpu().tolist())
    return out
