"""N-gram / prompt-lookup drafting (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram``).

The last ``n`` tokens of the context (``n`` from ``max_ngram`` down to ``min_ngram``) are
searched for earlier in the context; the tokens that followed the most recent earlier match are
the draft. Stateless: the context is the state, so rollback is free. ``min_ngram=2`` (as Hugging
Face's prompt lookup): single-token matches draft mostly noise; measured on the bundled prompts
(SmolLM2, fp32, kappa 4) acceptance rose from 0.42 to 0.52 and throughput by about 9%.
"""

from __future__ import annotations

from drafter.proposer import Proposer, register_proposer


@register_proposer
class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    def open(self, request_id: str, context_token_ids: list[int]) -> None:
        pass

    def propose(self, request_id: str, context_token_ids: list[int], num_tokens: int) -> list[int]:
        ctx = context_token_ids
        n_ctx = len(ctx)
        if num_tokens <= 0 or n_ctx < 2:
            return []
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            pattern = ctx[n_ctx - n:]
            first = pattern[0]
            # Most recent earlier occurrence whose continuation is non-empty.
            for start in range(n_ctx - n - 1, -1, -1):
                if ctx[start] == first and ctx[start:start + n] == pattern:
                    cont = ctx[start + n:start + n + num_tokens]
                    if cont:
                        return list(cont)
        return []

    def rollback(self, request_id: str, num_context_tokens: int) -> None:
        pass

    def close(self, request_id: str) -> None:
        pass
