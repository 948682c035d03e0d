"""The speedup model of ``specmesh plan`` (decode/speedup_model.py) reproduces the figures of
the speculative decoding chapter (/work/shared/reference/speculative_decoding_zoo.txt, 'Parallel
drafting' and 'Two honesty checks'): c = 0.165, kappa = 3, alpha = 0.70, T* = 295."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specmesh.decode.acceptance import expected_tokens
from specmesh.decode.speedup_model import (
    asymptotic_speedup,
    break_even_batch,
    break_even_linear,
    conditional_acceptance,
    fitted_alpha,
    plan,
    round_cost,
    speedup,
    tie_acceptance,
    tokens_per_round,
    tokens_per_round_positions,
)

C, KAPPA, ALPHA, T_STAR = 0.165, 3, 0.70, 295


def test_the_chapters_figures():
    assert tokens_per_round(ALPHA, KAPPA) == pytest.approx(2.533, abs=5e-4)
    assert round_cost(KAPPA, C, "chain") == pytest.approx(1.495)
    assert round_cost(KAPPA, C, "parallel") == pytest.approx(1.165)
    assert speedup(ALPHA, KAPPA, C, "chain") == pytest.approx(1.69, abs=5e-3)
    assert speedup(ALPHA, KAPPA, C, "parallel") == pytest.approx(2.17, abs=5e-3)
    # half the chain's acceptance: 1.515375 / 1.165
    assert speedup(0.35, KAPPA, C, "parallel") == pytest.approx(1.301, abs=5e-4)
    parallel_cost = round_cost(KAPPA, C, "parallel")
    assert tie_acceptance(1.0, KAPPA, parallel_cost) == pytest.approx(0.142, abs=5e-4)
    chain = speedup(ALPHA, KAPPA, C, "chain")
    tie = tie_acceptance(chain, KAPPA, parallel_cost)
    # the chapter prints ~0.536 and its own bisection asserts 0.53 < alpha < 0.54; the root
    # of E(alpha, 3) / 1.165 = 2.533 / 1.495 is 0.5348
    assert 0.53 < tie < 0.54 and tie == pytest.approx(0.536, abs=2e-3)
    assert tokens_per_round(tie, KAPPA) / parallel_cost == pytest.approx(chain, abs=1e-12)
    assert break_even_batch(ALPHA, KAPPA, C, T_STAR, "chain") == pytest.approx(150, abs=1)
    assert break_even_batch(ALPHA, KAPPA, C, T_STAR, "parallel") == pytest.approx(175, abs=1)
    assert asymptotic_speedup(ALPHA, KAPPA, C, "parallel") == pytest.approx(0.61, abs=5e-3)
    assert asymptotic_speedup(ALPHA, KAPPA, C, "chain") < 0.61


def test_plan_report_carries_every_figure():
    report = plan(ALPHA, KAPPA, C, T_STAR, parallel_alpha=0.35)
    rows = {r["drafting"]: r for r in report["rows"]}
    assert rows["chain"]["speedup"] == pytest.approx(1.694, abs=1e-3)
    assert rows["parallel"]["speedup"] == pytest.approx(1.301, abs=1e-3)
    assert rows["decoupled"]["speedup"] == pytest.approx(2.533, abs=1e-3)  # E / max(kc, 1)
    assert report["parallel_ties_no_speculation_alpha"] == pytest.approx(0.142, abs=5e-4)
    assert report["parallel_ties_chain_alpha"] == pytest.approx(0.5348, abs=5e-4)


def test_break_even_is_where_the_batch_speedup_crosses_one():
    """The closed form agrees with the roofline model it comes from: S(B) = 1 there, above 1
    below it, and S(B) falls to S_inf past the knee."""
    for drafting in ("chain", "parallel", "decoupled"):
        b = break_even_batch(ALPHA, KAPPA, C, T_STAR, drafting)
        assert speedup(ALPHA, KAPPA, C, drafting, b, T_STAR) == pytest.approx(1.0)
        assert speedup(ALPHA, KAPPA, C, drafting, b * 0.9, T_STAR) > 1.0
        assert speedup(ALPHA, KAPPA, C, drafting, b * 1.1, T_STAR) < 1.0
        far = speedup(ALPHA, KAPPA, C, drafting, 100 * T_STAR, T_STAR)
        assert far == pytest.approx(asymptotic_speedup(ALPHA, KAPPA, C, drafting))
    # speculation that does not pay at batch 1 has no break-even batch
    assert break_even_batch(0.05, KAPPA, C, T_STAR, "chain") == 0.0
    assert break_even_batch(0.9, 3, 2.0, T_STAR, "decoupled") == 0.0  # drafter too slow


def test_break_even_under_a_linear_cost():
    """t(N) = 10 + N (ms): at the break-even batch plain decode and speculation commit tokens
    at the same rate."""
    e, kappa, extra = 2.5, 3, 1.0
    b = break_even_linear(e, kappa, 10.0, 1.0, extra)
    assert b == pytest.approx((10 * 1.5 - 1) / (1 * 1.5))
    plain_rate = b / (10 + b)
    spec_rate = b * e / (10 + b * (kappa + 1) + extra)
    assert spec_rate == pytest.approx(plain_rate)
    assert break_even_linear(1.05, kappa, 10.0, 1.0, extra=1.0) == 0.0  # never pays
    assert break_even_linear(4.0, kappa, 10.0, 1.0) is None  # every draft accepted


@given(st.floats(0.0, 1.0), st.integers(0, 12))
def test_closed_form_is_the_geometric_sum(alpha, kappa):
    assert tokens_per_round(alpha, kappa) == pytest.approx(expected_tokens(alpha, kappa))
    assert asymptotic_speedup(alpha, kappa, 0.0, "parallel") <= 1.0 + 1e-12


def test_measured_positions():
    shares = [0.7, 0.49, 0.343]  # geometric at 0.7
    assert tokens_per_round_positions(shares) == pytest.approx(2.533)
    assert conditional_acceptance(shares) == pytest.approx([0.7, 0.7, 0.7])
    assert fitted_alpha(shares) == pytest.approx(0.7, abs=1e-9)
    assert conditional_acceptance([0.5, 0.0, 0.0]) == [0.5, 0.0, 0.0]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="alpha"):
        tokens_per_round(1.5, 3)
    with pytest.raises(ValueError, match="drafting"):
        round_cost(3, C, "tree")
    with pytest.raises(ValueError, match="t_star"):
        break_even_batch(ALPHA, KAPPA, C, 0)
    assert tie_acceptance(10.0, KAPPA, 1.0) is None  # more than kappa + 1 tokens a round
