"""Drafting from a request's prediction (OpenAI Predicted Outputs: the client sends text it
expects to largely reappear in the answer, e.g. the file being edited).

The prediction is an extra draft source in front of whatever method the drafter runs
(drafter/worker.py asks it first and falls back to the method when it has nothing): its tokens
are proposed verbatim, a deterministic proposal the verifier judges one-hot, so the output
stays the target's (greedy: plain decode token for token; sampled: the target's distribution).

Alignment is a suffix match, never a position counter: the last tokens of the output (the
committed tokens and the drafter's own path after them) are looked up in an index of the
prediction's n-grams, longest first (``max_match`` tokens down to ``min_match``), and the
tokens that follow the match in the prediction are the draft. After a rejected draft, an edit
that inserts lines (the output runs ahead of the prediction) or deletes them (the output skips
part of it), the next lookup re-finds the place as soon as the output's suffix matches again.
This is how prompt lookup (Saxena 2023) finds its drafts, applied to the prediction instead of
the context; OpenAI documents the behaviour (matching not anchored to the output's start), not
its algorithm.

Both sequences are taken to begin with a start marker, so the first output tokens align with
the prediction's first tokens before a suffix of ``min_match`` real tokens exists. When a
suffix occurs several times in the prediction (a repeated line), the occurrence nearest to the
expected place wins: where the previous alignment would be if the output had followed the
prediction since (ties: the later one). That same expected place also admits a one-token
match, so a same-length replacement (one name for another) is re-found at its next token.

Cost per lookup: at most ``max_match`` dictionary probes of tuples of at most ``max_match``
tokens, and a binary search among a suffix's occurrences: independent of the lengths of the
prediction and of the output. Building the index is ``O(len(prediction) * max_match)`` once
per DraftSync.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

#: the start marker in front of both sequences (no token id is negative)
START = -1
#: longest output suffix looked up (tokens)
DEFAULT_MAX_MATCH = 8
#: shortest suffix that aligns anywhere in the prediction (a single token aligns only where
#: it was expected): one common token ("\n", "(") occurs everywhere in code
DEFAULT_MIN_MATCH = 2


class PredictionIndex:
    """The n-grams (``1..max_match`` tokens) of ``[START] + token_ids``, each mapped to the
    sorted prediction positions that follow its occurrences (the position of the token after
    the n-gram, ``len(token_ids)`` when it ends the prediction).

    Raises:
        ValueError: ``not 1 <= min_match <= max_match``, or a negative token id.
    """

    def __init__(self, token_ids: Sequence[int], max_match: int = DEFAULT_MAX_MATCH,
                 min_match: int = DEFAULT_MIN_MATCH) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.tokens = [int(t) for t in token_ids]
        if any(t < 0 for t in self.tokens):
            raise ValueError("prediction token ids must be >= 0")
        self.max_match = max_match
        self.min_match = min_match
        seq = [START, *self.tokens]
        #: n - 1 -> {n-gram: sorted positions that follow it}
        self._follow: list[dict[tuple[int, ...], list[int]]] = []
        for n in range(1, max_match + 1):
            table: dict[tuple[int, ...], list[int]] = {}
            for a in range(len(seq) - n + 1):
                table.setdefault(tuple(seq[a:a + n]), []).append(a + n - 1)
            self._follow.append(table)

    def __len__(self) -> int:
        return len(self.tokens)

    def align(self, output_tail: Sequence[int], whole: bool,
              expected: int | None = None) -> int | None:
        """The prediction position where the output continues, or None when its suffix is
        nowhere in the prediction.

        Args:
            output_tail: the output's last tokens (at most ``max_match`` are read).
            whole: ``output_tail`` is the whole output (the start marker precedes it).
            expected: where the output would continue had it followed the prediction since
                the previous alignment (None: no previous alignment; the earliest occurrence
                then wins).
        """
        tail = list(output_tail[-self.max_match:])
        if whole and len(tail) < self.max_match:
            tail.insert(0, START)
        for n in range(len(tail), self.min_match - 1, -1):
            follow = self._follow[n - 1].get(tuple(tail[-n:]))
            if follow:
                return _nearest(follow, expected)
        if expected is not None and 0 < expected <= len(self.tokens) and tail \
                and self.tokens[expected - 1] == tail[-1]:
            return expected  # one token, where it was expected: a same-length replacement
        return None


def _nearest(positions: list[int], expected: int | None) -> int:
    """The element of sorted ``positions`` nearest to ``expected`` (ties: the later one; no
    ``expected``: the first)."""
    if expected is None:
        return positions[0]
    i = bisect_left(positions, expected)
    if i == len(positions):
        return positions[-1]
    if i == 0 or positions[i] - expected <= expected - positions[i - 1]:
        return positions[i]
    return positions[i - 1]


class PredictionDrafter:
    """One request's prediction as a draft source: :meth:`draft` aligns the output to it
    (:meth:`PredictionIndex.align`) and proposes what follows. Remembers only the latest
    alignment, as ``(output length, prediction position)``, to break ties between equal
    matches (the expected place); it never decides an alignment by itself."""

    def __init__(self, index: PredictionIndex) -> None:
        self.index = index
        self._anchor: tuple[int, int] | None = None

    def expected(self, output_len: int) -> int | None:
        """Where an output of ``output_len`` tokens continues in the prediction had it
        followed the prediction since the latest alignment (clamped to the prediction)."""
        if self._anchor is None:
            return None
        length, pos = self._anchor
        return min(max(pos + output_len - length, 0), len(self.index))

    def draft(self, output_tail: Sequence[int], output_len: int, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` prediction tokens continuing an output of ``output_len``
        tokens whose last ones are ``output_tail`` (at least ``min(output_len,
        index.max_match)`` of them); empty when the output's suffix is not in the prediction
        or is its end."""
        if num_tokens <= 0:
            return []
        whole = len(output_tail) >= output_len
        pos = self.index.align(output_tail, whole, self.expected(output_len))
        if pos is None:
            return []
        self._anchor = (output_len, pos)
        return self.index.tokens[pos:pos + num_tokens]


def output_tail(committed: Sequence[int], path: Sequence[int], n: int) -> list[int]:
    """The last ``n`` tokens of ``committed + path`` without copying either whole."""
    if len(path) >= n:
        return list(path[len(path) - n:])
    need = n - len(path)
    return list(committed[max(len(committed) - need, 0):]) + list(path)
