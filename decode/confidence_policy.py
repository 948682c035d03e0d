"""``--speculative-policy confidence`` in the scheduler: each step's per-request widths from
the confidence budget (decode/confidence_budget.py) over the drafts' confidences
(decode/draft_confidence.py), and the outcomes fed back to the calibration and the
predicted-vs-realised sums. A mixin of :class:`decode.scheduler.Scheduler` (its ``config``,
``draft_budget`` and ``goodput_caps``); pure Python, no torch.

Without a profiled verify cost table the budget does not decide (warned once) and the step
keeps today's goodput caps: the goodput decision over the requests' acceptance rates, and each
request's accept-length cap.
"""

from __future__ import annotations

from specmesh.decode.confidence_budget import ConfidenceBudget
from specmesh.decode.draft_confidence import DraftConfidences, StepConfidences
from specmesh.decode.request import Request

#: temperature below which a request is greedy (engine/sampling.py, vLLM's epsilon; not
#: imported: engine.sampling loads torch, the scheduler stays pure Python)
GREEDY_TEMPERATURE = 1e-5


def sampling_key(req: Request) -> str:
    """The sampling mode that keys a request's ``q`` calibration: a greedy draft survives when
    it is the target's argmax, a seeded one when the coupled noise picks it, a random one with
    ``min(1, p / q)``."""
    if req.sampling.temperature < GREEDY_TEMPERATURE:
        return "greedy"
    return "coupled" if req.sampling.seed is not None else "random"


class ConfidencePolicy:
    """The confidence policy's part of the scheduler (see the module docstring)."""

    def init_confidence_policy(self) -> None:
        """Set up the policy's state (None under the other policies)."""
        on = self.config.speculative_policy == "confidence"
        #: the budget and its running sums (``spec_stats`` / Prometheus); None: policy off
        self.confidence_budget = ConfidenceBudget() if on else None
        #: the drafts' confidences and the ``q`` calibration learned from verify outcomes
        self.draft_confidences = DraftConfidences(self.config.draft_method)
        self._step_confidences: dict[str, StepConfidences] = {}
        self._step_observed: list[tuple[list[float], int]] = []
        self._step_probe = False
        self._step_decided = False

    def confidence_caps(self, running: list[Request], caps: list[int],
                        usable: list[int]) -> list[int]:
        """Per request of ``running``, drafts it may verify this step: the budget's width
        within ``caps`` (``usable[i]``: its usable drafts within ``caps[i]``), or today's
        goodput caps when no cost profile is known."""
        scored = []
        for req, n in zip(running, usable):
            drafts = req.tail.usable(n)
            head = req.head_confidences.lookup(req.committed_len, drafts)
            token_probs = req.draft_token_probs.lookup(req.committed_len, drafts)
            scored.append(self.draft_confidences.score(
                drafts, req.tail.usable_probs(n), head, req.acceptance.rate, token_probs,
                sampling_key(req)))
        budget = self.draft_budget
        decision = self.confidence_budget.decide([s.used for s in scored], budget.seconds,
                                                 has_profile=budget.table is not None)
        self._step_confidences = {}
        self._step_observed = []
        if decision is None:  # no cost profile: today's caps (goodput + accept length)
            self.confidence_budget.stats.num_fallback_steps += 1
            self._step_decided = False
            rates = [r.acceptance for r in running]
            goodput = budget.decide(usable, rates)
            self.goodput_caps = goodput
            return [min(goodput.cap(rate, c), int(r.accept_len_ema + 0.5) + 1)
                    for r, rate, c in zip(running, rates, caps)]
        self._step_decided = True
        self._step_probe = decision.probe
        for req, s, w in zip(running, scored, decision.widths):
            if w:
                self._step_confidences[req.request_id] = StepConfidences(
                    s.used[:w], s.kinds[:w], s.raw[:w], s.key)
        return [min(c, w) for c, w in zip(caps, decision.widths)]

    def forget_step_confidences(self, req: Request) -> None:
        """``req`` is not verified as a scored chain this step (a tree): its outcome says
        nothing about the chain's confidences."""
        self._step_confidences.pop(req.request_id, None)

    def observe_confidence(self, req: Request, accept_len: int, num_drafts: int,
                           num_predicted: int) -> None:
        """``req``'s step verified ``num_drafts`` drafts (the first ``num_predicted`` copied
        from its prediction) and accepted ``accept_len``: the scored drafts' outcomes go to
        the calibration and the step's predicted-vs-realised sums. A step that verified
        prediction drafts is left out (they were not scored)."""
        conf = self._step_confidences.pop(req.request_id, None)
        if conf is None or num_predicted:
            return
        n = min(num_drafts, len(conf.used))
        if n <= 0:
            return
        self.draft_confidences.observe(conf, n, accept_len)
        self._step_observed.append((conf.used[:n], min(accept_len, n)))

    def end_confidence_step(self) -> None:
        """The step committed: its predictions and outcomes go to the budget's sums."""
        if self.confidence_budget is not None and self._step_decided:
            self.confidence_budget.observe_step([c for c, _ in self._step_observed],
                                                [a for _, a in self._step_observed],
                                                probe=self._step_probe)
        self._step_confidences = {}
        self._step_observed = []
        self._step_decided = False


__all__ = ["ConfidencePolicy"]
