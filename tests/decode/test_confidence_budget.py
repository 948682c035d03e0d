"""The confidence budget (decode/confidence_budget.py), its calibration
(decode/confidence_calibration.py) and the confidence policy in the scheduler
(decode/confidence_policy.py): no model, no torch."""

from __future__ import annotations

import logging
import math

import pytest

from specmesh.decode.confidence_budget import (
    PROBE_EVERY,
    ConfidenceBudget,
    admitted_widths,
    ranked_slots,
)
from specmesh.decode.confidence_calibration import (
    ConfidenceCalibration,
    ReliabilityBins,
    judged_outcomes,
)
from specmesh.decode.cost_table import VerifyCostTable
from specmesh.decode.config import VerifierConfig
from specmesh.decode.draft_confidence import HEAD, Q, RATE, DraftConfidences, TokenScores
from specmesh.decode.request import Request, RequestStatus
from specmesh.decode.scheduler import Scheduler
from specmesh.engine.block_manager import BlockManager
from specmesh.protocol.messages import SamplingParams


def make_request(rid: str, kappa: int = 4) -> Request:
    return Request(request_id=rid, gateway="gw", prompt_token_ids=list(range(6)),
                   sampling=SamplingParams(max_tokens=10), num_speculative_tokens=kappa)


def make_scheduler(**cfg) -> Scheduler:
    return Scheduler(VerifierConfig(**cfg), BlockManager(64, 4))


def running(req: Request, sched: Scheduler, output: list[int], drafts: list[int]) -> Request:
    """``req`` RUNNING with ``output`` committed and ``drafts`` in its tail."""
    sched.enqueue(req)
    assert sched.admit([req], ["p0"], lambda p: 0) == [req]
    req.status = RequestStatus.RUNNING
    req.output_token_ids = list(output)
    req.drafter = "d0"
    req.tail.reset(len(output))
    req.tail.add(len(output), drafts, req.output_token_ids, base_committed_len=len(output))
    return req


def table(cost) -> VerifyCostTable:  # noqa: ANN001
    """A scripted table over batch 1, 2, 4, 8 and width 1, 2, 4, 8: ``cost(batch, width)``."""
    sizes = (1, 2, 4, 8)
    return VerifyCostTable(sizes, sizes, {(b, w): cost(b, w) for b in sizes for w in sizes})


def flat(_b: int, w: int) -> float:
    return 1.0 + 0.1 * (w - 1)


# -- the tie rule: each request's admitted slots are a prefix -------------------------------

def test_half_half_with_budget_one_admits_position_zero_never_position_one_alone():
    assert admitted_widths([[0.5, 0.5]], 1) == [1]
    first = ranked_slots([[0.5, 0.5]])[0]
    assert (first.request, first.position) == (0, 0)


@pytest.mark.parametrize("confs", [
    [1.0, 1.0, 1.0, 1.0],  # all log scores 0: ties everywhere
    [0.0, 0.0, 0.0],  # all -inf
    [1.0, 0.0, 1.0, 1.0],  # -inf after a 1.0
    [1e-200, 1e-200, 1e-200, 1e-200],  # the products underflow to 0.0 in floats
    [0.3, 1.0, 1.0, 0.0, 1.0],
])
def test_every_budget_admits_a_prefix(confs):
    for budget in range(len(confs) + 2):
        (w,) = admitted_widths([confs], budget)
        assert w == min(budget, len(confs))  # the first w positions, by construction
    slots = ranked_slots([confs])
    assert [s.position for s in slots] == list(range(len(confs)))


def test_underflowing_products_stay_ordered_in_log_space():
    a = [1e-200] * 3  # 1e-400 underflows; 1e-600 too
    b = [1e-250] * 3
    assert math.exp(sum(math.log(c) for c in a[:2])) == 0.0
    slots = ranked_slots([a, b])
    # a's 2nd slot (1e-400) beats b's 2nd (1e-500): compared by log score, not by 0.0 == 0.0
    order = [(s.request, s.position) for s in slots]
    assert order.index((0, 1)) < order.index((1, 1))
    for k in range(7):
        widths = admitted_widths([a, b], k)
        assert sum(widths) == k


def test_ragged_prefixes_across_requests_and_request_order_on_ties():
    confs = [[0.9, 0.9, 0.9], [0.5, 0.5, 0.5], [0.9, 0.1]]
    # scores: r0 .9 .81 .729, r1 .5 .25 .125, r2 .9 .09
    assert admitted_widths(confs, 1) == [1, 0, 0]  # .9 ties: request 0 first
    assert admitted_widths(confs, 2) == [1, 0, 1]
    assert admitted_widths(confs, 4) == [3, 0, 1]
    assert admitted_widths(confs, 5) == [3, 1, 1]
    assert admitted_widths(confs, 6) == [3, 2, 1]
    assert admitted_widths(confs, 7) == [3, 3, 1]  # .125 beats .09
    assert admitted_widths(confs, 8) == [3, 3, 2]
    assert admitted_widths([[0.5, 0.5], [0.5, 0.5]], 2) == [1, 1]  # earlier position first


def test_nan_and_out_of_range_confidences_are_clamped():
    assert admitted_widths([[float("nan"), 1.0], [2.0, -1.0]], 1) == [0, 1]


# -- the budget: argmax of expected tokens per second on the cost table -----------------------

def test_budget_is_the_argmax_of_expected_tokens_per_second_on_a_scripted_table():
    confs = [[0.9, 0.9, 0.2, 0.2]]
    # E(k) = 1 + .9, + .81, + .162, + .0324; widths 1+k rounded up to 1, 2, 4, 4, 8
    steep = table(lambda b, w: {1: 1.0, 2: 1.1, 4: 2.0, 8: 4.0}[w])
    d = ConfidenceBudget().decide(confs, lambda b, n: steep.step_seconds(b, n))
    assert d.widths == [1] and d.budget == 1  # 1.9 / 1.1 beats 2.71 / 2.0 and 2.872 / 2.0
    assert d.expected_drafts == pytest.approx(0.9)
    assert d.tokens_per_s == pytest.approx(1.9 / 1.1)
    cheap = table(lambda b, w: {1: 1.0, 2: 1.1, 4: 1.2, 8: 4.0}[w])
    d = ConfidenceBudget().decide(confs, lambda b, n: cheap.step_seconds(b, n))
    assert d.widths == [3]  # 2.872 / 1.2 beats 2.71 / 1.2; a 4th draft jumps to width 8
    # brute force over every k agrees
    for t in (steep, cheap):
        slots = ranked_slots(confs)
        rates = [(1 + sum(s.score for s in slots[:k])) / t.step_seconds(1, k)
                 for k in range(len(slots) + 1)]
        d = ConfidenceBudget().decide(confs, lambda b, n, t=t: t.step_seconds(b, n))
        assert d.budget == max(range(len(rates)), key=lambda k: (rates[k], -k))


def test_budget_zero_when_drafts_do_not_pay_then_a_probe():
    dear = table(lambda b, w: float(w))  # a draft costs a whole token's forward
    budget = ConfidenceBudget()
    for _ in range(PROBE_EVERY - 1):
        d = budget.decide([[0.3, 0.3], [0.2]], lambda b, n: dear.step_seconds(b, n))
        assert d.widths == [0, 0] and not d.probe
    d = budget.decide([[0.3, 0.3], [0.2]], lambda b, n: dear.step_seconds(b, n))
    assert d.probe and d.widths == [1, 1]


def test_no_profile_warns_once_and_does_not_decide(caplog):
    budget = ConfidenceBudget()
    with caplog.at_level(logging.WARNING, logger="specmesh.decode.confidence_budget"):
        assert budget.decide([[0.9]], lambda b, n: 1.0, has_profile=False) is None
        assert budget.decide([[0.9]], lambda b, n: 1.0, has_profile=False) is None
    warnings = [r for r in caplog.records if "no profiled verify cost table" in r.message]
    assert len(warnings) == 1


def test_predicted_vs_realised_running_sums():
    budget = ConfidenceBudget()
    budget.observe_step([[0.5, 0.5], [1.0]], [1, 1])  # predicted .5 + .25 + 1, realised 2
    budget.observe_step([[0.8]], [0])  # .8, realised 0
    st = budget.stats
    assert st.num_steps == 2 and st.num_request_steps == 3
    assert st.predicted_accepted == pytest.approx(2.55)
    assert st.realised_accepted == 2
    assert st.as_dict()["mean_abs_error_per_step"] == pytest.approx((0.25 + 0.8) / 2)
    assert sum(r["num_judged"] for r in st.as_dict()["reliability"]) == 4  # .5 .5 1.0 .8


# -- calibration ------------------------------------------------------------------------------

def test_judged_outcomes():
    assert judged_outcomes(3, 3) == [True] * 3
    assert judged_outcomes(3, 1) == [True, False]  # the third was never judged
    assert judged_outcomes(2, 0) == [False]


def test_calibration_starts_at_identity_and_converges_on_scripted_outcomes():
    cal = ConfidenceCalibration()
    assert cal.calibrated("m:q", 0, 0.93) == pytest.approx(0.93)
    # an over-confident drafter at position 0 (q 0.9 survives 30 %) and an under-confident one
    # at position 1 (q 0.15 survives 80 %)
    for i in range(400):
        cal.observe_draft("m:q", 0, 0.9, i % 10 < 3)
        cal.observe_draft("m:q", 1, 0.15, i % 5 != 0)
    assert cal.calibrated("m:q", 0, 0.9) == pytest.approx(0.3, abs=0.01)
    assert cal.calibrated("m:q", 1, 0.15) == pytest.approx(0.8, abs=0.01)
    assert cal.calibrated("m:q", 0, 0.15) == pytest.approx(0.15)  # another bin: untouched
    assert cal.calibrated("other:q", 0, 0.9) == pytest.approx(0.9)  # another drafter
    bins = cal.tables[("m:q", 0)]
    assert bins.mean_abs_error() == pytest.approx(0.6)  # predicted .9, realised .3


def test_calibration_observe_counts_only_judged_drafts():
    cal = ConfidenceCalibration()
    cal.observe("k", [0.9, 0.9, 0.9], 1)  # 0 survived, 1 rejected, 2 never judged
    assert [cal.tables[("k", j)].num_judged for j in range(2)] == [1, 1]
    assert ("k", 2) not in cal.tables


def test_reliability_rows():
    r = ReliabilityBins(4)
    r.observe(0.1, False)
    r.observe(0.9, True)
    r.observe(1.0, True)
    rows = r.as_rows()
    assert [row["num_judged"] for row in rows] == [1, 0, 0, 2]
    assert rows[3]["mean_predicted"] == pytest.approx(0.95) and rows[3]["survival_rate"] == 1


# -- draft confidences: head, calibrated q, the request's acceptance -------------------------

def test_draft_confidences_prefer_head_then_q_then_rate():
    src = DraftConfidences("m")
    rows = [None, {7: 0.6}, None]
    got = src.score([5, 7, 9], rows, [0.95, None, None], rate=0.4)
    assert got.kinds == [HEAD, Q, RATE]
    assert got.used == pytest.approx([0.95, 0.6, 0.4])
    for _ in range(200):  # q 0.6 at position 1 never survives
        src.observe(src.score([5, 7], rows, [0.95, None], 0.4), 2, 1)
    assert src.score([5, 7], rows, [0.95, None], 0.4).used[1] < 0.05


def test_head_confidences_match_position_and_token():
    h = TokenScores()
    h.add(4, [10, 11, 12], [0.9, 0.8, 0.7])
    assert h.lookup(4, [10, 99, 12]) == [0.9, None, 0.7]
    assert h.lookup(5, [11, 12]) == [0.8, 0.7]
    assert 4 not in h.by_position  # committed positions are forgotten


# -- the policy in the scheduler --------------------------------------------------------------

def test_scheduler_admits_ragged_prefixes_from_head_confidences():
    sched = make_scheduler(speculative_policy="confidence", num_speculative_tokens=3)
    sched.draft_budget.table = table(lambda b, w: {1: 1.0, 2: 1.0, 4: 1.5, 8: 3.0}[w])
    a = running(make_request("a", kappa=3), sched, [1, 2], drafts=[3, 4, 5])
    b = running(make_request("b", kappa=3), sched, [1, 2], drafts=[6, 7, 8])
    a.head_confidences.add(2, [3, 4, 5], [0.9, 0.9, 0.9])
    b.head_confidences.add(2, [6, 7, 8], [0.5, 0.5, 0.5])
    plan = sched.plan([a, b])
    # k = 2 (batch 2, width 2, 1.0 s): 2 + .9 + .81 beats every wider step
    assert [p.draft_token_ids for p in plan] == [[3, 4], []]
    assert sched.drafts_wanted(b) == 3  # a budget-0 request's drafter keeps its run-ahead
    sched.observe_accept(a, 1, 2)
    sched.end_step()
    st = sched.confidence_budget.stats
    assert st.num_steps == 1 and st.predicted_accepted == pytest.approx(0.9 + 0.81)
    assert st.realised_accepted == 1


def test_scheduler_budget_zero_step_still_plans_every_request():
    sched = make_scheduler(speculative_policy="confidence", num_speculative_tokens=2)
    sched.draft_budget.table = table(lambda b, w: float(w) * 2)
    reqs = [running(make_request(r, kappa=2), sched, [1], drafts=[4, 5]) for r in "ab"]
    plan = sched.plan(reqs)
    assert [p.request.request_id for p in plan] == ["a", "b"]
    assert all(p.draft_token_ids == [] for p in plan)
    assert all(sched.drafts_wanted(r) == 2 for r in reqs)


def test_scheduler_without_a_table_keeps_the_goodput_caps(caplog):
    sched = make_scheduler(speculative_policy="confidence", num_speculative_tokens=3)
    req = running(make_request("a", kappa=3), sched, [1], drafts=[4, 5, 6])
    with caplog.at_level(logging.WARNING, logger="specmesh.decode.confidence_budget"):
        (p,) = sched.plan([req])
    # the goodput policy's exploration: every draft first (as under --speculative-policy goodput)
    assert p.draft_token_ids == [4, 5, 6]
    assert sched.confidence_budget.stats.num_fallback_steps == 1
    assert any("no profiled verify cost table" in r.message for r in caplog.records)
