"""The verifier's scheduler: who runs, with how many drafts, and where (pure Python, no torch).

Admission, KV reservation and peer choice live in :mod:`decode.admission`, the tail-wait
budget in :mod:`decode.tail_wait` (mixins of :class:`Scheduler`). Each step the scheduler
plans, per running request, the drafts to verify: its usable tail, capped by kappa
(``num_speculative_tokens``), by the tokens it may still emit and (``adaptive_drafts``) by one
more than its recent accept length, (``goodput_drafts``) by its goodput-maximising cap this step
(decode/goodput.py) -- both under ``speculative_policy`` goodput only --, (the schedule policy)
by the step's kappa from SGLang's schedule (decode/kappa_schedule.py), (the confidence policy)
by the confidence budget's width (decode/confidence_policy.py), and the whole batch by
``max_num_batched_tokens``. A run of drafts
copied from the request's prediction (OpenAI Predicted Outputs) at the head of its tail has a
width of its own instead: kappa after a rejected prediction draft, doubled after each run
accepted whole, up to ``num_prediction_tokens`` (:meth:`Scheduler.prediction_drafts`); its
steps do not move the accept history the method's caps read (:meth:`Scheduler.observe_accept`).
A
request whose tail holds a draft tree (one-hot drafts, or a sampled tree's rows) gets a tree
instead: its depth capped like a chain's length, its nodes by ``max_tree_nodes`` (default
twice kappa, as vLLM / SGLang give trees a node budget of their own).

The block manager is any object with ``num_blocks``, ``num_free_blocks``, ``blocks_for``,
``allocate`` and ``free`` (``engine.block_manager.BlockManager``); tests hand-build requests and
use the real one, no model needed.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from specmesh.decode.admission import Admission, BlockAllocator
from specmesh.decode.config import ACCEPT_LEN_EMA_WEIGHT, VerifierConfig
from specmesh.decode.confidence_policy import ConfidencePolicy
from specmesh.decode.goodput import DraftBudget, DraftCaps
from specmesh.decode.kappa_schedule import KappaSchedule
from specmesh.decode.request import Request
from specmesh.decode.speculation_gate import SpeculationGate
from specmesh.decode.tail_wait import TailWait
from specmesh.protocol.messages import SamplingParams

log = logging.getLogger(__name__)

#: Factor a request's prediction width grows by after a step that accepted its whole
#: prediction run (Scheduler.prediction_drafts).
PREDICTION_WIDTH_GROWTH = 2


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request of a verify step: verify ``draft_token_ids`` after its last committed token.
    ``draft_probs``: the row each draft was drawn from (None: one-hot), aligned with it.
    ``parents`` (a token tree, tree verification): each draft's parent index among the drafts
    (-1: the last committed token); None for a chain. ``from_prediction``: whether each of the
    first drafts was copied from the request's prediction; those drafts are the chain from the
    last committed token (the whole chain, or a tree's first nodes: its chain tail); None when
    none was (decode/prediction_usage.py)."""

    request: Request
    draft_token_ids: list[int]
    draft_probs: list[object | None] | None = None
    parents: list[int] | None = None
    from_prediction: list[bool] | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens this request puts into the verify forward."""
        return 1 + len(self.draft_token_ids)


class Scheduler(Admission, TailWait, ConfidencePolicy):
    """Admission, KV reservation, draft plans, tail-wait decisions and peer choice.

    ``num_speculative_tokens`` starts at the config's value; the controller may change it.
    """

    def __init__(self, config: VerifierConfig, block_manager: BlockAllocator) -> None:
        self.config = config
        self.block_manager = block_manager
        self.num_speculative_tokens = config.num_speculative_tokens
        self.waiting: deque[Request] = deque()
        self.step_time_ema_s = 0.0
        self.draft_budget = DraftBudget()
        # running requests with usable drafts at the last plan, before the goodput caps
        self.last_plan_with_tail = 0
        # the latest step's goodput decision (None: off, or no step with tails yet)
        self.goodput_caps: DraftCaps | None = None
        self._prefill_turn = 0  # rotates the prefill peer that wins a tie
        #: whether a request's drafts may be verified as a tree (the verifier sets it from its
        #: verification rules, decode/rules.py RuleSet.judges_trees); default: always
        self.tree_verifiable: Callable[[SamplingParams], bool] = lambda sampling: True
        #: the schedule policy's controller (None under the other policies), the kappa it
        #: gave the current step (None: no step kappa) and what the step is fed back with
        self.kappa_schedule = KappaSchedule(config.schedule, config.num_speculative_tokens) \
            if config.speculative_policy == "schedule" else None
        self.step_kappa: int | None = None
        self._step_batch = 0
        self._step_accepts: list[int] = []
        #: how many leading drafts of a request are worth verifying (the verifier sets it to
        #: its grammars' check, decode/grammar.py: drafts a request's grammar refuses are cut
        #: here, before the forward); default: all
        self.draft_limit: Callable[[Request, list[int]], int] = lambda req, drafts: len(drafts)
        self.init_confidence_policy()  # its budget (decode/confidence_policy.py)
        #: drafting on or off for the whole verifier, on measured throughput, under the
        #: goodput policy (decode/speculation_gate.py; None: off)
        self.speculation_gate = SpeculationGate(log=log.info) \
            if config.gates_speculation else None

    # -- the per-step draft plan -----------------------------------------------------------

    def num_drafts(self, req: Request) -> int:
        """Drafts to verify for ``req`` this step, before looking at its tail: kappa, never
        past ``max_tokens``, and with ``adaptive_drafts`` at most one more than the request's
        recent accept length (an EMA), so a request whose drafts keep failing costs about a
        plain decode step."""
        if not (req.spec_enabled and req.drafter is not None):
            return 0
        k = min(req.num_speculative_tokens, req.num_remaining - 1)
        if self.step_kappa is not None:  # the schedule policy's kappa of this step
            k = min(k, self.step_kappa)
        if self.config.accept_len_caps:
            k = min(k, int(req.accept_len_ema + 0.5) + 1)  # all accepted -> may grow
        return max(k, 0)

    def prediction_drafts(self, req: Request) -> int:
        """Most drafts verified for ``req`` this step when they are a run of its prediction's
        from the last committed token (never past ``max_tokens``; 0 for a request without a
        prediction): its prediction width, which starts at its kappa, doubles after every
        step that accepted its whole prediction run, up to ``num_prediction_tokens``, and
        falls back to kappa after a step that rejected a prediction draft
        (:meth:`observe_accept`), like TCP's slow start.

        Neither ``adaptive_drafts`` nor ``goodput_drafts`` caps it: the drafts cost no
        forward to make, and the history those caps read is the method's. The width is not
        simply ``num_prediction_tokens``: where the output leaves the prediction (an edit, or
        a model that words it differently), a wide step verifies many drafts past the first
        rejected one, and a verify forward's cost grows with its tokens
        (docs/benchmarks.md, 'Predicted Outputs'); a run that keeps matching grows back to
        the full width in a few steps."""
        if not (req.prediction_token_ids and req.spec_enabled and req.drafter is not None
                and req.num_speculative_tokens > 0):
            return 0
        width = req.prediction_width or req.num_speculative_tokens
        return max(min(width, self._max_prediction_width(req), req.num_remaining - 1), 0)

    def _max_prediction_width(self, req: Request) -> int:
        """The widest prediction run ``req`` may verify: ``num_prediction_tokens``, at least
        its kappa."""
        return max(self.config.num_prediction_tokens, req.num_speculative_tokens)

    def _prediction_run(self, req: Request, width: int) -> int:
        """Drafts at the head of ``req``'s usable tail copied from its prediction, at most
        ``width``."""
        run = 0
        for flag in req.tail.usable_predicted(width):
            if not flag:
                break
            run += 1
        return min(run, len(req.tail.usable(width)))

    def drafts_wanted(self, req: Request) -> int:
        """What VerifyCommit tells ``req``'s drafter it will verify next: :meth:`num_drafts`,
        within its cap under the latest goodput decision (0 while its drafts are held back:
        the drafter then keeps only a probe's worth)."""
        k = self.num_drafts(req)
        caps = self.goodput_caps
        if caps is None or req.acceptance.num_steps == 0:
            # the latest decision was made for other requests: one whose drafts were never
            # verified is owed its first ones, as plan() would decide with them in hand
            return k
        return caps.cap(req.acceptance, k)

    def plan(self, running: list[Request]) -> list[PlannedRequest]:
        """The verify step's batch: every running request (in order) with its usable drafts,
        within ``max_num_batched_tokens`` (drafts are trimmed first; a request that does not
        fit even without drafts waits for the next step). Allocates the KV slots the planned
        tokens will be written to."""
        budget = self.config.max_num_batched_tokens
        plans: list[PlannedRequest] = []
        caps = [self.num_drafts(req) for req in running]
        usable = [len(r.tail.usable(c)) for r, c in zip(running, caps)]
        # the draft supply, before the goodput caps choose among it
        self.last_plan_with_tail = sum(n > 0 for n in usable)
        # a step with no tails decides nothing about drafts
        if self.confidence_budget is not None and any(usable):
            caps = self.confidence_caps(running, caps, usable)
        elif self.config.goodput_caps and any(usable):
            rates = [r.acceptance for r in running]
            decision = self.draft_budget.decide(usable, rates)
            caps = [decision.cap(rate, c) for rate, c in zip(rates, caps)]
            self.goodput_caps = decision
        for req, k in zip(running, caps):
            if budget < 1:
                break
            width = self.prediction_drafts(req)
            if width > k:  # a prediction run is verified past the method's caps
                k = max(k, self._prediction_run(req, width))
            k = min(k, budget - 1)
            drafts = req.tail.usable(k)
            if drafts:
                drafts = drafts[:self.draft_limit(req, drafts)]
            probs = req.tail.usable_probs(len(drafts))
            predicted = req.tail.usable_predicted(len(drafts))
            predicted = predicted if any(predicted) else None
            tree = None
            # a rule that judges chains only (synthetic acceptance): branch 0 as a chain
            if req.tail.tree is not None and self.tree_verifiable(req.sampling):
                tree = req.tail.usable_tree_rows(k, min(self.max_tree_nodes(req), budget - 1))
            if tree is not None:
                self.forget_step_confidences(req)  # the budget scored its chain
                drafts, parents, rows = tree
                # the tree's first nodes are the chain tail (DraftTree.plan), as many as fit;
                # rows: a sampled tree's (None: one-hot)
                planned = PlannedRequest(req, drafts,
                                         None if all(r is None for r in rows) else rows,
                                         parents, predicted and predicted[:len(drafts)])
            else:
                planned = PlannedRequest(req, drafts, probs, None, predicted)
            budget -= 1 + len(drafts)
            self.ensure_blocks(req, req.kv_len + 1 + len(drafts))
            plans.append(planned)
        return plans

    def max_tree_nodes(self, req: Request) -> int:
        """Most tree nodes verified for ``req`` in one step: ``max_tree_nodes`` or, when 0,
        twice its kappa (the depth is capped by :meth:`num_drafts`, like a chain's length),
        and never more than a chain could have at the end of the request (``num_remaining -
        1``): their KV stays inside the request's reservation (prompt + max_tokens)."""
        nodes = self.config.max_tree_nodes or 2 * req.num_speculative_tokens
        return max(min(nodes, req.num_remaining - 1), 0)

    def observe_accept(self, req: Request, accept_len: int, num_drafts: int,
                       num_predicted: int = 0) -> None:
        """Update ``req``'s accept-length EMA and acceptance after a verify step that carried
        ``num_drafts`` drafts, the first ``num_predicted`` of them copied from its prediction.

        Those two are the history of the method's drafts (what ``adaptive_drafts`` and
        ``goodput_drafts`` cap): the prediction drafts are left out, so a step of prediction
        drafts only leaves them alone, and a step whose prediction run was all accepted counts
        the method drafts after it as a step of their own (one whose run was cut before them
        never judged them). The prediction drafts set the request's prediction width instead
        (:meth:`prediction_drafts`): doubled when all were accepted, kappa when one was
        not."""
        num_predicted = min(max(num_predicted, 0), num_drafts)
        self.observe_confidence(req, accept_len, num_drafts, num_predicted)
        if num_predicted:
            if accept_len >= num_predicted:
                width = req.prediction_width or req.num_speculative_tokens
                req.prediction_width = min(PREDICTION_WIDTH_GROWTH * max(width, 1),
                                           self._max_prediction_width(req))
            else:
                req.prediction_width = req.num_speculative_tokens
            if num_predicted == num_drafts or accept_len < num_predicted:
                return
            accept_len -= num_predicted
            num_drafts -= num_predicted
        if self.kappa_schedule is not None:
            self._step_accepts.append(accept_len)
        req.accept_len_ema += ACCEPT_LEN_EMA_WEIGHT * (accept_len - req.accept_len_ema)
        req.acceptance.observe(accept_len, num_drafts)

    # -- the schedule policy's step kappa (decode/kappa_schedule.py) -----------------------

    def begin_step(self, running: list[Request]) -> None:
        """A verify step of ``running`` begins: under the schedule policy its kappa is the
        one of the batch's slot (:attr:`step_kappa`, read by :meth:`num_drafts`, so the tail
        wait, the plan and the VerifyCommit of this step follow it)."""
        self._step_batch = len(running)
        self._step_accepts = []
        if self.kappa_schedule is not None:
            self.step_kappa = self.kappa_schedule.kappa_for(len(running))
        if self.speculation_gate is not None and running:
            self.step_kappa = None if self.speculation_gate.begin(len(running)) else 0

    def end_step(self) -> None:
        """The step begun by :meth:`begin_step` committed: the schedule takes the accepted
        drafts of each request that verified the method's drafts (:meth:`observe_accept`)
        and may move the slot's kappa (the next step's)."""
        if self.kappa_schedule is not None and self._step_batch:
            self.kappa_schedule.observe(self._step_batch, self._step_accepts)
        self._step_accepts = []
        self.end_confidence_step()  # the confidence policy's predicted vs realised drafts

    @property
    def current_kappa(self) -> int:
        """Kappa now: the schedule's latest step kappa, 0 while the speculation gate has
        drafting off, else the default one."""
        if self.kappa_schedule is not None:
            return self.kappa_schedule.current_kappa
        if self.speculation_gate is not None and not self.speculation_gate.on:
            return 0
        return self.num_speculative_tokens

    def observe_forward(self, num_tokens: int, seconds: float, batch: int = 0) -> None:
        """A verify forward of ``batch`` requests (0: not told) over ``num_tokens`` query
        tokens took ``seconds`` (the cost model of ``goodput_drafts``)."""
        self.draft_budget.observe_forward(num_tokens, seconds, batch)

    def drafting_paused(self, req: Request) -> bool:
        """Whether ``req``'s drafter is told to draft nothing (VerifyCommit.drafting_paused):
        the speculation gate has drafting off and the request has no prediction to draft
        from."""
        gate = self.speculation_gate
        return gate is not None and not gate.on and not req.prediction_token_ids

    def observe_step_tokens(self, batch: int, num_tokens: int, seconds: float) -> None:
        """The step begun last (``batch`` requests) committed ``num_tokens`` tokens in
        ``seconds`` of step time (the speculation gate's measure)."""
        if self.speculation_gate is not None:
            self.speculation_gate.end(batch, num_tokens, seconds)

    def observe_step_overhead(self, batch: int, seconds: float) -> None:
        """A step of ``batch`` requests spent ``seconds`` besides its forward and its tail
        wait (the goodput cost model's per-step part, decode/goodput.py)."""
        self.draft_budget.observe_overhead(batch, seconds)
