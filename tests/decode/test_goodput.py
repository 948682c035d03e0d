"""The goodput-aware draft cap (decode/goodput.py): acceptance estimates, the forward-cost
model, and the cap it picks for costs measured on the machines of this project (fp32 on a CPU
without bf16, where a 2-row product costs far more than a one-row one; bf16 where a 5-token
forward costs ~1.07x a one-token one)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specmesh.decode.acceptance import Acceptance, expected_tokens
from specmesh.decode.goodput import PROBE_EVERY, DraftBudget, ForwardCost


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_acceptance_rate_follows_what_the_verifier_saw():
    a = Acceptance()
    assert a.rate == 1.0  # optimistic start
    for _ in range(20):
        a.observe(0, 4)  # every draft rejected
    assert a.rate < 0.05
    for _ in range(20):
        a.observe(4, 4)  # all accepted: no rejection counted
    assert a.rate > 0.95
    b = Acceptance()
    for _ in range(40):
        b.observe(1, 4)  # one of four, then a rejection: a = 1 / 2
    assert b.rate == pytest.approx(0.5, abs=0.01)


@given(st.lists(st.tuples(st.integers(0, 8), st.integers(1, 8)), max_size=30))
def test_acceptance_rate_stays_a_probability(steps):
    a = Acceptance()
    for accepted, drafts in steps:
        a.observe(min(accepted, drafts), drafts)
        assert 0.0 <= a.rate <= 1.0
        gains = [a.gain(j) for j in range(1, 9)]
        assert all(0.0 <= g <= 1.0 for g in gains)
        assert gains == sorted(gains, reverse=True)  # so a cap is a prefix of the drafts
        assert a.expected(3) == pytest.approx(1.0 + sum(gains[:3]))


def test_acceptance_gain_fits_drafts_that_fail_first_or_run_on():
    """Copied drafts fail at the first position or hold: a request whose 5-draft steps
    accept 0 or 5 gets a first-draft rate near the share of steps that held and later drafts
    near 1; one rate for every position credits the first draft with the runs."""
    a = Acceptance()
    for i in range(60):
        a.observe(5 if i % 2 else 0, 5)  # half the steps: all five; half: none
    assert a.gain(1) == pytest.approx(0.5, abs=0.1)
    assert a.gain(5) > 0.45 and a.gain(5) == pytest.approx(a.gain(1), rel=0.02)
    assert a.rate > a.gain(1) + 0.2
    b = Acceptance()
    for _ in range(60):
        b.observe(1, 4)  # the first held, the second failed, every step
    assert b.gain(1) == pytest.approx(1.0) and b.gain(2) < 0.05
    c = Acceptance()
    for _ in range(20):
        c.observe(1, 1)  # only ever one draft verified: later positions keep their prior
    assert c.gain(2) == pytest.approx(1.0)


def test_budget_does_not_confirm_its_own_low_caps():
    """A request verified one draft at a time, its first draft held 70 % of the time: the
    one-rate fit (0.7 at every position) caps it where its later positions were never
    measured; its two rates leave them at the optimistic start, so the budget verifies
    more of its drafts and learns them."""
    a = Acceptance()
    for i in range(50):
        a.observe(1 if i % 10 < 7 else 0, 1)
    one_rate = a.rate
    assert a.gain(1) == pytest.approx(one_rate)  # one draft a step: the same counts
    b = _budget({1: 0.10, 2: 0.13, 5: 0.22})  # 30 ms per further token
    assert b.decide([4], [a]).cap(a, 4) > b.decide([4], [one_rate]).cap(one_rate, 4)


def test_forward_cost_interpolates_and_extends():
    c = ForwardCost()
    assert c.predict(3) is None
    c.observe(1, 0.10)
    assert c.predict(1) == 0.10 and c.predict(5) is None
    c.observe(5, 0.20)
    assert c.predict(3) == pytest.approx(0.15)
    assert c.predict(9) == pytest.approx(0.30)  # the last segment, extended
    c.observe(1, 0.20)  # an EMA, not the last value
    assert 0.10 < c.predict(1) < 0.20


def test_forward_cost_never_predicts_below_its_cheapest_or_falling():
    c = ForwardCost()
    c.observe(4, 0.3)
    c.observe(8, 0.2)  # noise: more tokens measured cheaper
    assert c.predict(12) == pytest.approx(0.2)
    assert c.predict(1) == pytest.approx(0.3)


def _budget(costs: dict[int, float]) -> DraftBudget:
    b = DraftBudget()
    for n, t in costs.items():
        b.observe_forward(n, t)
    return b


FP32_NO_BF16 = {1: 0.146, 2: 0.230, 5: 0.290}  # seconds per forward, batch 1
BF16 = {1: 0.039, 2: 0.040, 5: 0.042}


def test_cap_drops_drafts_that_do_not_pay_for_their_verification():
    # an EAGLE-like acceptance of 0.3 on fp32 without bf16: 1.3 tokens for 1.6x the time
    assert _budget(FP32_NO_BF16).cap([4], [0.3]) == 0
    # the same drafts where a verify costs ~what a plain step does
    assert _budget(BF16).cap([4], [0.3]) > 0
    # drafts that are mostly accepted pay even on fp32
    assert _budget(FP32_NO_BF16).cap([4], [0.9]) == 4


def test_cap_explores_both_ends_before_it_predicts():
    b = DraftBudget()
    assert b.cap([3], [0.1]) == 3  # nothing measured: verify the drafts, learn their cost
    b.observe_forward(4, 0.3)
    assert b.cap([3], [0.1]) == 0  # the plain step's cost is still unknown
    b.observe_forward(1, 0.1)
    assert b.cap([3], [0.1]) == 0  # now measured: 3 drafts at 0.1 do not pay 3x


def test_cap_is_zero_without_drafts_and_probes_while_holding_back():
    b = _budget(FP32_NO_BF16)
    assert b.cap([0, 0], [1.0, 1.0]) == 0
    caps = [b.cap([4], [0.0]) for _ in range(3 * PROBE_EVERY)]
    assert caps.count(1) == 3 and set(caps) == {0, 1}
    # a probe verifies one draft of every request that has some
    probes = [b.decide([4, 2], [0.0, 0.0]) for _ in range(PROBE_EVERY)]
    assert [c.cap(0.0, 4) for c in probes] == [0] * (PROBE_EVERY - 1) + [1]


def test_cap_weighs_the_whole_batch():
    b = _budget({2: 0.10, 4: 0.11, 10: 0.13})
    # one request with good drafts is worth verifying even beside one with none
    assert b.cap([4, 0], [0.9, 0.0]) == 4


def test_caps_take_the_drafts_of_largest_gain_per_request():
    b = _budget({3: 0.040, 5: 0.041, 7: 0.042, 9: 0.043, 15: 0.080})
    caps = b.decide([4, 4, 4], [0.95, 0.6, 0.02])
    # the matching request verifies all its drafts, the middling one its first few, the
    # failing one none: a prefix of each request's drafts
    assert [caps.cap(r, 4) for r in (0.95, 0.6, 0.02)] == [4, 2, 0]
    assert b.cap([4, 4, 4], [0.95, 0.6, 0.02]) == 4
    # a request without a tail this step is told the cap its acceptance earns
    assert caps.cap(0.95, 3) == 3 and caps.cap(0.02, 4) == 0


def test_a_rate_that_slips_after_the_decision_keeps_drafts_that_still_pay():
    """Caps decided at one rate are applied to the next one (what VerifyCommit tells the
    drafter): a rejection that lowers a request's rate a little must not cap it to 0 while
    its first draft still pays for its verification, or no step waits for its tail again."""
    b = _budget({1: 0.0180, 2: 0.0185, 3: 0.0200, 5: 0.0215})
    caps = b.decide([4], [0.3])
    assert caps.cap(0.3, 4) == 1  # one draft pays at 0.3 (the second, 0.09, does not)
    assert caps.cap(0.24, 4) == 1  # after a rejection: still worth its ~8% cost
    assert caps.cap(0.05, 4) == 0  # not worth the extra forward time any more
    # the threshold reproduces the decision at the rates it was made with
    for rates in ([0.95, 0.6, 0.02], [0.5, 0.5], [0.3]):
        for costs in (BF16, FP32_NO_BF16, {3: 0.040, 5: 0.041, 7: 0.042, 9: 0.043, 15: 0.08}):
            d = _budget(costs).decide([4] * len(rates), rates)
            gains = sorted((r ** j for r in rates for j in range(1, 5)), reverse=True)
            taken = sum(d.cap(r, 4) for r in rates)
            assert all(g >= d.min_gain for g in gains[:taken])
            assert all(g < d.min_gain for g in gains[taken:])


def test_drafter_runs_ahead_only_as_far_as_the_verifier_verifies():
    """End to end (in-process cluster): drafts that keep failing shrink the verifier's
    per-request cap, VerifyCommit carries it, and the drafter stops drafting a window of
    2 x kappa per commit (8 here) that the verifier would never check; output unchanged."""
    import torch
    from helpers.models import tiny_llama
    from helpers.proposers import GarbageProposer

    from specmesh.cluster.inprocess import InProcessCluster
    from specmesh.protocol.messages import SamplingParams

    _, model, cfg = tiny_llama(seed=0, dtype=torch.float64, vocab_size=96)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3]]
    outs = []
    garbage = GarbageProposer(96)
    garbage.runs_a_model = True  # a model drafter's run-ahead follows the cap (one that runs
    # none keeps its whole window: tests/drafter/test_drafter_worker.py)
    for k, proposer in ((0, None), (4, garbage)):
        c = InProcessCluster(model, cfg, num_speculative_tokens=k, num_kv_blocks=64,
                             block_size=4, proposer=proposer, goodput_drafts=True)
        outs.append([o.token_ids for o in c.generate(prompts, SamplingParams(max_tokens=24))])
    st = c.drafter.stats
    assert outs[0] == outs[1]
    assert c.verifier.stats.num_draft_tokens > 0
    assert st.num_commits > 20 and st.num_draft_tokens_sent < 3.5 * st.num_commits


def test_step_overhead_dilutes_what_drafts_cost():
    """A step's seconds besides its forward (commit, sends, the rule) are paid with or
    without drafts: counted in, a draft that did not pay against the forward alone does."""
    b = _budget({1: 0.010, 2: 0.016})
    assert b.overhead(1) == 0.0 and b.cap([1], [0.5]) == 0  # 1.5 / 16 ms < 1 / 10 ms
    b.observe_overhead(1, 0.008)
    assert b.seconds(1, 1) == pytest.approx(0.024)
    assert b.cap([1], [0.5]) == 1  # 1.5 / 24 ms > 1 / 18 ms
    b.observe_overhead(4, 0.002)  # other batch sizes: the nearest measured one
    assert b.overhead(3) == pytest.approx(0.002) and b.overhead(2) == pytest.approx(0.008)
    b.observe_overhead(1, -1.0)  # a negative reading (clock) is ignored
    assert b.overhead(1) == pytest.approx(0.008)
