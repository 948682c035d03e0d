"""N-gram / prompt-lookup drafting (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram``).

The last ``n`` tokens of the context (``n`` from ``max_ngram`` down to ``min_ngram``) are
searched for earlier in the context; the tokens that followed the most recent earlier match are
the draft. Stateless: the context is the state, so rollback is free. ``min_ngram=2`` (as Hugging
Face's prompt lookup): single-token matches draft mostly noise (docs/benchmarks.md, 'Drafting').

Trees (``tree_width`` > 1; tree verification, SpecInfer arXiv 2305.09781): when several earlier
matches of the suffix are followed by different continuations, :meth:`propose_tree` returns
them as the branches of one token tree (a trie: shared prefixes shared), most recent match
first (branch 0 is the chain :meth:`propose` returns), longer suffix matches before shorter
ones, at most ``tree_width`` distinct continuations. The drafter worker asks for a tree only
for the segment that starts at the committed prefix (drafter/worker.py).
"""

from __future__ import annotations

from specmesh.drafter.config import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM
from specmesh.drafter.options import Option, OptionSchema
from specmesh.drafter.proposer import Proposer
from specmesh.drafter.registry import register_proposer

#: Branches of an n-gram tree by default (docs/benchmarks.md, 'Drafting')
DEFAULT_TREE_WIDTH = 2


def _check_lengths(kwargs: dict) -> None:
    """``min`` may not exceed ``max`` (either one defaulted). Raises ValueError."""
    lo = kwargs.get("min_ngram", DEFAULT_MIN_NGRAM)
    hi = kwargs.get("max_ngram", DEFAULT_MAX_NGRAM)
    if lo > hi:
        raise ValueError(f"min ({lo}) is above max ({hi})")


@register_proposer
class NgramProposer(Proposer):
    """Prompt lookup (module docstring). Options: ``min`` / ``max`` suffix match lengths,
    ``width`` branches of its trees."""

    name = "ngram"
    summary = "prompt lookup: drafts what followed earlier matches of the context's suffix"
    options = OptionSchema((
        Option("min", int, "shortest suffix match", DEFAULT_MIN_NGRAM, kwarg="min_ngram",
               minimum=1),
        Option("max", int, "longest suffix match", DEFAULT_MAX_NGRAM, kwarg="max_ngram",
               minimum=1),
        Option("width", int, "distinct continuations of earlier matches as the branches of "
               "a draft tree (tree verification; 1: chains only)", DEFAULT_TREE_WIDTH,
               kwarg="tree_width", minimum=1, flag="--ngram-tree-width"),
    ), check=_check_lengths)
    draft_shape = "tree"  # a chain when tree_width is 1 or the matches agree

    def __init__(self, min_ngram: int = DEFAULT_MIN_NGRAM, max_ngram: int = DEFAULT_MAX_NGRAM,
                 tree_width: int = DEFAULT_TREE_WIDTH) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if tree_width < 1:
            raise ValueError(f"tree_width must be >= 1, got {tree_width}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.tree_width = tree_width

    def _continuations(self, ctx: list[int], num_tokens: int):
        """Continuations (up to ``num_tokens``) of the earlier matches of the context's suffix:
        longest suffix first, most recent match first within one length."""
        n_ctx = len(ctx)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            pattern = ctx[n_ctx - n:]
            first = pattern[0]
            for start in range(n_ctx - n - 1, -1, -1):
                if ctx[start] == first and ctx[start:start + n] == pattern:
                    cont = ctx[start + n:start + n + num_tokens]
                    if cont:
                        yield cont

    def propose_tree(self, request_id: str, context_token_ids: list[int],
                     num_tokens: int) -> tuple[list[int], list[int]]:
        """Up to ``tree_width`` distinct continuations as a token tree: ``(draft_token_ids,
        parents)``, parents[j] < j, -1 = the context's last token; a chain when only one
        continuation (or ``tree_width`` 1) exists."""
        if num_tokens <= 0 or len(context_token_ids) < 2:
            return [], []
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}
        seen: set[tuple[int, ...]] = set()
        for cont in self._continuations(context_token_ids, num_tokens):
            if len(seen) >= self.tree_width:
                break
            if tuple(cont) in seen:
                continue
            seen.add(tuple(cont))
            node = -1
            for tok in cont:
                nxt = children.get((node, tok))
                if nxt is None:
                    nxt = children[(node, tok)] = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                node = nxt
        return tokens, parents

    def open(self, request_id: str, context_token_ids: list[int]) -> None:
        pass

    def propose(self, request_id: str, context_token_ids: list[int], num_tokens: int) -> list[int]:
        if num_tokens <= 0 or len(context_token_ids) < 2:
            return []
        # the longest suffix's most recent earlier occurrence with a non-empty continuation
        return list(next(self._continuations(context_token_ids, num_tokens), []))

    def rollback(self, request_id: str, num_context_tokens: int) -> None:
        pass

    def close(self, request_id: str) -> None:
        pass
