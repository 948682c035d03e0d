"""A draft's confidence-head prediction, carried beside its row from a proposer to the
drafter worker's DraftTailStream.draft_confidences.

A proposer with a trained confidence head (``Proposer.returns_draft_confidences``: DSpark's,
drafter/proposers/dspark.py) returns each draft's row (the float32 distribution it was drawn
from, a greedy draft's probability, or None) wrapped in a :class:`WithConfidence` holding the
head's survival prediction: the probability that the draft is accepted given that the drafts
before it were. The worker keeps the wrapped rows on the request's path like any row (so
trimming the path trims them) and, when it sends a segment, :func:`split_confidences` gives
back the plain rows (``draft_probs`` / ``draft_token_probs`` as before) and the confidences,
sent only when every draft of the segment has one (the protocol wants one per draft or none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WithConfidence:
    """A draft's ``row`` (a float32 ``[vocab_size]`` tensor, a float or None, as proposers
    return rows) and its ``confidence`` in [0, 1]."""

    row: Any
    confidence: float


def split_confidences(rows: list | None) -> tuple[list, list[float]]:
    """``rows`` with every :class:`WithConfidence` unwrapped, and the confidences: one per row,
    clamped to [0, 1] (NaN: 0), when every row carries one, else empty."""
    rows = list(rows or [])
    plain = [r.row if isinstance(r, WithConfidence) else r for r in rows]
    if not rows or not all(isinstance(r, WithConfidence) for r in rows):
        return plain, []
    conf = [float(r.confidence) for r in rows]
    return plain, [min(c, 1.0) if c >= 0.0 else 0.0 for c in conf]


__all__ = ["WithConfidence", "split_confidences"]
