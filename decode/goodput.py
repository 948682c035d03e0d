"""Goodput-aware draft budget: how many drafts a verify step should carry.

SmartSpec (Liu et al., arXiv 2406.14066) picks each step's proposal length to maximise
goodput, the committed tokens per second, from each request's measured acceptance and a model
of the step's cost. Here:

- acceptance: per request, two rates over decayed counts of the steps that carried drafts:
  ``a1``, the chance its first draft is accepted, and ``ac``, the chance a later draft is
  accepted once the drafts before it were. The ``j``-th draft is then accepted with
  probability ``a1 * ac^(j-1)``, and a request verified with ``k`` drafts commits ``1 +
  sum_j a1 * ac^(j-1)`` tokens on average (the bonus or recovered token included). One rate
  for every position (the geometric model of Leviathan et al., arXiv 2211.17192) fits drafts
  that fail independently; drafts copied from a match (n-gram, suffix, a prediction) fail
  at the first position or run on: measured with n-gram drafts at kappa 5 the acceptance per
  position was 0.70 / 0.61 / 0.56 / 0.52 / 0.47, a first draft at 0.70 and later ones at
  ~0.9 once the earlier held. One rate learnt under the caps it sets is also self-confirming:
  a request verified one draft at a time measures only its first position (0.70), values its
  second at 0.49 where it holds at 0.61, and stays capped low. Two rates keep the later
  positions at their optimistic start until steps have verified them;
- cost: ``T(N)``, the verify forward's seconds over ``N`` query tokens (the batch's rows), an
  EMA per ``N`` measured, linear between the ``N`` seen and beyond them. Measured, not
  assumed: a 2-row fp32 product can cost several times a one-row one on a CPU without bf16
  (the GEMV / GEMM switch) while a 5-token bf16 forward on a CPU with bf16 products costs
  about as much as a one-token one (docs/benchmarks.md, 'Forward cost'). With a profiled
  table (decode/cost_table.py: by batch size and tokens per request, measured at start or
  loaded) the cost is the table's step function instead, the drafter's work included when
  it shares the verifier's cores;
- the step's caps, per request (SmartSpec picks one proposal length for the whole batch; a
  batch-wide cap makes requests whose drafts fail hold back a request whose drafts match, or
  verify their own failing drafts beside it). The ``j``-th draft of request ``i`` adds
  ``a_i^j`` expected tokens, falling with ``j``; the step takes the ``n`` drafts of largest
  gain that maximise ``(B + their gains) / T(B + n)`` (``B`` requests, ``d_i`` drafts request
  ``i`` could verify), which is a prefix of every request's drafts. The decision is kept as
  a gain threshold (:class:`DraftCaps`): what one more draft would cost in expected tokens at
  the chosen point, kept between the last gain taken and the first left out. A request's cap
  is how many of its drafts reach it, which also tells a request without a tail this step
  how many its drafter should have ready (so the threshold must not drop a draft that still
  pays when the request's rate slips after a rejection).

Until the cost of both ends (no drafts, all drafts) has been measured the caps explore them;
while they hold every draft back they still verify one draft per request every
:data:`PROBE_EVERY` steps, so a request whose drafter starts to match is noticed. The caps never
change the output, only the cost (greedy and sampled verification are exact with any number of
drafts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specmesh.decode.acceptance import Acceptance, draft_gain
from specmesh.decode.cost_table import VerifyCostTable

#: Weight of the newest measurement in the forward-time EMA of a token count.
COST_EMA_WEIGHT = 0.2
#: While the cap is 0 and some request has drafts, every this-many-th step verifies one.
PROBE_EVERY = 8


class ForwardCost:
    """Seconds of a verify forward as a function of its query tokens ``N``: an EMA per ``N``
    measured; :meth:`predict` interpolates linearly between them and extends the nearest
    segment beyond them (never decreasing, never below the smallest measurement)."""

    def __init__(self) -> None:
        self._ema: dict[int, float] = {}

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One forward over ``num_tokens`` tokens took ``seconds``."""
        old = self._ema.get(num_tokens)
        self._ema[num_tokens] = seconds if old is None else \
            old + COST_EMA_WEIGHT * (seconds - old)

    def predict(self, num_tokens: int) -> float | None:
        """Predicted seconds for ``num_tokens``, or None with fewer than two token counts
        measured (and ``num_tokens`` not one of them)."""
        if num_tokens in self._ema:
            return self._ema[num_tokens]
        if len(self._ema) < 2:
            return None
        ns = sorted(self._ema)
        below = [n for n in ns if n < num_tokens]
        above = [n for n in ns if n > num_tokens]
        if below and above:
            a, b = below[-1], above[0]
        elif below:
            a, b = below[-2], below[-1]
        else:
            a, b = above[0], above[1]
        ta, tb = self._ema[a], self._ema[b]
        slope = max((tb - ta) / (b - a), 0.0)
        anchor, t = (b, tb) if b < num_tokens else (a, ta)  # the nearest measured point
        return max(t + slope * (num_tokens - anchor), min(self._ema.values()))


@dataclass(frozen=True)
class DraftCaps:
    """One step's draft decision: drafts whose expected gain is at least ``min_gain`` are
    verified (``min_gain`` 0: every draft; infinity: none), or one draft per request on a
    probe step."""

    min_gain: float
    probe: bool = False

    def cap(self, acceptance: Acceptance | float, limit: int) -> int:
        """Drafts (at most ``limit``) a request of ``acceptance`` verifies: the ``j`` whose
        :func:`draft_gain` is at least ``min_gain``."""
        if self.probe:
            return min(1, limit)
        k = 0
        while k < limit and draft_gain(acceptance, k + 1) >= self.min_gain:
            k += 1
        return k


#: Verify every draft (exploring the cost of a step with all of them).
ALL_DRAFTS = DraftCaps(0.0)
#: Verify none.
NO_DRAFTS = DraftCaps(float("inf"))


class DraftBudget:
    """The goodput-maximising draft caps of each verify step (see the module doc).

    ``table``: the profiled verify cost by (batch size, tokens per request)
    (decode/cost_table.py), set by the verifier's host at start; with it a step's cost is the
    table's step function at the step's batch (no exploration: both ends are known), the
    drafter's making of the drafts included while ``drafter_shared`` (the drafter runs on
    the verifier's cores), and every verify forward refines the table's bucket. Without it,
    the online per-token-count EMA (:class:`ForwardCost`)."""

    def __init__(self, table: VerifyCostTable | None = None) -> None:
        self.cost = ForwardCost()
        self.table = table
        self.drafter_shared = False
        self._held_back = 0  # steps in a row that held every draft back while drafts were there
        self._overhead: dict[int, float] = {}  # batch size -> EMA of a step's other seconds

    def observe_overhead(self, batch: int, seconds: float) -> None:
        """A step of ``batch`` requests spent ``seconds`` besides its verify forward and its
        wait for tails: receiving messages, admission, planning, the verification rule, the
        commit and its sends. Every step pays it whatever its drafts, so it dilutes what
        drafts cost: at batch 1 on a CPU a plain step measured ~4 ms of it beside an 8 ms
        forward, and pricing the forward alone undervalued every draft there."""
        if batch <= 0 or seconds < 0:
            return
        old = self._overhead.get(batch)
        self._overhead[batch] = seconds if old is None else \
            old + COST_EMA_WEIGHT * (seconds - old)

    def overhead(self, batch: int) -> float:
        """A step's seconds besides its forward at ``batch`` requests: the EMA of the
        nearest batch size measured (the smaller on a tie), 0 before any."""
        if not self._overhead:
            return 0.0
        if batch in self._overhead:
            return self._overhead[batch]
        return self._overhead[min(self._overhead, key=lambda b: (abs(b - batch), b))]

    def observe_forward(self, num_tokens: int, seconds: float, batch: int = 0) -> None:
        """A verify forward of ``batch`` requests (0: not told) over ``num_tokens`` took
        ``seconds``."""
        self.cost.observe(num_tokens, seconds)
        if self.table is not None and batch > 0:
            self.table.observe(batch, num_tokens, seconds)

    def seconds(self, base: int, num_drafts: int) -> float | None:
        """Predicted seconds of a step of ``base`` requests verifying ``num_drafts`` drafts
        (None: not predictable yet): its forward's (the table's step function, else the
        online EMA) plus the step's :meth:`overhead`."""
        if self.table is not None:
            t = self.table.step_seconds(base, num_drafts, self.drafter_shared)
        else:
            t = self.cost.predict(base + num_drafts)
        return None if t is None else t + self.overhead(base)

    def decide(self, num_drafts: list[int], rates: list[Acceptance | float]) -> DraftCaps:
        """This step's caps.

        Args:
            num_drafts: per running request, the drafts it could verify (its usable tail,
                within its other caps).
            rates: per request, its :class:`Acceptance` (or one rate for every position).
        """
        if not any(num_drafts):
            return NO_DRAFTS
        base = len(num_drafts)
        total = base + sum(num_drafts)
        # explore the two ends first: with both measured every size can be predicted
        if self.seconds(base, total - base) is None:
            return ALL_DRAFTS
        if self.seconds(base, 0) is None:
            return self._held(NO_DRAFTS)
        gains = sorted((draft_gain(r, j) for r, d in zip(rates, num_drafts)
                        for j in range(1, d + 1)), reverse=True)
        best_n, best, gain = 0, -1.0, float(base)
        for n in range(len(gains) + 1):
            if n:
                gain += gains[n - 1]
            t = self.seconds(base, n)
            if t is not None and t > 0 and gain / t > best:
                best_n, best = n, gain / t
        if not best_n:
            return self._held(NO_DRAFTS)
        return self._held(DraftCaps(self._threshold(gains, best_n, base)))

    def _threshold(self, gains: list[float], n: int, base: int) -> float:
        """The ``min_gain`` of a decision that takes the ``n`` largest of ``gains``
        (descending): what one more draft would cost in expected tokens at that point,
        ``G * (T(base + n + 1) / T(base + n) - 1)`` with ``G`` the step's expected tokens,
        kept inside ``(gains[n], gains[n - 1]]`` so that it takes exactly those ``n`` at the
        rates it was decided with.

        The caps are applied later, to rates that moved: after a rejection a request's rate
        drops, and with the threshold at the last draft taken (as before) a request verified
        with 1 draft at rate 0.30 was capped to 0 at 0.24, told its drafter it wanted none, and
        no step waited for its tail again, so no step decided anew (docs/benchmarks.md,
        'Drafting'). The marginal cost is the threshold
        the decision rests on: a draft is dropped only when it no longer pays for itself."""
        taken = base + sum(gains[:n])
        t_n, t_next = self.seconds(base, n), self.seconds(base, n + 1)
        marginal = taken * max(t_next / t_n - 1.0, 0.0) if t_n and t_next else gains[n - 1]
        floor = math.nextafter(gains[n], math.inf) if n < len(gains) else 0.0
        return min(gains[n - 1], max(marginal, floor))

    def cap(self, num_drafts: list[int], rates: list[Acceptance | float]) -> int:
        """The most drafts any request verifies this step (:meth:`decide`)."""
        caps = self.decide(num_drafts, rates)
        return max((caps.cap(r, d) for r, d in zip(rates, num_drafts)), default=0)

    def _held(self, caps: DraftCaps) -> DraftCaps:
        """``caps``, except every PROBE_EVERY-th step in a row that holds every draft back
        verifies one per request."""
        if caps is not NO_DRAFTS:
            self._held_back = 0
            return caps
        self._held_back += 1
        if self._held_back >= PROBE_EVERY:
            self._held_back = 0
            return DraftCaps(float("inf"), probe=True)
        return caps


__all__ = ["ALL_DRAFTS", "COST_EMA_WEIGHT", "NO_DRAFTS", "PROBE_EVERY", "DraftBudget",
           "DraftCaps", "ForwardCost"]
