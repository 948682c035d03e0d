"""The verifier's scheduler with hand-built requests and the real block manager; no model, no
torch (nano-vllm tests its scheduler the same way)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specmesh.decode.config import ACCEPT_LEN_EMA_WEIGHT, VerifierConfig
from specmesh.decode.goodput import NO_DRAFTS, DraftCaps
from specmesh.decode.request import Request, RequestStatus
from specmesh.decode.scheduler import Scheduler
from specmesh.engine.block_manager import BlockManager
from specmesh.protocol.messages import SamplingParams

BLOCK = 4


def make_request(rid: str, prompt_len: int = 6, max_tokens: int = 10, kappa: int = 4) -> Request:
    return Request(request_id=rid, gateway="gw", prompt_token_ids=list(range(prompt_len)),
                   sampling=SamplingParams(max_tokens=max_tokens), num_speculative_tokens=kappa)


def make_scheduler(num_blocks: int = 64, **cfg) -> Scheduler:
    return Scheduler(VerifierConfig(**cfg), BlockManager(num_blocks, BLOCK))


def running(req: Request, sched: Scheduler, output: list[int], drafter: str | None = "d0",
            drafts: list[int] | None = None) -> Request:
    """Put ``req`` in RUNNING with ``output`` committed and ``drafts`` in its tail."""
    sched.enqueue(req)
    assert sched.admit([req], ["p0"], lambda p: 0) == [req]
    req.status = RequestStatus.RUNNING
    req.output_token_ids = list(output)
    req.drafter = drafter
    req.tail.reset(len(output))
    if drafts:
        req.tail.add(len(output), drafts, req.output_token_ids, base_committed_len=len(output))
    return req


def test_scheduler_imports_no_torch():
    code = "import sys, decode.scheduler; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_validate_names_the_limit_exceeded():
    sched = make_scheduler(num_blocks=4, max_model_len=64)

    def why(prompt_len=10, vocab=100, kappa=None, **sampling):
        sp = SamplingParams(**{"max_tokens": 6, **sampling})
        return sched.validate(list(range(prompt_len)), sp, kappa, vocab)

    assert why() == ""  # 16 tokens = 4 blocks
    assert why(prompt_len=0) == "prompt is empty"
    assert "[0, 5)" in why(vocab=5)
    assert why(max_tokens=0) == "max_tokens must be >= 1"
    assert why(temperature=0.5) == why(temperature=0.5, seed=3) == ""  # sampled, seeded
    assert "temperature must be finite" in why(temperature=float("nan"))
    assert "min_p must be in [0, 1]" in why(temperature=1.0, min_p=1.5)
    assert "seed must be in" in why(temperature=1.0, seed=1 << 64)
    assert why(kappa=-1) == "num_speculative_tokens must be >= 0"
    assert "maximum model length 64" in why(prompt_len=60, max_tokens=10)
    assert "needs 5 KV blocks, the verifier has 4" in why(max_tokens=7)


def test_queue_full_at_max_queue_len():
    sched = make_scheduler(max_queue_len=2)
    assert not sched.queue_full()
    sched.enqueue(make_request("a"))
    sched.enqueue(make_request("b"))
    assert sched.queue_full()
    sched.dequeue(sched.waiting[0])
    assert not sched.queue_full()
    sched.dequeue(make_request("never-queued"))  # no-op
    assert len(sched.waiting) == 1


def test_admission_reserves_kv_and_allocates_prompt_plus_lookahead():
    sched = make_scheduler(num_blocks=10)
    req = make_request("a", prompt_len=6, max_tokens=10, kappa=4)  # 16 tokens -> 4 blocks
    sched.enqueue(req)
    assert sched.admit([req], ["p0"], lambda p: 0) == [req]
    assert req.status is RequestStatus.PREFILLING and req.prefill_peer == "p0"
    assert len(req.block_table) == 3  # prompt 6 + kappa 4 + 1 = 11 tokens
    assert req.num_reserved_blocks == 4
    assert sched.outstanding_blocks([req]) == 1
    assert sched.num_free_blocks([req]) == 10 - 4
    sched.ensure_blocks(req, 16)
    assert len(req.block_table) == 4 and sched.outstanding_blocks([req]) == 0
    sched.release(req)
    assert sched.block_manager.num_free_blocks == 10 and req.block_table == []


def test_admission_is_fifo_and_stops_at_the_first_request_that_does_not_fit():
    sched = make_scheduler(num_blocks=8)
    big = make_request("big", prompt_len=20, max_tokens=8)  # 7 blocks
    small = make_request("small", prompt_len=2, max_tokens=2)  # 1 block
    first = make_request("first", prompt_len=4, max_tokens=4)  # 2 blocks
    for r in (first, big, small):
        sched.enqueue(r)
    live = [first, big, small]
    assert sched.admit(live, ["p0"], lambda p: 0) == [first]
    # big does not fit next to first's reservation; small must not overtake it.
    assert list(sched.waiting) == [big, small]
    sched.release(first)
    first.status = RequestStatus.FINISHED
    assert sched.admit([big, small], ["p0"], lambda p: 0) == [big, small]


def test_admission_caps_at_max_num_seqs_and_needs_a_prefill_peer():
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(str(i)) for i in range(3)]
    for r in reqs:
        sched.enqueue(r)
    assert sched.admit(reqs, [], lambda p: 0) == []  # no prefill worker known yet
    assert sched.admit(reqs, ["p0"], lambda p: 0) == reqs[:2]
    assert sched.admit(reqs, ["p0"], lambda p: 0) == []  # two admitted already
    reqs[0].status = RequestStatus.FINISHED
    sched.release(reqs[0])
    assert sched.admit(reqs[1:], ["p0"], lambda p: 0) == [reqs[2]]


def test_admission_picks_the_least_loaded_prefill_peer():
    sched = make_scheduler()
    req = make_request("a")
    sched.enqueue(req)
    load = {"p0": 3, "p1": 1, "p2": 2}
    sched.admit([req], list(load), load.__getitem__)
    assert req.prefill_peer == "p1"


def test_admission_spreads_requests_over_equally_loaded_prefill_peers():
    """Ties rotate: idle prefill workers share the requests (one that joined the cluster
    gets work), and a burst admitted in one call is spread, not all sent to the first."""
    sched = make_scheduler()
    peers = ["p0", "p1", "p2"]
    one_by_one = []
    for i in range(6):  # each transfer ends before the next request: every load stays 0
        req = make_request(f"a{i}")
        sched.enqueue(req)
        sched.admit([req], peers, lambda p: 0)
        one_by_one.append(req.prefill_peer)
        req.status = RequestStatus.FINISHED
        sched.release(req)
    assert sorted(one_by_one) == ["p0", "p0", "p1", "p1", "p2", "p2"]
    burst = [make_request(f"b{i}") for i in range(3)]
    for r in burst:
        sched.enqueue(r)
    assert sched.admit(burst, peers, lambda p: 0) == burst
    assert sorted(r.prefill_peer for r in burst) == peers
    late = make_request("c")
    sched.enqueue(late)
    sched.admit([*burst, late], peers, {"p0": 2, "p1": 0, "p2": 1}.__getitem__)
    assert late.prefill_peer == "p1"  # the least loaded still wins over the turn


def test_num_drafts_caps_by_kappa_remaining_tokens_and_accept_ema():
    sched = make_scheduler()
    req = running(make_request("a", max_tokens=10, kappa=4), sched, output=[7])
    assert sched.num_drafts(req) == 4
    req.output_token_ids = [7] * 8  # two tokens left: one verified draft + the bonus token
    assert sched.num_drafts(req) == 1
    req.output_token_ids = [7]
    req.accept_len_ema = 0.2  # drafts keep failing: verify at most one
    assert sched.num_drafts(req) == 1
    sched.observe_accept(req, 4, 4)
    assert req.accept_len_ema == pytest.approx(0.2 + ACCEPT_LEN_EMA_WEIGHT * 3.8)
    assert sched.num_drafts(req) == 3
    req.spec_enabled = False  # quarantined
    assert sched.num_drafts(req) == 0


def test_num_drafts_without_adaptive_drafts_ignores_the_ema():
    sched = make_scheduler(adaptive_drafts=False)
    req = running(make_request("a", kappa=3), sched, output=[7])
    req.accept_len_ema = 0.0
    assert sched.num_drafts(req) == 3
    req.drafter = None
    assert sched.num_drafts(req) == 0


def test_plan_uses_the_tail_and_allocates_the_verified_slots():
    sched = make_scheduler(num_blocks=16)
    req = running(make_request("a", prompt_len=6, max_tokens=10, kappa=4), sched, output=[9],
                  drafts=[1, 2, 3, 4, 5, 6])
    (plan,) = sched.plan([req])
    assert plan.request is req and plan.draft_token_ids == [1, 2, 3, 4]
    assert plan.num_tokens == 5
    # kv_len 6 + last committed token + 4 drafts = 11 positions -> 3 blocks
    assert len(req.block_table) == 3


def test_plan_trims_drafts_to_the_token_budget_and_defers_what_does_not_fit():
    sched = make_scheduler(max_num_batched_tokens=17, max_num_speculative_tokens=16)
    reqs = [running(make_request(str(i), kappa=8, max_tokens=20), sched, output=[9],
                    drafts=list(range(10, 18))) for i in range(3)]
    plans = sched.plan(reqs)
    assert [p.num_tokens for p in plans] == [9, 8]  # 17 tokens: the second loses a draft
    assert [p.request for p in plans] == reqs[:2]  # the third waits for the next step
    assert sum(p.num_tokens for p in plans) <= 17


def test_tail_wait_budget_is_what_the_next_draft_is_worth():
    """With goodput caps a step waits for a draft no longer than its expected gain pays for
    (w < T * g / E): long for a first draft, briefly for a second, little in a batch."""
    from specmesh.decode.acceptance import Acceptance

    sched = make_scheduler(tail_wait_fraction=0.5, goodput_drafts=True)
    sched.observe_step_time(0.020)
    one = running(make_request("one", kappa=4), sched, output=[1])
    one.acceptance = Acceptance(first_accepted=0.4, first_rejected=0.6, later_accepted=0.4,
                                later_rejected=0.6)  # 0.4 at every position
    one.tail_in_flight = True
    assert sched.tail_wait_budget_s([one]) == pytest.approx(0.020 * 0.4 / 1.0)
    one.tail.add(1, [7], one.output_token_ids, base_committed_len=1)  # its first draft came
    assert sched.tail_wait_budget_s([one]) == pytest.approx(0.020 * 0.16 / 1.4)
    batch = [one] + [running(make_request(f"b{i}", kappa=4), sched, output=[1])
                     for i in range(15)]
    assert sched.tail_wait_budget_s(batch) == pytest.approx(0.020 * 0.16 / 16.4)
    one.acceptance = Acceptance()  # optimistic start (rate 1): the fixed cap bounds it
    assert sched.tail_wait_budget_s([one]) == pytest.approx(0.010)
    one.tail_in_flight = False  # nothing owed: no wait
    assert sched.tail_wait_budget_s([one]) == 0.0


def test_tail_wait_budget_and_awaiting_tail():
    sched = make_scheduler(tail_wait_fraction=0.5)
    assert sched.tail_wait_budget_s() == 0.0  # no step measured yet
    sched.observe_step_time(0.1)
    assert sched.tail_wait_budget_s() == pytest.approx(0.05)
    short = running(make_request("short"), sched, output=[1], drafts=[2])
    full = running(make_request("full"), sched, output=[1], drafts=[2, 3, 4, 5])
    idle = running(make_request("idle"), sched, output=[1])
    short.tail_in_flight = full.tail_in_flight = True
    assert sched.awaiting_tail([short, full, idle]) == [short]


def test_pick_drafter_balances_and_respects_quarantine():
    sched = make_scheduler()
    a, b, c = (make_request(x) for x in "abc")
    a.drafter = "d0"
    b.drafter = "d0"
    assert sched.pick_drafter(c, [a, b, c], ["d0", "d1"]) == "d1"
    assert sched.pick_drafter(c, [a, b, c], []) is None
    c.spec_enabled = False
    assert sched.pick_drafter(c, [a, b, c], ["d0", "d1"]) is None
    no_spec = make_request("n", kappa=0)
    assert sched.pick_drafter(no_spec, [], ["d0"]) is None


def test_speculative_tokens_for_caps_a_request_kappa():
    sched = make_scheduler(num_speculative_tokens=3, max_num_speculative_tokens=6)
    assert sched.speculative_tokens_for(None) == 3
    assert sched.speculative_tokens_for(2) == 2
    assert sched.speculative_tokens_for(50) == 6
    sched.num_speculative_tokens = 5  # the controller changed kappa
    assert sched.speculative_tokens_for(None) == 5


def test_goodput_drafts_cap_the_plan_by_measured_cost_and_acceptance():
    """goodput_drafts: the plan verifies no drafts where their measured acceptance does not
    pay for the measured cost of verifying them, and every usable one where it does; the
    per-request cap (num_drafts) is what VerifyCommit tells the drafter."""
    for accepted, want in ((0, []), (4, [1, 2, 3, 4])):
        sched = make_scheduler(num_blocks=16, goodput_drafts=True)
        for n, t in ((1, 0.10), (5, 0.20)):  # a 5-token verify costs 2x a one-token step
            sched.observe_forward(n, t)
        req = running(make_request("a", max_tokens=20), sched, output=[9], drafts=[1, 2, 3, 4])
        for _ in range(10):
            sched.observe_accept(req, accepted, 4)
        (plan,) = sched.plan([req])
        assert plan.draft_token_ids == want
        # the supply is counted before the caps: the tail was there either way
        assert sched.last_plan_with_tail == 1
    off = make_scheduler(num_blocks=16)  # off (a bare worker's default): every usable draft
    req = running(make_request("a", max_tokens=20), off, output=[9], drafts=[1, 2, 3, 4])
    req.acceptance.observe(0, 4)
    (plan,) = off.plan([req])
    assert plan.draft_token_ids == [1, 2, 3, 4]


def test_no_tail_wait_for_drafts_the_goodput_cap_holds_back():
    sched = make_scheduler(goodput_drafts=True, tail_wait_fraction=0.5)
    req = running(make_request("a", max_tokens=20), sched, output=[1])
    req.tail_in_flight = True
    assert sched.awaiting_tail([req]) == [req]  # no cap measured yet: kappa's worth
    sched.goodput_caps = NO_DRAFTS  # the latest step held drafts back ...
    assert sched.awaiting_tail([req]) == [req]  # ... for others: this one's are owed a try
    assert sched.drafts_wanted(req) == 4
    req.acceptance.observe(1, 4)
    assert sched.awaiting_tail([req]) == [] and sched.drafts_wanted(req) == 0
    sched.goodput_caps = DraftCaps(0.5)  # its first draft (rate 0.64 now) pays
    assert sched.awaiting_tail([req]) == [req]


def test_a_new_request_waits_for_its_first_drafts_whatever_the_last_decision():
    """The goodput decision of the last step was made for the requests then running: a
    request whose drafts were never verified (served, its first tail still in flight) must
    not inherit a 'hold back' and skip its first drafts, as it would not in-process, where
    the tail is there when the step is planned."""
    sched = make_scheduler(goodput_drafts=True, tail_wait_fraction=0.5)
    sched.goodput_caps = NO_DRAFTS
    req = running(make_request("new", max_tokens=20), sched, output=[1])
    req.tail_in_flight = True
    assert sched.drafts_wanted(req) == 4 and sched.awaiting_tail([req]) == [req]


def test_a_step_without_tails_leaves_the_goodput_cap_alone():
    """A step where no request has a tail yet must not read as 'drafts held back' (the
    verifier would stop waiting for tails and tell drafters to stop running ahead)."""
    sched = make_scheduler(goodput_drafts=True)
    req = running(make_request("a", max_tokens=20), sched, output=[1])
    sched.plan([req])
    assert sched.goodput_caps is None and sched.drafts_wanted(req) == 4


def test_goodput_caps_are_per_request():
    """A request whose drafts match keeps verifying them beside one whose drafts fail (a
    batch-wide cap would hold both back, or verify both), and each drafter is told its own
    request's cap."""
    sched = make_scheduler(goodput_drafts=True)
    for n, t in {2: 0.040, 4: 0.041, 6: 0.042, 10: 0.060}.items():  # bf16-like costs
        sched.observe_forward(n, t)
    good = running(make_request("good", max_tokens=20), sched, output=[1], drafts=[5, 6, 7, 8])
    bad = running(make_request("bad", max_tokens=20), sched, output=[1], drafts=[5, 6, 7, 8])
    for _ in range(10):
        good.acceptance.observe(4, 4)
        bad.acceptance.observe(0, 4)
    plans = sched.plan([good, bad])
    assert [len(p.draft_token_ids) for p in plans] == [4, 0]
    assert sched.drafts_wanted(good) == 4 and sched.drafts_wanted(bad) == 0


def predicting(req: Request, sched: Scheduler, output: list[int], prediction: list[int],
               method: list[int] = ()) -> Request:
    """``req`` running with a prediction and a tail of ``prediction`` drafts (flagged as
    copied from it) followed by ``method`` drafts."""
    req.prediction_token_ids = list(range(50))
    running(req, sched, output)
    n = len(output)
    req.tail.add(n, prediction, req.output_token_ids, base_committed_len=n,
                 from_prediction=True)
    if method:
        req.tail.add(n + len(prediction), list(method), req.output_token_ids,
                     base_committed_len=n)
    return req


def test_a_prediction_run_is_verified_past_kappa_up_to_num_prediction_tokens():
    run = list(range(10, 30))  # 20 prediction drafts
    sched = make_scheduler(num_prediction_tokens=12)
    req = predicting(make_request("a", max_tokens=40, kappa=4), sched, [9], run)
    req.prediction_width = 12
    (plan,) = sched.plan([req])
    assert plan.draft_token_ids == run[:12] and plan.from_prediction == [True] * 12
    assert len(req.block_table) * BLOCK >= req.kv_len + 13  # KV for every planned token
    # never past max_tokens
    short = predicting(make_request("b", max_tokens=8, kappa=4), sched, [9], run)
    short.prediction_width = 12
    (plan,) = sched.plan([short])
    assert plan.draft_token_ids == run[:6]  # 7 tokens left: 6 drafts and the bonus
    # method drafts after the run ride within kappa only
    mixed = predicting(make_request("c", max_tokens=40), sched, [9], run[:2], [7, 7, 7, 7])
    mixed.prediction_width = 12
    (plan,) = sched.plan([mixed])
    assert plan.draft_token_ids == run[:2] + [7, 7] and plan.from_prediction[:2] == [True] * 2
    # 0: prediction drafts get kappa like any other; no prediction: kappa
    off = make_scheduler(num_prediction_tokens=0)
    req = predicting(make_request("d", max_tokens=40), off, [9], run)
    req.prediction_width = 12
    assert len(off.plan([req])[0].draft_token_ids) == 4
    plain = running(make_request("e", max_tokens=40), sched, [9], drafts=run)
    assert len(sched.plan([plain])[0].draft_token_ids) == 4


def test_the_prediction_width_doubles_while_runs_match_and_restarts_at_kappa():
    """Slow start: kappa, doubled after every run accepted whole, up to num_prediction_tokens;
    kappa again after a rejected prediction draft. Neither adaptive_drafts nor goodput_drafts
    cuts it, and the method's accept history is left alone."""
    for goodput in (False, True):
        sched = make_scheduler(goodput_drafts=goodput, num_prediction_tokens=16)
        for n, t in ((1, 0.10), (17, 0.50)):  # a 17-token verify costs 5x a one-token step
            sched.observe_forward(n, t)
        req = predicting(make_request("a", max_tokens=100), sched, [9], list(range(10, 30)))
        for _ in range(6):  # the method's drafts failed: its own cap is down to 1
            sched.observe_accept(req, 0, 4)
        ema, rate = req.accept_len_ema, req.acceptance.rate
        assert sched.num_drafts(req) == 1
        widths = []
        for accepted in (True, True, True, True, False, True):
            (plan,) = sched.plan([req])
            n = len(plan.draft_token_ids)
            assert all(plan.from_prediction)
            widths.append(n)
            sched.observe_accept(req, n if accepted else n // 2, n, num_predicted=n)
        assert widths == [4, 8, 16, 16, 16, 4]
        assert (req.accept_len_ema, req.acceptance.rate) == (ema, rate)


def test_observe_accept_counts_the_method_drafts_after_a_prediction_run():
    sched = make_scheduler()
    req = running(make_request("a", max_tokens=40), sched, [9])
    sched.observe_accept(req, 2, 6, num_predicted=6)  # prediction drafts only: no change
    assert req.acceptance.num_steps == 0 and req.prediction_width == 4  # a rejection: kappa
    sched.observe_accept(req, 1, 6, num_predicted=2)  # the run was cut before the method's
    assert req.acceptance.num_steps == 0
    sched.observe_accept(req, 3, 6, num_predicted=2)  # method: 1 accepted of 4
    assert req.acceptance.num_steps == 1 and req.prediction_width == 8
    assert req.accept_len_ema == pytest.approx(16 + ACCEPT_LEN_EMA_WEIGHT * (1 - 16))


def test_speculation_gate_off_sets_step_kappa_0_and_pauses_the_drafter():
    """Under the goodput policy the gate's off state makes the step kappa 0 (no drafts
    verified or waited for; the drafter told to pause, VerifyCommit.drafting_paused); a
    request with a prediction is not paused; without the goodput caps, or not asked for
    (``speculation_gate``, on by default on the command line), there is no gate."""
    sched = make_scheduler(goodput_drafts=True, speculation_gate=True)
    gate = sched.speculation_gate
    assert gate is not None and gate.on
    req = running(make_request("a", kappa=4), sched, output=[1], drafts=[2, 3, 4])
    pred = running(make_request("p", kappa=4), sched, output=[1])
    pred.prediction_token_ids = [5, 6, 7]
    sched.begin_step([req, pred])
    assert sched.num_drafts(req) == 4 and not sched.drafting_paused(req)
    gate.on = False  # as after it measured drafting as slower at this batch
    sched.begin_step([req, pred])
    assert sched.num_drafts(req) == 0 and sched.current_kappa == 0
    assert sched.drafting_paused(req) and not sched.drafting_paused(pred)
    assert sched.tail_wait_budget_s([req]) == 0.0
    assert [p.draft_token_ids for p in sched.plan([req])] == [[]]
    assert make_scheduler().speculation_gate is None
    assert make_scheduler(goodput_drafts=True).speculation_gate is None  # not asked for
    assert make_scheduler(speculation_gate=True).speculation_gate is None  # no goodput caps
