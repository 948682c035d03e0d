"""Tests of kernels/synthetic_accept.py: the reference against a python-loop oracle and hand
cases, the per-position acceptance it produces (binomial bounds), the Triton kernel under the
interpreter (a subprocess) equal to the reference on odd shapes, and on CUDA."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from specmesh.kernels.constants import PLACEHOLDER_TOKEN_ID
from specmesh.kernels.synthetic_accept import synthetic_accept, synthetic_accept_ref

PH = PLACEHOLDER_TOKEN_ID


def _t(values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def _cumsum(counts: list[int]) -> list[int]:
    out, total = [], 0
    for k in counts:
        total += k
        out.append(total)
    return out


def oracle(drafts, counts, targets, uniform, rates, width=None):
    width = (max(counts, default=0) if width is None else width) + 1
    rows, accepts, d, t = [], [], 0, 0
    for k in counts:
        a = 0
        while a < k and uniform[d + a] < rates[min(a, len(rates) - 1)]:
            a += 1
        row = drafts[d:d + a] + [targets[t + a]]
        rows.append(row + [PH] * (width - len(row)))
        accepts.append(a)
        d, t = d + k, t + k + 1
    return rows, accepts


def make_case(counts, vocab, rng, num_rates=3):
    n = sum(counts)
    drafts = [rng.randrange(vocab) for _ in range(n)]
    targets = [rng.randrange(vocab) for _ in range(n + len(counts))]
    uniform = [rng.random() for _ in range(n)]
    rates = [rng.choice([0.0, 1.0, rng.random()]) for _ in range(num_rates)]
    return drafts, counts, targets, uniform, rates


def _args(drafts, counts, targets, uniform, rates, cu_dtype=torch.int64, fdtype=torch.float64):
    return (_t(drafts), _t(_cumsum(counts), cu_dtype), _t(targets), _t(uniform, fdtype),
            _t(rates, fdtype))


def test_hand_cases():
    # rates 1 then 0: exactly one draft passes; the extra token is the target row after it
    out, acc = synthetic_accept_ref(*_args([5, 6, 7, 8], [3, 0, 1], [50, 51, 52, 53, 60, 70, 71],
                                           [0.5, 0.5, 0.5, 0.1], [1.0, 0.0]))
    assert acc.tolist() == [1, 0, 1]
    assert out.tolist() == [[5, 51, PH, PH], [60, PH, PH, PH], [8, 71, PH, PH]]
    # the last rate repeats past the curve
    out, acc = synthetic_accept_ref(*_args([1, 2, 3, 4], [4], [9] * 5, [0.3, 0.3, 0.3, 0.6],
                                           [0.5]))
    assert acc.tolist() == [3] and out.tolist() == [[1, 2, 3, 9, PH]]
    # empty batch
    out, acc = synthetic_accept_ref(*_args([], [], [], [], [0.5]))
    assert out.shape == (0, 1) and acc.shape == (0,)


def test_reference_matches_oracle():
    rng = random.Random(3)
    for _ in range(50):
        counts = [rng.randrange(0, 7) for _ in range(rng.randrange(1, 9))]
        case = make_case(counts, 1271, rng, num_rates=rng.randrange(1, 6))
        out, acc = synthetic_accept_ref(*_args(*case))
        rows, accepts = oracle(*case)
        assert out.tolist() == rows and acc.tolist() == accepts


@pytest.mark.parametrize("bad", ["rate", "uniform", "rates-empty", "shape", "dtype"])
def test_bad_inputs_raise(bad):
    args = list(_args([1, 2], [2], [3, 4, 5], [0.1, 0.2], [0.5]))
    if bad == "rate":
        args[4] = _t([1.5], torch.float64)
    elif bad == "uniform":
        args[3] = _t([0.1, 1.0], torch.float64)
    elif bad == "rates-empty":
        args[4] = _t([], torch.float64)
    elif bad == "shape":
        args[3] = _t([0.1], torch.float64)
    else:
        args[0] = args[0].to(torch.int32)
    with pytest.raises(ValueError):
        synthetic_accept_ref(*args)


def test_per_position_acceptance_follows_the_conditional_rates():
    """Over many requests the share reaching position ``j`` is ``prod(rates[:j + 1])``, within
    4.5 binomial standard deviations."""
    gen = torch.Generator().manual_seed(0)
    batch, k = 20000, 5
    rates = torch.tensor([0.9, 0.7, 0.5], dtype=torch.float64)
    cu = torch.arange(1, batch + 1, dtype=torch.int64) * k
    drafts = torch.zeros(batch * k, dtype=torch.int64)
    targets = torch.zeros(batch * (k + 1), dtype=torch.int64)
    uniform = torch.rand(batch * k, dtype=torch.float64, generator=gen)
    _, acc = synthetic_accept(drafts, cu, targets, uniform, rates)
    survive = 1.0
    for j in range(k):
        survive *= float(rates[min(j, 2)])
        got = int((acc >= j + 1).sum())
        sd = math.sqrt(batch * survive * (1 - survive))
        assert abs(got - batch * survive) <= 4.5 * sd + 1, (j, got, batch * survive)


# -- Triton kernel under the interpreter ---------------------------------------------------------

MOD = "specmesh.kernels.synthetic_accept."


def _interpret_cases() -> dict[str, dict[str, Any]]:
    rng = random.Random(1271)
    cases: dict[str, dict[str, Any]] = {}

    def add(name, counts, vocab=1271, num_rates=3, fdtype=torch.float64, cu_dtype=torch.int64,
            launcher=False, max_num=None):
        case = make_case(counts, vocab, rng, num_rates)
        cases[name] = {"func": MOD + ("synthetic_accept" if launcher
                                      else "synthetic_accept_triton"),
                       "args": list(_args(*case, cu_dtype=cu_dtype, fdtype=fdtype)),
                       "kwargs": {"max_num_draft_tokens": max_num},
                       "disable": [MOD + "synthetic_accept_ref"] if launcher else []}

    for seed in range(4):
        counts = [rng.randrange(0, 6) for _ in range(7)]
        counts[rng.randrange(7)] = 5
        add(f"batch7-seed{seed}", counts, num_rates=1 + seed)
    add("batch7-int32-float32", [5, 0, 3, 1, 0, 4, 2], cu_dtype=torch.int32,
        fdtype=torch.float32)
    add("v49152", [3, 0, 5, 1, 6], vocab=49152)
    add("wide-block", [17, 3, 0, 16], num_rates=20, max_num=19)
    add("all-zero-drafts", [0, 0, 0])
    add("launcher", [2, 4, 0], launcher=True)
    return cases


INTERPRET_CASES = _interpret_cases()


@pytest.fixture(scope="module")
def interpreted_results(run_interpreted: Any) -> dict[str, dict]:
    cases = [dict(c) for c in INTERPRET_CASES.values()]
    cases.append({"func": MOD + "_kernel_is_interpreted", "args": []})
    results = run_interpreted(cases)
    return dict(zip([*INTERPRET_CASES, "is-interpreted"], results, strict=True))


@pytest.mark.parametrize("name", INTERPRET_CASES)
def test_interpreted_kernel_matches_reference(name: str, interpreted_results: dict) -> None:
    result = interpreted_results[name]
    assert "ok" in result, result.get("error")
    out, accept = result["ok"]
    case = INTERPRET_CASES[name]
    ref_out, ref_accept = synthetic_accept_ref(*case["args"], **case["kwargs"])
    assert torch.equal(out, ref_out) and torch.equal(accept, ref_accept)


def test_interpreted_worker_really_interprets(interpreted_results: dict) -> None:
    assert interpreted_results["is-interpreted"] == {"ok": [True]}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernel_matches_reference() -> None:
    rng = random.Random(7)
    for batch, max_drafts in [(1, 1), (7, 5), (64, 8), (256, 16), (3, 0)]:
        counts = [rng.randrange(0, max_drafts + 1) for _ in range(batch)]
        args = _args(*make_case(counts, 49152, rng, num_rates=4))
        ref_out, ref_accept = synthetic_accept_ref(*args)
        out, accept = synthetic_accept(*[a.cuda() for a in args])
        assert torch.equal(out.cpu(), ref_out) and torch.equal(accept.cpu(), ref_accept)
