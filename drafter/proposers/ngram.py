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

Corpora (docs/drafters.md, 'Corpora'; SGLang's external corpus, notes_drafters_2 section 1):
token sequences loaded at run time (:meth:`NgramProposer.load_corpus`) are searched too, through
a :class:`~drafter.corpus_index.CorpusIndex` (no scan of the corpora per step). At each suffix
length the context's own matches come first, then the corpora's; before all of them, a match
of the context's last :data:`LONG_KEY` tokens in a corpus (a long agreement with a passage is
the best evidence there is that the output copies it). Without corpora the drafts are the
ones above, unchanged.
"""

from __future__ import annotations

import threading
from array import array

from specmesh.drafter.config import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM
from specmesh.drafter.corpus_index import CorpusIndex, token_array
from specmesh.drafter.options import Option, OptionSchema
from specmesh.drafter.proposer import Proposer
from specmesh.drafter.registry import register_proposer

#: Branches of an n-gram tree by default (docs/benchmarks.md, 'Drafting')
DEFAULT_TREE_WIDTH = 2
#: the key length of a corpus's long matches, searched before the suffix lengths
LONG_KEY = 16


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
    supports_corpus = True
    #: no model: no weights, no draft KV, no forwards (drafter/draft_memory.py)
    draft_weights_bytes = draft_kv_pool_bytes = num_draft_forwards = 0

    def __init__(self, min_ngram: int = DEFAULT_MIN_NGRAM, max_ngram: int = DEFAULT_MAX_NGRAM,
                 tree_width: int = DEFAULT_TREE_WIDTH) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if tree_width < 1:
            raise ValueError(f"tree_width must be >= 1, got {tree_width}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.tree_width = tree_width
        #: loaded corpora (name -> token ids) and their index; replaced whole by a corpus
        #: operation (one assignment each: propose reads ``_index`` once per call)
        self._corpora: dict[str, array] = {}
        self._index: CorpusIndex | None = None
        self._corpus_lock = threading.Lock()  # corpus operations, one at a time

    def _continuations(self, ctx: list[int], num_tokens: int, limit: int = 1):
        """``(continuation, from a corpus)`` pairs, each continuation up to ``num_tokens``
        tokens: a corpus's long match first, then per suffix length (longest first) the
        earlier matches in the context (most recent first), then the corpora's (at most
        ``limit`` per length)."""
        n_ctx = len(ctx)
        index = self._index
        if index is not None and n_ctx >= LONG_KEY > self.max_ngram:
            for cont in index.continuations(ctx, LONG_KEY, num_tokens, limit):
                yield cont, True
        for n in range(min(self.max_ngram, n_ctx), self.min_ngram - 1, -1):
            pattern = ctx[n_ctx - n:]
            first = pattern[0]
            for start in range(n_ctx - n - 1, -1, -1):
                if ctx[start] == first and ctx[start:start + n] == pattern:
                    cont = ctx[start + n:start + n + num_tokens]
                    if cont:
                        yield cont, False
            if index is not None:
                for cont in index.continuations(ctx, n, num_tokens, limit):
                    yield cont, True

    def propose_tree(self, request_id: str, context_token_ids: list[int],
                     num_tokens: int) -> tuple[list[int], list[int]]:
        """Up to ``tree_width`` distinct continuations as a token tree: ``(draft_token_ids,
        parents)``, parents[j] < j, -1 = the context's last token; a chain when only one
        continuation (or ``tree_width`` 1) exists."""
        if num_tokens <= 0 or not context_token_ids:
            return [], []
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}
        seen: set[tuple[int, ...]] = set()
        from_corpus = 0
        for cont, corpus in self._continuations(context_token_ids, num_tokens,
                                                self.tree_width):
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
                    from_corpus += corpus
                node = nxt
        self._count(len(tokens), from_corpus)
        return tokens, parents

    def open(self, request_id: str, context_token_ids: list[int]) -> None:
        pass

    def propose(self, request_id: str, context_token_ids: list[int], num_tokens: int) -> list[int]:
        if num_tokens <= 0 or not context_token_ids:
            return []
        # the longest suffix's most recent earlier occurrence with a non-empty continuation
        cont, corpus = next(self._continuations(context_token_ids, num_tokens), ([], False))
        self._count(len(cont), len(cont) if corpus else 0)
        return list(cont)

    def _count(self, num_tokens: int, num_from_corpus: int) -> None:
        """The metrics' counters (loop thread only)."""
        self.num_draft_tokens_proposed += num_tokens
        self.num_corpus_draft_tokens += num_from_corpus

    # -- corpora (Proposer's contract: called from the drafter's background thread) ----------

    def load_corpus(self, name: str, token_ids: list[int]) -> None:
        """Index ``token_ids`` with the others (O(N log N) in numpy over every corpus: the
        index is built anew aside and swapped in; drafting goes on meanwhile).

        Raises:
            ValueError: a token id outside [0, 2**31).
        """
        with self._corpus_lock:
            corpora = {**self._corpora, name: token_array(token_ids)}
            index = self._build(corpora)
            self._corpora, self._index = corpora, index

    def drop_corpus(self, name: str) -> bool:
        with self._corpus_lock:
            if name not in self._corpora:
                return False
            corpora = {k: v for k, v in self._corpora.items() if k != name}
            index = self._build(corpora) if corpora else None
            self._corpora, self._index = corpora, index
            return True

    def corpora(self) -> dict[str, int]:
        """Name -> tokens of every loaded corpus."""
        return {name: len(ids) for name, ids in self._corpora.items()}

    def _build(self, corpora: dict[str, array]) -> CorpusIndex:
        keys = range(self.min_ngram, self.max_ngram + 1)
        return CorpusIndex(corpora, [*keys, LONG_KEY] if LONG_KEY > self.max_ngram else keys)

    def rollback(self, request_id: str, num_context_tokens: int) -> None:
        pass

    def close(self, request_id: str) -> None:
        pass

