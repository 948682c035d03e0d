"""The confidence budget: which (request, draft position) slots a verify step verifies, from
each draft's confidence and the profiled step cost (pure Python; ``--speculative-policy
confidence``).

The finer adaptive loop of the speculative decoding chapter ('Adaptive verification', the
DSpark section): every slot ``(i, j)`` (request ``i``'s ``j``-th draft) is scored by the
running product of request ``i``'s confidences up to ``j``, ``s_ij = c_i0 * ... * c_ij``: the
probability that drafts ``0 .. j`` all survive, which is what draft ``j`` adds to the step's
expected committed tokens. The step takes the global top ``k`` slots, with ``k`` the argmax
over ``0 .. N`` of expected committed tokens per second, ``(B + sum of the top k scores) /
T(B, k)``, ``T`` the verify step's profiled cost (decode/cost_table.py: a step function over
padded batch / width buckets, the drafter's work included when it shares the verifier's
cores). The smallest ``k`` wins a tie.

Tie rule: slots are ordered by score, largest first, then by earlier position, then by
request order; scores are compared in log space, so products that underflow a float stay
ordered, and a confidence of exactly 0 (``-inf``) or 1 (``0``) ties with its neighbours and
falls to the position rule. Since a request's scores never grow with position, each request's
admitted slots are a prefix of its drafts: confidences ``[0.5, 0.5]`` with ``k = 1`` admit
position 0, never position 1 alone (a draft is only verified with the drafts before it).

Budget 0 is a valid decision: the step still runs, each request verifies no draft and commits
one token, and its drafter is still told to keep its run-ahead (decode/scheduler.py
``drafts_wanted``), so a method that extends its drafts after each commit does. After
:data:`PROBE_EVERY` budget-0 steps in a row while slots were offered, a step verifies each
request's first draft, so the confidences' calibration keeps seeing outcomes.

Without a cost (no profiled table: ``--verify-cost-table off``) the budget cannot trade drafts
against time: :meth:`ConfidenceBudget.decide` returns None, the scheduler keeps today's
goodput caps, and a warning says so once. Never changes the output, only the cost.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specmesh.decode.confidence_calibration import (
    ReliabilityBins,
    judged_outcomes,
    log_confidence,
)

log = logging.getLogger(__name__)

#: After this many budget-0 steps in a row with slots offered, one step verifies each
#: request's first draft (as the goodput policy probes).
PROBE_EVERY = 8


@dataclass(frozen=True)
class Slot:
    """One draft slot: ``request`` (index in the step's batch), ``position`` (draft index, 0
    first) and ``log_score`` (log of the running product of confidences; ``-inf`` for 0)."""

    request: int
    position: int
    log_score: float

    @property
    def score(self) -> float:
        """The running product itself (may underflow to 0.0)."""
        return math.exp(self.log_score)


def ranked_slots(confidences: Sequence[Sequence[float]]) -> list[Slot]:
    """Every slot of a step, best first: by log score descending, then earlier position, then
    earlier request (the module's tie rule).

    Args:
        confidences: per request of the batch, one confidence per usable draft (each in
            [0, 1]; out of range clamped, NaN is 0).
    """
    slots = []
    for i, confs in enumerate(confidences):
        total = 0.0
        for j, c in enumerate(confs):
            total += log_confidence(c)  # -inf stays -inf
            slots.append(Slot(i, j, total))
    slots.sort(key=lambda s: (-s.log_score, s.position, s.request))
    return slots


def admitted_widths(confidences: Sequence[Sequence[float]], budget: int) -> list[int]:
    """Drafts each request verifies when the step takes the ``budget`` best slots
    (:func:`ranked_slots`); a prefix of each request's drafts by construction."""
    widths = [0] * len(confidences)
    for s in ranked_slots(confidences)[:max(budget, 0)]:
        widths[s.request] += 1
    return widths


@dataclass(frozen=True)
class BudgetDecision:
    """One step's choice: ``widths`` (drafts verified per request, in batch order),
    ``budget`` (their total), ``expected_drafts`` (sum of the admitted scores: the accepted
    drafts the step expects) and the expected committed tokens per second at the choice
    (``tokens_per_s``; 0 on a probe step)."""

    widths: list[int]
    budget: int
    expected_drafts: float
    tokens_per_s: float
    probe: bool = False


@dataclass
class ConfidenceStats:
    """Running sums of the confidence policy, for ``spec_stats`` / Prometheus and the bench:
    steps decided, accepted drafts predicted (the admitted slots' scores) and realised, and
    the reliability of the confidences used per judged draft."""

    num_steps: int = 0
    num_probe_steps: int = 0
    num_fallback_steps: int = 0  # no cost known: today's goodput caps decided
    predicted_accepted: float = 0.0
    realised_accepted: int = 0
    num_request_steps: int = 0  # (request, step) pairs whose prediction was checked
    sum_abs_error: float = 0.0  # per step, |predicted - realised| over its requests
    reliability: ReliabilityBins = field(default_factory=ReliabilityBins)

    def as_dict(self) -> dict:
        """JSON of the sums, with ``mean_abs_error_per_step`` and the reliability rows."""
        steps = self.num_steps
        return {"num_steps": steps, "num_probe_steps": self.num_probe_steps,
                "num_fallback_steps": self.num_fallback_steps,
                "predicted_accepted_drafts": self.predicted_accepted,
                "realised_accepted_drafts": self.realised_accepted,
                "num_request_steps": self.num_request_steps,
                "mean_abs_error_per_step": self.sum_abs_error / steps if steps else None,
                "reliability_ece": self.reliability.mean_abs_error(),
                "reliability": self.reliability.as_rows()}


class ConfidenceBudget:
    """The step's global top-k over confidence-scored slots (module doc).

    ``stats``: running predicted vs realised accepted drafts (:meth:`observe_step`)."""

    def __init__(self) -> None:
        self.stats = ConfidenceStats()
        self._warned: set[str] = set()  # warnings logged (each once)
        self._held_back = 0  # budget-0 steps in a row while slots were offered

    def decide(self, confidences: Sequence[Sequence[float]],
               seconds: Callable[[int, int], float | None],
               has_profile: bool = True) -> BudgetDecision | None:
        """This step's widths.

        Args:
            confidences: per request of the batch, one confidence per draft it could verify
                (its usable tail within kappa and ``max_tokens``).
            seconds: ``seconds(batch, num_drafts)``, the step's predicted cost (None: not
                predictable), e.g. decode/goodput.py ``DraftBudget.seconds``.
            has_profile: whether ``seconds`` rests on a profiled table; without one the
                budget does not decide (None, warned once).

        Returns:
            The decision, or None when no cost is known (the caller keeps its caps).
        """
        base = len(confidences)
        slots = ranked_slots(confidences)
        if not slots:
            return BudgetDecision([0] * base, 0, 0.0, 0.0)
        if not has_profile:
            self._warn_once("no profiled verify cost table (--verify-cost-table off, or it "
                            "could not be measured): the confidence budget cannot weigh drafts "
                            "against step time and keeps the goodput policy's caps")
            return None
        best_k, best, gain = 0, -1.0, float(base)
        for k in range(len(slots) + 1):
            if k:
                gain += slots[k - 1].score
            t = seconds(base, k)
            if t is None or not t > 0:
                self._warn_once("the verify cost table predicts no positive step time: the "
                                "confidence budget keeps the goodput policy's caps")
                return None
            if gain / t > best:
                best_k, best = k, gain / t
        if best_k == 0:
            self._held_back += 1
            if self._held_back >= PROBE_EVERY:
                self._held_back = 0
                widths = [min(len(c), 1) for c in confidences]
                first = sum(math.exp(log_confidence(c[0])) for c in confidences if c)
                return BudgetDecision(widths, sum(widths), first, 0.0, probe=True)
        else:
            self._held_back = 0
        widths = [0] * base
        for s in slots[:best_k]:
            widths[s.request] += 1
        expected = sum(s.score for s in slots[:best_k])
        return BudgetDecision(widths, best_k, expected, best)

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning("speculative policy confidence: %s", message)

    def observe_step(self, predicted: Sequence[Sequence[float]], accept_lens: Sequence[int],
                     probe: bool = False) -> None:
        """A decided step committed: per request that verified drafts, the confidences of
        the drafts it verified (in order) and its accept length. Adds the step's predicted
        (the sum of the running products) and realised accepted drafts to :attr:`stats`, and
        each judged draft's confidence and outcome to its reliability bins."""
        st = self.stats
        st.num_steps += 1
        st.num_probe_steps += probe
        step_predicted, step_realised = 0.0, 0
        for confs, a in zip(predicted, accept_lens):
            if not confs:
                continue
            product = 1.0
            for c in confs:
                product *= c
                step_predicted += product
            step_realised += min(a, len(confs))
            st.num_request_steps += 1
            for j, survived in enumerate(judged_outcomes(len(confs), a)):
                st.reliability.observe(confs[j], survived)
        st.predicted_accepted += step_predicted
        st.realised_accepted += step_realised
        st.sum_abs_error += abs(step_predicted - step_realised)


__all__ = ["PROBE_EVERY", "BudgetDecision", "ConfidenceBudget", "ConfidenceStats", "Slot",
           "admitted_widths", "ranked_slots"]
