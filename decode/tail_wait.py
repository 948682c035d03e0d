"""Whether and how long a verify step waits for draft tails in flight (pure Python, no torch;
docs/architecture.md, 'Draft tails and staleness'): a fraction of one verify step (an EMA of
the step time) and, with ``goodput_drafts``, no longer than the next draft is worth. A mixin
of :class:`decode.scheduler.Scheduler` (its ``config``, ``step_time_ema_s`` and
``drafts_wanted``)."""

from __future__ import annotations

from specmesh.decode.config import STEP_TIME_EMA_WEIGHT
from specmesh.decode.request import Request


class TailWait:
    """The tail-wait budget of a step (see the module docstring)."""

    def observe_step_time(self, seconds: float) -> None:
        """Feed the verify-step time EMA (sizes the tail-wait budget)."""
        if self.step_time_ema_s == 0:
            self.step_time_ema_s = seconds
        else:
            self.step_time_ema_s += STEP_TIME_EMA_WEIGHT * (seconds - self.step_time_ema_s)

    def tail_wait_budget_s(self, running: list[Request] | None = None,
                           waiting: list[Request] | None = None) -> float:
        """Longest a step may wait (from its start) for tails in flight: a fraction
        (``tail_wait_fraction``) of one verify step and, with ``goodput_drafts``, no longer
        than the next draft is worth.

        Waiting ``w`` for a draft of expected gain ``g`` (``Acceptance.gain(j)`` for the request's
        j-th draft) pays while ``(E + g) / (T + w) > E / T``, i.e. ``w < T * g / E``: ``T`` the step
        time, ``E`` the tokens the step already expects (one per running request plus the gains of
        the drafts already there). So a step waits long for a request's first draft, briefly for its
        second and hardly at all in a large batch, where every request waits with it. (A model
        drafter streams its drafts one forward apart: a fixed budget spent much of a step waiting
        for second drafts that came too late.)
        ``waiting``: the requests whose tails may still come (default: ``running``).
        """
        cap = self.config.tail_wait_fraction * self.step_time_ema_s
        if not self.config.goodput_caps or running is None:
            return cap
        awaited = self.awaiting_tail(running if waiting is None else waiting)
        if not awaited:
            return 0.0
        have = {id(r): len(r.tail.usable(self.drafts_wanted(r))) for r in running}
        expected = len(running) + sum(r.acceptance.expected(have[id(r)]) - 1
                                      for r in running)
        gain = max(r.acceptance.gain(have[id(r)] + 1) for r in awaited)
        return min(cap, self.step_time_ema_s * gain / expected)

    def awaiting_tail(self, running: list[Request]) -> list[Request]:
        """Running requests whose drafter owes them a tail that would add drafts this step
        (drafts it would verify: :meth:`drafts_wanted`, so no step waits for drafts the
        goodput caps hold back)."""
        return [r for r in running if r.tail_in_flight and r.drafter is not None
                and len(r.tail) < self.drafts_wanted(r)]
