"""OpenAI's ``n`` and ``best_of``: several choices of one prompt, prefilled once.

Each choice of a prompt is a request of its own to the verifier (its stream, stop strings,
abort), all with the same sibling ``group`` so that one verifier prefills the prompt once and
forks the others from its KV (decode/siblings.py). Choice ``j`` of a seeded request samples with
:func:`choice_seed` ``(seed, j)``: choice 0 keeps the request's seed (so ``n = 1`` is unchanged)
and every choice is reproducible on its own; at temperature 0 every choice is the greedy output.

``best_of`` (completions, OpenAI's legacy parameter; vLLM v0): ``best_of`` candidates are
generated and the ``n`` with the highest log probability per token are returned (OpenAI's
definition of "best"), best first; the usage counts every candidate's tokens (all were
generated). It cannot be streamed (OpenAI refuses that too).
"""

from __future__ import annotations

import hashlib
import math

import msgspec

from specmesh.protocol.messages import GenerateRequest

#: most requests (prompts x choices) one HTTP request may fan out to
MAX_CHOICES = 1024


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice ``choice`` of a request seeded with ``seed``: ``seed`` itself for
    choice 0, else a 63-bit value derived from (seed, choice) by BLAKE2b (any two choices
    differ; the same pair always gives the same seed). None stays None (unseeded)."""
    if seed is None or choice == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{choice}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def choice_request(base: GenerateRequest, request_id: str, choice: int, group: str,
                   group_size: int, want_logprobs: bool = False) -> GenerateRequest:
    """Choice ``choice`` of ``base``: its own id and seed, the prompt's sibling group, and
    (``want_logprobs``: ``best_of`` ranks by them) at least the chosen tokens' logprobs."""
    sampling = base.sampling
    changes = {}
    seed = choice_seed(sampling.seed, choice)
    if seed != sampling.seed:
        changes["seed"] = seed
    if want_logprobs and sampling.logprobs is None:
        changes["logprobs"] = 0
    if changes:
        sampling = msgspec.structs.replace(sampling, **changes)
    return msgspec.structs.replace(base, request_id=request_id, sampling=sampling,
                                   group=group if group_size > 1 else "",
                                   group_size=group_size)


def mean_logprob(token_logprobs: list[float]) -> float:
    """Log probability per token of a candidate (``-inf`` for an empty one)."""
    if not token_logprobs:
        return -math.inf
    return sum(token_logprobs) / len(token_logprobs)


def best_indices(scores: list[float], n: int) -> list[int]:
    """Indices of the ``n`` highest ``scores``, best first (ties: the earlier candidate)."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return order[:n]


__all__ = ["MAX_CHOICES", "best_indices", "choice_request", "choice_seed", "mean_logprob"]
