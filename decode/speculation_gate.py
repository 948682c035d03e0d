"""Drafting on or off for the whole verifier, decided on measured throughput.

The goodput caps (decode/goodput.py) choose among the drafts a step has, pricing each by the
verify forward it lengthens. What drafting costs when no draft is verified they cannot see:
a model drafter running beside the verifier on a CPU (its core an SMT sibling of the
verifier's, or sharing its caches and memory bandwidth) slows every forward, drafted or not,
and the tail wait and the commit's extra sends add their own. Measured on a 2-core host
(EAGLE, float32, 4 streams): the verifier's plain forward took 21.3 ms with the drafter
drafting against 17.6 ms with it idle, and served goodput ran at 0.79x plain decode although
its caps verified drafts on only 19 % of the steps (docs/benchmarks.md, 'Adaptive
speculation sweep').

So the gate measures what a user gets, committed tokens per second of step time, with
drafting on and with it off, per batch-size bucket (1, 2, 3-4, 5-8, ...: a bucket's steps
are alike in cost), and keeps the faster. It is an explore-exploit loop:

- a bucket measures each state in windows of :data:`WINDOW_STEPS` steps, skipping the first
  :data:`SETTLE_STEPS` after a switch (the drafter goes quiet or catches up then); a window
  folds into the state's rate with weight :data:`RATE_WEIGHT`;
- a bucket with a state not yet measured tries it after the current window (on first),
  unless its neighbours decided (:meth:`SpeculationGate._choice`: drafting pays less the
  larger the batch, so above a bucket where it lost it starts off, below one where it won
  it starts on);
- a step whose batch falls in another bucket than the step before takes that bucket's
  choice at once, leaving the window it was measuring open (a bucket change ends a stretch:
  requests finished or arrived);
- otherwise the faster state runs (drafting only where it is faster by :data:`ON_MARGIN`:
  what a switch costs besides the measured steps, the drafter's catch-up and the held
  commits sent at once, falls on the drafting side, and a tie within the noise should not
  leave a user slower than without speculation), and after ``period`` steps in it the other
  is tried for one window again (the machine, the prompts or the acceptance may have
  moved); each time the probe loses the period at least doubles, and is at least what keeps
  probes within :data:`PROBE_BUDGET` of the throughput given how much it lost, up to
  :data:`MAX_PERIOD`; it drops back to :data:`MIN_PERIOD` when the probe wins.

Off means no step verifies the method's drafts (the step kappa is 0) and each request's
drafter is told to pause (VerifyCommit.drafting_paused: no drafts, no prepared branches);
a request's prediction (Predicted Outputs) keeps being drafted and verified, as it costs no
forward. The gate changes no output, only the speed (drafts never change what a step
commits).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Steps after a switch that are not measured.
SETTLE_STEPS = 2
#: Measured steps of a window.
WINDOW_STEPS = 8
#: Weight of a new window in a state's rate.
RATE_WEIGHT = 0.5
#: Drafting is the faster state only when its rate beats the other's by this share.
ON_MARGIN = 0.03
#: Steps in the faster state before the other is tried again: the first and the longest.
MIN_PERIOD = 32
MAX_PERIOD = 1024
#: Share of a bucket's throughput its probes may cost: a probe that lost by ``loss`` (1 -
#: slower rate / faster) costs about ``(SETTLE_STEPS + WINDOW_STEPS) * loss`` steps, so the
#: next waits at least that over this share (a probe that lost by half: ~500 steps).
PROBE_BUDGET = 0.01


def bucket(batch: int) -> int:
    """The batch-size bucket of ``batch`` requests: 0 for 1, 1 for 2, 2 for 3-4, 3 for 5-8,
    and so on (``ceil(log2(batch))``)."""
    return max(batch - 1, 0).bit_length()


@dataclass
class _Bucket:
    """One batch-size bucket's measurements: per state (True: drafting on) its rate in
    tokens per second (None: not measured) and its open window (tokens, seconds, steps)."""

    rate: dict[bool, float | None] = field(default_factory=lambda: {True: None, False: None})
    window: dict[bool, list[float]] = field(
        default_factory=lambda: {True: [0.0, 0.0, 0], False: [0.0, 0.0, 0]})
    period: int = MIN_PERIOD
    since_probe: int = 0  # steps run in the faster state since the last probe
    announced: bool | None = None  # the state last logged as this bucket's faster one

    def best(self) -> bool | None:
        on, off = self.rate[True], self.rate[False]
        if on is None or off is None:
            return None
        return on > off * (1.0 + ON_MARGIN)

    def budget_period(self) -> int:
        """Steps between probes that keep their cost within :data:`PROBE_BUDGET`."""
        on, off = self.rate[True], self.rate[False]
        if not on or not off:
            return MIN_PERIOD
        loss = 1.0 - min(on, off) / max(on, off)
        return int((SETTLE_STEPS + WINDOW_STEPS) * loss / PROBE_BUDGET)


@dataclass
class GateStats:
    """Counters for the verifier's ``stats()``: steps run with drafting on and off, switches
    and probes (a switch to the state that was slower, to measure it again)."""

    num_steps_on: int = 0
    num_steps_off: int = 0
    num_switches: int = 0
    num_probes: int = 0


class SpeculationGate:
    """Whether the next verify step drafts (module doc). Feed it every step: :meth:`begin`
    with the step's batch size before it plans, :meth:`end` with what it committed after.

    ``log``: called with a line when the state a bucket settles on changes (not for probes).
    """

    def __init__(self, log=None) -> None:  # noqa: ANN001
        self.on = True
        self.stats = GateStats()
        self._buckets: dict[int, _Bucket] = {}
        self._settle = 0  # steps left unmeasured after the last switch
        self._pending = True  # the current state owes a complete window
        self._probing = False
        self._bucket: int | None = None  # the bucket of the step begun last
        self._log = log

    def begin(self, batch: int) -> bool:
        """The step about to run has ``batch`` requests: whether it drafts."""
        k = bucket(batch)
        b = self._buckets.setdefault(k, _Bucket())
        moved, self._bucket = self._bucket is not None and k != self._bucket, k
        best = self._choice(k, b)
        if moved and best is not None:  # another bucket, whose choice is known: take it
            self._pending = self._probing = False
        elif self._settle or self._pending:
            return self.on  # measure the current state to the end of its window first
        if best is None:  # a state this bucket has not measured: measure it
            if b.rate[self.on] is None:
                self._pending = True
            else:
                self._switch(not self.on)
            return self.on
        if self._probing:  # the probe's window is complete: back to the faster state
            self._probing = False
            b.period = MIN_PERIOD if best == self.on else \
                min(max(2 * b.period, b.budget_period()), MAX_PERIOD)
            self._switch(best)
        elif best != self.on:  # another bucket's state, or the rates crossed
            self._switch(best)
        elif b.since_probe >= b.period:  # try the slower state again, for one window
            b.since_probe = 0
            self._probing = True
            self.stats.num_probes += 1
            self._switch(not self.on)
            return self.on
        if b.announced != best:
            b.announced = best
            b.period = max(b.period, min(b.budget_period(), MAX_PERIOD))
            self._announce(batch, b)
        return self.on

    def _choice(self, k: int, b: _Bucket) -> bool | None:
        """Bucket ``k``'s faster state: measured, or inferred from the buckets around it
        while one of its states is not measured yet. Drafting pays less the larger the batch
        (the break-even batch, docs/verification.md): where a smaller batch measured drafting
        as slower, this one does not try it first, and where a larger one measured it
        faster, this one does not try without it first; its probes still measure the other
        state later. None: measure."""
        best = b.best()
        if best is not None:
            return best
        if b.rate[True] is None and any(o.best() is False for j, o in self._buckets.items()
                                        if j < k):
            return False
        if b.rate[False] is None and any(o.best() is True for j, o in self._buckets.items()
                                         if j > k):
            return True
        return None

    def end(self, batch: int, num_tokens: int, seconds: float) -> None:
        """The step begun last committed ``num_tokens`` tokens in ``seconds`` of step time
        (its forward, tail wait, commit and sends)."""
        if self.on:
            self.stats.num_steps_on += 1
        else:
            self.stats.num_steps_off += 1
        if self._settle:
            self._settle -= 1
            return
        if seconds <= 0 or batch <= 0:
            return
        k = bucket(batch)
        b = self._buckets.setdefault(k, _Bucket())
        if not self._probing and self._choice(k, b) == self.on:
            b.since_probe += 1
        win = b.window[self.on]
        win[0] += num_tokens
        win[1] += seconds
        win[2] += 1
        if win[2] >= WINDOW_STEPS:
            rate = win[0] / win[1]
            old = b.rate[self.on]
            b.rate[self.on] = rate if old is None else old + RATE_WEIGHT * (rate - old)
            b.window[self.on] = [0.0, 0.0, 0]
            self._pending = False

    def snapshot(self) -> dict:
        """The gate for ``stats()``: the state, the counters and per bucket (by its largest
        batch size) the two rates in tokens per second and the probe period."""
        return {"drafting": self.on, **self.stats.__dict__,
                "buckets": {str(1 << k): {"tokens_per_s_on": b.rate[True],
                                          "tokens_per_s_off": b.rate[False],
                                          "probe_period_steps": b.period}
                            for k, b in sorted(self._buckets.items())}}

    def _switch(self, on: bool) -> None:
        if on == self.on:
            return
        self.on = on
        self._settle = SETTLE_STEPS
        self._pending = True
        self.stats.num_switches += 1
        for b in self._buckets.values():  # a window spans one stretch of a state
            b.window[not on] = [0.0, 0.0, 0]

    def _announce(self, batch: int, b: _Bucket) -> None:
        if self._log is not None:
            on, off = (f"{r:.1f}" if r is not None else "not measured"
                       for r in (b.rate[True], b.rate[False]))
            self._log(f"adaptive: drafting {'on' if self.on else 'off'} at batch {batch} "
                      f"(committed tokens/s with drafting {on}, without {off})")


__all__ = ["MAX_PERIOD", "MIN_PERIOD", "ON_MARGIN", "PROBE_BUDGET", "RATE_WEIGHT", "SETTLE_STEPS",
           "WINDOW_STEPS",
           "GateStats", "SpeculationGate", "bucket"]
