"""Online calibration of draft confidences: the verifier learns, from its own verify outcomes,
how often a draft whose drafter gave it score ``q`` survives verification (pure Python).

A confidence is the predicted probability that a draft is accepted once the drafts before it
were (the conditional survival that the running product of the confidence budget multiplies,
decode/confidence_budget.py). Drafters that draw drafts from a distribution know ``q``, the
draft's probability under it (EAGLE, draft-model and PARD send their rows for unseeded sampled
requests, DraftTailStream.draft_probs); ``q`` ranks drafts well but is not a survival
probability (greedy verification keeps the draft when it is the target's argmax, rejection
sampling with ``min(1, p / q)``). So the verifier maps it through a reliability table per
(drafter, draft position): ``q`` falls in one of :data:`NUM_BINS` equal bins of [0, 1], and
the bin's realised survival rate, pulled towards ``q`` itself by :data:`PRIOR_STRENGTH`
pseudo-observations, is the calibrated confidence. With no outcomes yet the map is the
identity; with many it is the bin's measured rate (histogram binning, Zadrozny and Elkan,
ICML 2001; the reliability diagram of Guo et al., arXiv 1706.04599). A trained confidence
head (DSpark's, DraftTailStream.draft_confidences) predicts survival directly and is used as
sent; its outcomes still fill a :class:`ReliabilityBins` so its calibration is reported.

Outcomes: a step that verified drafts ``0 .. n-1`` and accepted ``accept_len`` of them judged
drafts ``0 .. min(accept_len, n - 1)``: the first ``accept_len`` survived, draft
``accept_len`` (when ``< n``) was rejected, the ones after it were never judged on their own
prefix and say nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

#: Equal-width bins of [0, 1] a confidence falls in.
NUM_BINS = 10
#: Pseudo-observations at the raw score itself in each bin (the prior: identity map).
PRIOR_STRENGTH = 4.0
#: Draft positions with a table of their own; later positions share the last one.
MAX_POSITIONS = 16


def clamp_confidence(value: float) -> float:
    """``value`` within [0, 1]; NaN counts as 0 (no confidence)."""
    if not value >= 0.0:  # NaN and negatives
        return 0.0
    return min(float(value), 1.0)


def bin_of(value: float, num_bins: int = NUM_BINS) -> int:
    """The bin of a confidence in [0, 1] (1.0 in the last bin)."""
    return min(int(clamp_confidence(value) * num_bins), num_bins - 1)


@dataclass
class ReliabilityBins:
    """Reliability counts of one stream of predictions: per bin, how many drafts were judged,
    how many survived and the sum of the confidences predicted for them."""

    num_bins: int = NUM_BINS
    judged: list[int] = field(default_factory=list)
    survived: list[int] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_bins < 1:
            raise ValueError(f"num_bins must be >= 1, got {self.num_bins}")
        for name in ("judged", "survived", "predicted"):
            if not getattr(self, name):
                setattr(self, name, [0.0 if name == "predicted" else 0] * self.num_bins)

    def observe(self, confidence: float, survived: bool) -> None:
        """One judged draft predicted to survive with ``confidence``."""
        b = bin_of(confidence, self.num_bins)
        self.judged[b] += 1
        self.survived[b] += bool(survived)
        self.predicted[b] += clamp_confidence(confidence)

    def calibrated(self, confidence: float, prior_strength: float = PRIOR_STRENGTH) -> float:
        """The bin's survival rate, with ``prior_strength`` pseudo-observations at
        ``confidence`` itself (so an empty bin returns ``confidence``)."""
        q = clamp_confidence(confidence)
        b = bin_of(q, self.num_bins)
        n = self.judged[b] + prior_strength
        return (self.survived[b] + prior_strength * q) / n if n > 0 else q

    @property
    def num_judged(self) -> int:
        """Drafts observed over every bin."""
        return sum(self.judged)

    def mean_abs_error(self) -> float | None:
        """Expected calibration error: the judged-weighted mean over bins of |mean predicted
        - realised survival| (None before any outcome)."""
        total = self.num_judged
        if not total:
            return None
        return sum(abs(p - s) for p, s, n in zip(self.predicted, self.survived, self.judged)
                   if n) / total

    def as_rows(self) -> list[dict]:
        """One dict per bin: ``lo``, ``hi`` (its range), ``num_judged``, ``mean_predicted`` and
        ``survival_rate`` (both None for an empty bin): a reliability plot's points."""
        rows = []
        for b in range(self.num_bins):
            n = self.judged[b]
            rows.append({"lo": b / self.num_bins, "hi": (b + 1) / self.num_bins,
                         "num_judged": n,
                         "mean_predicted": self.predicted[b] / n if n else None,
                         "survival_rate": self.survived[b] / n if n else None})
        return rows

    def merge(self, other: ReliabilityBins) -> None:
        """Add ``other``'s counts (same number of bins)."""
        if other.num_bins != self.num_bins:
            raise ValueError(f"cannot merge {other.num_bins} bins into {self.num_bins}")
        for b in range(self.num_bins):
            self.judged[b] += other.judged[b]
            self.survived[b] += other.survived[b]
            self.predicted[b] += other.predicted[b]


def judged_outcomes(num_drafts: int, accept_len: int) -> list[bool]:
    """Survival of each draft a step judged: ``[True] * accept_len`` and, when a draft was
    rejected (``accept_len < num_drafts``), one ``False``."""
    a = max(min(accept_len, num_drafts), 0)
    return [True] * a + ([False] if a < num_drafts else [])


class ConfidenceCalibration:
    """Reliability tables of raw draft scores per (drafter key, draft position), learned
    online (module doc). ``key``: whatever names a stream of comparable scores (the verifier
    uses the draft method and the score's kind)."""

    def __init__(self, num_bins: int = NUM_BINS, prior_strength: float = PRIOR_STRENGTH,
                 max_positions: int = MAX_POSITIONS) -> None:
        if prior_strength < 0 or max_positions < 1:
            raise ValueError(f"prior_strength must be >= 0 and max_positions >= 1, got "
                             f"{prior_strength} and {max_positions}")
        self.num_bins = num_bins
        self.prior_strength = prior_strength
        self.max_positions = max_positions
        self.tables: dict[tuple[str, int], ReliabilityBins] = {}

    def _table(self, key: str, position: int) -> ReliabilityBins:
        slot = (key, min(max(position, 0), self.max_positions - 1))
        table = self.tables.get(slot)
        if table is None:
            table = self.tables[slot] = ReliabilityBins(self.num_bins)
        return table

    def calibrated(self, key: str, position: int, score: float) -> float:
        """The calibrated confidence of one draft at ``position`` with raw ``score`` (the
        identity, clamped, before any outcome at that key and position)."""
        table = self.tables.get((key, min(max(position, 0), self.max_positions - 1)))
        if table is None:
            return clamp_confidence(score)
        return table.calibrated(score, self.prior_strength)

    def calibrate(self, key: str, scores: Sequence[float]) -> list[float]:
        """Calibrated confidences of drafts at positions ``0 .. len(scores) - 1`` whose raw
        scores are ``scores`` (each in [0, 1]; out of range clamped, NaN is 0)."""
        return [self._table(key, j).calibrated(q, self.prior_strength)
                for j, q in enumerate(scores)]

    def observe_draft(self, key: str, position: int, score: float, survived: bool) -> None:
        """One judged draft at ``position`` with raw ``score``."""
        self._table(key, position).observe(score, survived)

    def observe(self, key: str, scores: Sequence[float], accept_len: int) -> None:
        """A step verified drafts with raw ``scores`` (one per draft, in order) and accepted
        ``accept_len`` of them: each judged draft's outcome goes into its position's table."""
        for j, survived in enumerate(judged_outcomes(len(scores), accept_len)):
            self._table(key, j).observe(scores[j], survived)


def log_confidence(value: float) -> float:
    """``log(value)`` of a confidence clamped to [0, 1]; ``-inf`` for 0."""
    v = clamp_confidence(value)
    return math.log(v) if v > 0 else -math.inf


__all__ = ["MAX_POSITIONS", "NUM_BINS", "PRIOR_STRENGTH", "ConfidenceCalibration",
           "ReliabilityBins", "bin_of", "clamp_confidence", "judged_outcomes", "log_confidence"]
