"""An index of token corpora for drafting by suffix match: where else the last ``n`` tokens of a
context occur, in documents the context does not contain (SGLang loads an external corpus into
its n-gram structure, ``external_corpus_manager.py``; notes_drafters_2 section 1).

One immutable :class:`CorpusIndex` covers every loaded corpus: their tokens end to end, one
separator between two corpora, and per key length ``n`` a table of the windows of ``n`` tokens
that have a continuation (a next token in the same corpus), as their 64-bit polynomial hashes
sorted with their start positions. A query hashes the context's last ``n`` tokens (O(n)),
binary-searches the table (O(log N)), and checks at most ``max_candidates`` occurrences token
by token (hash collisions never become drafts), ranking them by how far they agree with the
context before the key (at most ``max_extend`` tokens back). So a query costs the same whatever
the size or number of the corpora; building costs O(N log N) per key length, in numpy.

Memory: 4 bytes per corpus token plus 16 per token and key length.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

#: the polynomial hash's base (odd, 64 bits) and modulus (2**64: numpy's uint64 arithmetic)
_BASE = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
#: marks the border of two corpora in the concatenated tokens (never a token id)
SEPARATOR = -1
#: occurrences of a key checked per query, and how far back two matches are compared to rank
#: them (both bound a query's cost)
MAX_CANDIDATES = 8
MAX_EXTEND = 32


def _key_hash(tokens: Iterable[int]) -> int:
    """The hash a table stores for a window of ``tokens`` (each shifted by one, so that token 0
    weighs in)."""
    h = 0
    for t in tokens:
        h = (h * _BASE + t + 1) & _MASK
    return h


class CorpusIndex:
    """The windows of ``corpora`` (name -> token ids) of each length in ``key_lengths``.

    Raises:
        ValueError: a token id below 0 or above 2**31 - 1, no key length, or one below 1.
    """

    def __init__(self, corpora: Mapping[str, Sequence[int]], key_lengths: Iterable[int],
                 max_candidates: int = MAX_CANDIDATES, max_extend: int = MAX_EXTEND) -> None:
        lengths = sorted(set(key_lengths), reverse=True)
        if not lengths or lengths[-1] < 1:
            raise ValueError(f"key lengths must be >= 1, got {lengths}")
        self.max_candidates = max_candidates
        self.max_extend = max_extend
        self.num_tokens = {name: len(ids) for name, ids in corpora.items()}
        flat = array("i")
        for ids in corpora.values():
            part = token_array(ids)
            if flat:
                flat.append(SEPARATOR)
            flat.extend(part)
        #: every corpus end to end (array('i'): token-by-token checks compare in C)
        self.tokens = flat
        self._tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        values = np.frombuffer(flat, dtype=np.int32) if flat else np.zeros(0, np.int32)
        for n in lengths:
            table = _windows(values, n)
            if table is not None:
                self._tables[n] = table

    @property
    def key_lengths(self) -> list[int]:
        """The key lengths with at least one window, longest first."""
        return sorted(self._tables, reverse=True)

    def continuations(self, context: Sequence[int], n: int, num_tokens: int,
                      limit: int = 1) -> list[list[int]]:
        """Up to ``limit`` distinct continuations (each at most ``num_tokens`` tokens, none
        crossing into another corpus) of the occurrences of ``context[-n:]``, the one that
        agrees longest with the context before the key first (the earlier occurrence on a
        tie). ``[]`` when ``n`` is not a key length, the context is shorter than ``n``, or
        nothing matches. Cost: O(n + log N + max_candidates * (n + max_extend))."""
        table = self._tables.get(n)
        if table is None or num_tokens <= 0 or limit <= 0 or len(context) < n:
            return []
        hashes, starts = table
        key = np.uint64(_key_hash(context[len(context) - n:]))
        lo = int(hashes.searchsorted(key, "left"))
        hi = min(int(hashes.searchsorted(key, "right")), lo + self.max_candidates)
        if lo >= hi:
            return []
        tokens = self.tokens
        pattern = array("i", context[len(context) - n:])
        ranked = []
        for s in starts[lo:hi].tolist():
            if tokens[s:s + n] != pattern:  # a hash collision
                continue
            ranked.append((-self._agreement(context, n, s), s))
        ranked.sort()
        out: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for _, s in ranked:
            cont = tokens[s + n:s + n + num_tokens].tolist()
            if SEPARATOR in cont:
                cont = cont[:cont.index(SEPARATOR)]
            if cont and tuple(cont) not in seen:
                seen.add(tuple(cont))
                out.append(cont)
                if len(out) >= limit:
                    break
        return out

    def _agreement(self, context: Sequence[int], n: int, start: int) -> int:
        """How many tokens before the key (at most ``max_extend``) the occurrence at ``start``
        shares with the context."""
        tokens = self.tokens
        j = 0
        c = len(context) - n - 1
        while j < self.max_extend and c - j >= 0 and start - 1 - j >= 0 \
                and tokens[start - 1 - j] == context[c - j]:
            j += 1
        return j


def token_array(ids: Sequence[int]) -> array:
    """``ids`` as array('i') (itself when it is one), refusing ids outside [0, 2**31).

    Raises:
        ValueError: an id out of that range or not an int.
    """
    if isinstance(ids, array) and ids.typecode == "i":
        out = ids
    else:
        try:
            out = array("i", ids)
        except (OverflowError, TypeError) as err:
            raise ValueError(f"corpus token ids must be ints in [0, 2**31): {err}"
                             ) from None
    if out and min(out) < 0:
        raise ValueError(f"corpus token ids must be >= 0, got {min(out)}")
    return out


def _windows(values: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The windows of ``n`` tokens of ``values`` followed by a token of the same corpus, as
    (their hashes sorted, their start positions in the same order); None when there is none."""
    m = len(values) - n  # windows whose next token exists
    if m <= 0:
        return None
    shifted = values.astype(np.uint64) + np.uint64(1)  # the separator becomes 0
    h = np.zeros(m, dtype=np.uint64)
    base = np.uint64(_BASE)
    for j in range(n):
        h = h * base + shifted[j:j + m]
    # a window and its next token must lie in one corpus: no separator in [s, s + n]
    seps = np.concatenate(([0], np.cumsum(values == SEPARATOR)))
    ok = (seps[n + 1:n + 1 + m] - seps[:m]) == 0
    starts = np.flatnonzero(ok)
    if not len(starts):
        return None
    h = h[starts]
    order = np.argsort(h, kind="stable")
    return h[order], starts[order]
