"""Suffix decoding (SuffixDecoding, Oliaro et al., arXiv 2411.04975; ArcticInference's
``suffix_decoding``; vLLM's ``method: "suffix"``): drafts copied from token sequences seen
before, chosen by how often each continuation followed the context's suffix. No model, no
forward: all of it is CPU work on the drafter.

Indexes, each a counted suffix trie of ``depth`` tokens (drafter/suffix_trie.py: bounded in
depth, so that appending or rolling back a token touches at most ``depth`` nodes whatever the
context's length; leaf-compressed, so that it keeps about a node or two per token rather than
``depth``; that module's docstring gives the structure, its costs and its source):

- **per request**: the request's prompt and output, every token the drafter is shown for it
  (updated as its context grows, rolled back with the drafts the verifier rejected, dropped
  at :meth:`SuffixProposer.close`);
- **history** (the paper's global tree): the outputs of the requests this drafter finished,
  shared by all its requests, at most ``max_global_tokens`` tokens, the oldest request evicted
  first. A request's output is what it was shown after the context it was opened with (the
  drafter gets prompt and first tokens together), possibly ending in a few drafts the verifier
  never judged (the drafter is not told which of its last drafts a finished request accepted:
  copies of text the indexes held, harmless to exactness). Prompts are not kept, as in
  ArcticInference (the request's own prompt is in its own index);
- **corpora**: token sequences loaded by name at run time (:meth:`SuffixProposer.load_corpus`,
  SGLang's external corpus), at most ``max_corpus_tokens`` in all, never evicted.

Drafting (ArcticInference's ``SuffixTree::speculate``, path mode): for each length m = 1, 2,
... up to ``max_match`` of a suffix of the context that occurs in an index, walk from the match
along the most frequent follower (the latest among equals), multiplying a running probability
by ``count(child) / count(node)``; stop at ``min(num_tokens, floor(max_spec_factor * m +
max_spec_offset))`` tokens or when the probability falls below ``min_token_prob``. The draft's
score is the sum of its tokens' probabilities (the tokens it expects accepted); the best score
over every m and index wins, ties to the longer match, then per request before history before
corpora. In the per-request index the context's own end is an occurrence of every suffix that
nothing follows yet; it is not counted at the match, so a suffix seen once before drafts what
followed it with probability 1, as prompt lookup does (drafter/proposers/ngram.py): with no
history and no corpus, a context where prompt lookup finds a match gets a draft here too.

Trees (``tree_width`` > 1; tree verification, docs/verification.md): branch 0 is the chain
above; further branches start at the likeliest other follower of any node already in the tree
(best first by path probability, at least ``min_token_prob``, as ArcticInference's tree mode
expands) and follow the most frequent followers from there, each at most as deep as the chain's
cap, ``tree_width`` branches in all.

Exactness: drafts are only proposals; the verifier decides every token (one-hot drafts, like
n-gram's), so greedy output equals plain decode whatever the indexes hold.

Cost: per step, appending the context's new tokens to the request's index and rolling back
rejected drafts is O(depth) per token; matching is free in the request's index (its suffixes
are its active points) and O(max_match^2) token steps at most in the shared ones; drafting walks
at most ``num_tokens`` nodes per match length. Nothing scans the context. Opening a request
indexes its prompt (O(depth) per token); finishing one indexes its output in the history.

Threads: the drafter worker calls ``open`` / ``propose`` / ``rollback`` / ``close`` from one
thread. :meth:`load_corpus`, :meth:`drop_corpus` and :meth:`clear_history` may be called from
another: they take a lock drafting also takes, for at most :data:`CORPUS_STEP` tokens at a
time, so a large corpus loads without stalling drafting for long.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
import threading
from collections import deque
from dataclasses import dataclass

from specmesh.drafter.options import Option, OptionSchema
from specmesh.drafter.proposer import Proposer
from specmesh.drafter.registry import register_proposer
from specmesh.drafter.suffix_trie import Cursor, SuffixTrie

#: defaults (vLLM's suffix decoding: depth 24, factor 1.0, min_token_prob 0.1)
DEFAULT_DEPTH = 24
DEFAULT_MAX_MATCH = 16
DEFAULT_FACTOR = 1.0
DEFAULT_OFFSET = 0.0
DEFAULT_MIN_PROB = 0.1
DEFAULT_GLOBAL_TOKENS = 65536
DEFAULT_CORPUS_TOKENS = 262144
DEFAULT_TREE_WIDTH = 2
#: tokens of a corpus indexed (or removed) per hold of the lock drafting takes
CORPUS_STEP = 256
#: tokens of a request's latest context whose rollback also restores the tie-break among
#: equally frequent followers (drafter/suffix_trie.py, ``undo``): more than a run-ahead window
UNDO_TOKENS = 64
#: where drafts come from, in the order ties are broken
SOURCES = ("request", "history", "corpus")
_SEQ = 0  # the key of a request's one sequence in its own trie


def _check(kwargs: dict) -> None:
    """``max_match`` must leave room for a draft within ``depth``. Raises ValueError."""
    depth = kwargs.get("depth", DEFAULT_DEPTH)
    match = kwargs.get("max_match", DEFAULT_MAX_MATCH)
    if match >= depth:
        raise ValueError(f"match ({match}) must be below depth ({depth}): the index holds "
                         "a match and its draft together")


@dataclass
class _Request:
    """A request's own index, the length of the context it was opened with, and the history's
    epoch then (its output joins the history only if no clear came since)."""

    trie: SuffixTrie
    open_len: int
    epoch: int


@dataclass
class _Draft:
    """A scored chain: from ``cursor`` (count ``denom`` as its followers' denominator) of
    ``trie``, drafted for a match of ``match_len`` tokens, at most ``cap`` tokens."""

    score: float
    tokens: list[int]
    source: str
    match_len: int
    trie: SuffixTrie
    cursor: Cursor
    denom: int
    cap: int


@register_proposer
class SuffixProposer(Proposer):
    """Suffix decoding (module docstring). Options: trie ``depth``, longest ``match``, draft
    length ``factor`` / ``offset``, ``prob`` (lowest token probability), ``global`` (history
    budget, tokens), ``corpus`` (corpora budget, tokens), tree ``width``.

    Raises:
        ValueError: an option out of range (also refused by the schema at the command line).
    """

    name = "suffix"
    summary = ("suffix decoding: the continuation that most often followed the context's "
               "suffix in the request, earlier outputs and loaded corpora")
    options = OptionSchema((
        Option("depth", int, "longest token string indexed: a match plus its draft",
               DEFAULT_DEPTH, minimum=2),
        Option("match", int, "longest suffix of the context matched", DEFAULT_MAX_MATCH,
               kwarg="max_match", minimum=1),
        Option("factor", float, "drafts per matched token: a match of m tokens drafts at "
               "most factor*m+offset", DEFAULT_FACTOR, kwarg="max_spec_factor", minimum=0.0),
        Option("offset", float, "drafts added to factor*m", DEFAULT_OFFSET,
               kwarg="max_spec_offset"),
        Option("prob", float, "lowest probability of a draft token (its path's share of "
               "the match's occurrences)", DEFAULT_MIN_PROB, kwarg="min_token_prob",
               minimum=0.0, maximum=1.0),
        Option("global", int, "tokens of finished requests' outputs kept for every request, "
               "oldest evicted first (0: none)", DEFAULT_GLOBAL_TOKENS,
               kwarg="max_global_tokens", minimum=0),
        Option("corpus", int, "most tokens of corpora loaded at run time (0: none)",
               DEFAULT_CORPUS_TOKENS, kwarg="max_corpus_tokens", minimum=0),
        Option("width", int, "branches of a draft tree (tree verification; 1: chains only)",
               DEFAULT_TREE_WIDTH, kwarg="tree_width", minimum=1),
    ), check=_check)
    supports_corpus = True  # load_corpus / drop_corpus / clear_history (docs/drafters.md)
    draft_shape = "tree"  # a chain when tree_width is 1 or nothing else is likely
    #: no model: no weights, no draft KV, no forwards (drafter/draft_memory.py; its tries
    #: are token indexes, not a draft KV)
    draft_weights_bytes = draft_kv_pool_bytes = num_draft_forwards = 0

    def __init__(self, depth: int = DEFAULT_DEPTH, max_match: int = DEFAULT_MAX_MATCH,
                 max_spec_factor: float = DEFAULT_FACTOR,
                 max_spec_offset: float = DEFAULT_OFFSET,
                 min_token_prob: float = DEFAULT_MIN_PROB,
                 max_global_tokens: int = DEFAULT_GLOBAL_TOKENS,
                 max_corpus_tokens: int = DEFAULT_CORPUS_TOKENS,
                 tree_width: int = DEFAULT_TREE_WIDTH) -> None:
        if depth < 2 or not 1 <= max_match < depth:
            raise ValueError(f"need depth >= 2 and 1 <= max_match < depth, got depth {depth}, "
                             f"max_match {max_match}")
        if max_spec_factor < 0 or not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"need max_spec_factor >= 0 and min_token_prob in [0, 1], got "
                             f"{max_spec_factor}, {min_token_prob}")
        if max_global_tokens < 0 or max_corpus_tokens < 0 or tree_width < 1:
            raise ValueError(f"need max_global_tokens, max_corpus_tokens >= 0 and tree_width "
                             f">= 1, got {max_global_tokens}, {max_corpus_tokens}, {tree_width}")
        self.depth = depth
        self.max_match = max_match
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self.min_token_prob = min_token_prob
        self.max_global_tokens = max_global_tokens
        self.max_corpus_tokens = max_corpus_tokens
        self.tree_width = tree_width
        self._requests: dict[str, _Request] = {}
        self._history = SuffixTrie(depth)
        self._history_order: deque[int] = deque()  # history keys, oldest first
        self._history_keys = itertools.count()
        self._epoch = 0  # clears of the history so far
        self._corpus = SuffixTrie(depth)
        self._corpus_reserved = 0  # tokens of loads under way, counted against the budget
        self._lock = threading.Lock()  # the shared indexes: drafting vs. corpus / history calls
        self._load_lock = threading.Lock()  # one corpus load or drop at a time
        #: per source: drafts proposed and their tokens (counters for metrics)
        self.num_drafts = dict.fromkeys(SOURCES, 0)
        self.num_draft_tokens = dict.fromkeys(SOURCES, 0)

    # -- requests --------------------------------------------------------------------------

    def open(self, request_id: str, context_token_ids: list[int]) -> None:
        """Index the request's context (a request already open is closed first)."""
        if request_id in self._requests:
            self.close(request_id)
        trie = SuffixTrie(self.depth, undo=UNDO_TOKENS)
        trie.extend(_SEQ, context_token_ids)
        self._requests[request_id] = _Request(trie, len(context_token_ids), self._epoch)

    def rollback(self, request_id: str, num_context_tokens: int) -> None:
        st = self._requests.get(request_id)
        if st is None:
            return
        n = max(num_context_tokens, 0)
        st.trie.truncate(_SEQ, n)
        st.open_len = min(st.open_len, n)

    def close(self, request_id: str) -> None:
        """Drop the request's index; its output joins the history (when ``global`` > 0 and
        the history was not cleared since the request opened)."""
        st = self._requests.pop(request_id, None)
        if st is None:
            return
        output = list(st.trie.tokens(_SEQ)[st.open_len:])
        if output and self.max_global_tokens:
            with self._lock:
                if st.epoch == self._epoch:
                    self._remember(output)

    def _request(self, request_id: str, ctx: list[int]) -> _Request:
        """The request's index, brought to ``ctx``: the tokens past what it holds appended
        (the worker's contract: ``ctx`` extends what it held after the last rollback, checked
        on the last ``depth`` tokens); a context that left it (a caller outside that contract)
        is re-indexed from their common prefix. A request never opened is opened here."""
        st = self._requests.get(request_id)
        if st is None:
            self.open(request_id, ctx)
            return self._requests[request_id]
        held = st.trie.tokens(_SEQ)
        h, n = len(held), len(ctx)
        k = min(h, self.depth)
        if h <= n and ctx[h - k:h] == held[h - k:]:
            if n > h:
                st.trie.extend(_SEQ, ctx[h:])
            return st
        lcp = 0
        while lcp < min(h, n) and ctx[lcp] == held[lcp]:
            lcp += 1
        st.trie.truncate(_SEQ, lcp)
        st.trie.extend(_SEQ, ctx[lcp:])
        st.open_len = min(st.open_len, lcp)
        return st

    # -- drafting --------------------------------------------------------------------------

    def propose(self, request_id: str, context_token_ids: list[int], num_tokens: int) -> list[int]:
        with self._lock:
            best = self._best(request_id, context_token_ids, num_tokens)
            if best is None:
                return []
            self._count(best, len(best.tokens))
            return list(best.tokens)

    def propose_tree(self, request_id: str, context_token_ids: list[int],
                     num_tokens: int) -> tuple[list[int], list[int]]:
        """Up to ``tree_width`` branches from the best match (module docstring):
        ``(draft_token_ids, parents)``, parents[j] < j, -1 = the context's last token; branch
        0 is :meth:`propose`'s chain."""
        with self._lock:
            best = self._best(request_id, context_token_ids, num_tokens)
            if best is None:
                return [], []
            if self.tree_width == 1:
                tokens, parents = list(best.tokens), list(range(-1, len(best.tokens) - 1))
            else:
                tokens, parents = self._tree(best)
            self._count(best, len(tokens))
            return tokens, parents

    def _count(self, best: _Draft, num_tokens: int) -> None:
        self.num_drafts[best.source] += 1
        self.num_draft_tokens[best.source] += num_tokens
        self.num_draft_tokens_proposed += num_tokens  # the drafter's metrics (Proposer)
        if best.source == "corpus":
            self.num_corpus_draft_tokens += num_tokens

    def _cap(self, match_len: int, num_tokens: int) -> int:
        """Most drafts for a match of ``match_len`` tokens: the paper's ``max_spec_factor *
        m + max_spec_offset``, within ``num_tokens``."""
        return min(num_tokens,
                   int(self.max_spec_factor * match_len + self.max_spec_offset + 1e-6))

    def _best(self, request_id: str, ctx: list[int], num_tokens: int) -> _Draft | None:
        """The best-scoring chain over every match length and index (module docstring), or
        None when no index has a draft. Called with the lock held."""
        st = self._request(request_id, ctx)
        if num_tokens <= 0 or not ctx:
            return None
        best: _Draft | None = None
        own = st.trie
        # the request's own index: its suffixes are free; the context's end is not counted
        for m, cursor in enumerate(own.suffixes(_SEQ)[:self.max_match], 1):
            denom = own.count(cursor) - 1
            if denom <= 0:  # seen nowhere else: nor is any longer suffix
                break
            best = self._consider(best, "request", own, cursor, denom, m, num_tokens)
        for source, trie in (("history", self._history), ("corpus", self._corpus)):
            if not trie.num_tokens:
                continue
            for m in range(1, min(self.max_match, len(ctx)) + 1):
                cursor = trie.find(ctx[-m:])
                if cursor is None:  # nor any longer suffix
                    break
                best = self._consider(best, source, trie, cursor, trie.count(cursor), m,
                                      num_tokens)
        return best

    def _consider(self, best: _Draft | None, source: str, trie: SuffixTrie, cursor: Cursor,
                  denom: int, match_len: int, num_tokens: int) -> _Draft | None:
        """``best``, or the chain from ``cursor`` when it scores higher (or as high from a
        longer match of the same index)."""
        cap = self._cap(match_len, num_tokens)
        if cap <= 0:
            return best
        score, tokens = self._chain(trie, cursor, denom, cap)
        if not tokens:
            return best
        if best is None or score > best.score or (score == best.score and
                                                   source == best.source):
            return _Draft(score, tokens, source, match_len, trie, cursor, denom, cap)
        return best

    def _chain(self, trie: SuffixTrie, cursor: Cursor, denom: int,
               cap: int) -> tuple[float, list[int]]:
        """The most frequent path from ``cursor``: ``(score, tokens)``, at most ``cap``
        tokens, each of probability at least ``min_token_prob``."""
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        while len(tokens) < cap:
            top = trie.top_child(cursor)
            if top is None:
                break
            tok, cursor, count = top
            prob *= count / denom
            if prob < self.min_token_prob:
                break
            tokens.append(tok)
            score += prob
            denom = count
        return score, tokens

    def _tree(self, best: _Draft) -> tuple[list[int], list[int]]:
        """Branch 0 = ``best``'s chain, then up to ``tree_width - 1`` branches, each started at
        the likeliest follower not yet in the tree (best first) and grown along the most
        frequent followers, all at most ``best.cap`` deep."""
        trie, floor, cap = best.trie, self.min_token_prob, best.cap
        tokens: list[int] = []
        parents: list[int] = []
        heap: list[tuple] = []
        tie = itertools.count()

        def grow(cursor: Cursor, denom: int, prob: float, parent: int, depth: int) -> None:
            while depth < cap:
                top = trie.top_child(cursor)
                if top is None:
                    break
                tok, child, count = top
                p = prob * count / denom
                if p < floor:
                    break
                # the others at least as likely as the floor: count >= floor * denom / prob
                least = max(math.ceil(floor * denom / prob - 1e-9), 1)
                for other, other_cursor, n in trie.children(cursor, least):
                    q = prob * n / denom
                    if q < floor:
                        break
                    if other != tok:
                        heapq.heappush(heap, (-q, next(tie), parent, depth + 1, other,
                                              other_cursor, n))
                tokens.append(tok)
                parents.append(parent)
                parent = len(tokens) - 1
                cursor, denom, prob, depth = child, count, p, depth + 1

        grow(best.cursor, best.denom, 1.0, -1, 0)
        branches = 1
        while branches < self.tree_width and heap:
            neg_p, _, parent, depth, tok, cursor, count = heapq.heappop(heap)
            tokens.append(tok)
            parents.append(parent)
            grow(cursor, count, -neg_p, len(tokens) - 1, depth)
            branches += 1
        return tokens, parents

    # -- the shared indexes ----------------------------------------------------------------

    def _remember(self, output: list[int]) -> None:
        """Add a finished request's output to the history, evicting the oldest requests
        until it fits (an output above the whole budget keeps its first tokens). Called with
        the lock held."""
        output = output[:self.max_global_tokens]
        history = self._history
        while self._history_order and \
                history.num_tokens + len(output) > self.max_global_tokens:
            history.discard(self._history_order.popleft())
        key = next(self._history_keys)
        history.extend(key, output)
        self._history_order.append(key)

    def clear_history(self) -> None:
        """Forget every finished request's output (the history), and keep the outputs of the
        requests open now out of it when they finish: after a clear the history holds only
        requests opened after it (a request that finished on the verifier but whose close has
        not reached this drafter yet counts as open). Loaded corpora stay."""
        with self._lock:
            self._history = SuffixTrie(self.depth)
            self._history_order.clear()
            self._epoch += 1

    def load_corpus(self, name: str, token_ids: list[int]) -> None:
        """Index ``token_ids`` as corpus ``name``, drafted from by every request; a corpus
        already loaded under ``name`` is replaced (dropped first, :meth:`Proposer.load_corpus`).
        Indexed :data:`CORPUS_STEP` tokens per hold of the drafting lock.

        Raises:
            ValueError: an empty name, a token that is not an integer >= 0, or a load that
                would take the corpora past ``max_corpus_tokens`` (nothing is loaded then, and
                a corpus it was to replace is gone).
            TypeError: a name that is not a string.
        """
        if not isinstance(name, str):
            raise TypeError(f"corpus name must be a string, got {type(name).__name__}")
        if not name:
            raise ValueError("corpus name is empty")
        try:
            ids = [operator.index(t) for t in token_ids]
        except TypeError:
            raise ValueError(f"corpus {name!r}: token ids must be integers") from None
        if any(t < 0 for t in ids):
            raise ValueError(f"corpus {name!r}: token ids must be >= 0")
        self.drop_corpus(name)  # a load replaces; loads come one at a time (the worker's thread)
        with self._load_lock:
            with self._lock:
                held = self._corpus.num_tokens + self._corpus_reserved
                if held + len(ids) > self.max_corpus_tokens:
                    raise ValueError(
                        f"corpus {name!r}: {len(ids)} tokens would take the corpora to "
                        f"{held + len(ids)}, above their budget of {self.max_corpus_tokens} "
                        f"(--drafter suffix:corpus=N)")
                self._corpus_reserved = len(ids)  # loads take turns (_load_lock)
                self._corpus.extend(name, [])  # the name exists from now on
            try:
                for a in range(0, len(ids), CORPUS_STEP):
                    piece = ids[a:a + CORPUS_STEP]
                    with self._lock:
                        self._corpus.extend(name, piece)
                        self._corpus_reserved -= len(piece)
            finally:
                with self._lock:
                    self._corpus_reserved = 0

    def drop_corpus(self, name: str) -> bool:
        """Remove corpus ``name`` (in steps of :data:`CORPUS_STEP` start positions per hold of
        the drafting lock); False when no corpus has that name."""
        with self._load_lock:
            with self._lock:
                if name not in self._corpus:
                    return False
                steps = self._corpus.discard_steps(name, CORPUS_STEP)
                next(steps, None)
            while True:
                with self._lock:
                    if next(steps, None) is None:
                        return True

    def corpora(self) -> dict[str, int]:
        """Loaded corpora: name -> tokens."""
        with self._lock:
            return {name: len(self._corpus.tokens(name)) for name in self._corpus.keys()}

    def index_stats(self) -> dict:
        """Sizes of the shared indexes and where drafts came from (counters since start):
        ``history_tokens``, ``history_requests``, ``corpus_tokens``, ``num_corpora``,
        ``num_drafts`` and ``num_draft_tokens`` per source (request, history, corpus)."""
        with self._lock:
            return {"history_tokens": self._history.num_tokens,
                    "history_requests": len(self._history_order),
                    "corpus_tokens": self._corpus.num_tokens,
                    "num_corpora": len(self._corpus),
                    "num_drafts": dict(self.num_drafts),
                    "num_draft_tokens": dict(self.num_draft_tokens)}
