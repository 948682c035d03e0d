"""Tests of kernels/rejection_sample.py: the torch reference against hand cases and a per-request
oracle, its output distribution (chi-square, one-hot and full draft probs, ragged batches), the
Triton kernel (interpreted, in a subprocess) against the reference exactly, and on CUDA."""

from __future__ import annotations

import importlib
import random
from typing import Any

import pytest
import torch
from _chi2 import chi2_pvalue, chi2_sf

from specmesh.kernels.constants import PLACEHOLDER_TOKEN_ID
from specmesh.kernels.rejection_sample import (
    _kernel_is_interpreted,
    rejection_sample,
    rejection_sample_noise,
    rejection_sample_ref,
)

rs = importlib.import_module("specmesh.kernels.rejection_sample")
PH = PLACEHOLDER_TOKEN_ID
MOD = "specmesh.kernels.rejection_sample."
P_MIN = 1e-3


def _t(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def _cumsum(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0)


def oracle(drafts: torch.Tensor, counts: list[int], draft_probs: torch.Tensor | None,
           target_probs: torch.Tensor, uniform: torch.Tensor, noise: torch.Tensor,
           width: int | None = None) -> tuple[list[list[int]], list[int]]:
    """The rule, request by request and draft by draft (row ops in torch, so the rounding is
    the reference's)."""
    width = (max(counts, default=0) if width is None else width) + 1
    rows, accepts = [], []
    d = 0
    for b, k in enumerate(counts):
        out: list[int] = []
        a = 0
        while a < k:
            i, tok = d + a, int(drafts[d + a])
            target = float(target_probs[d + b + a, tok])
            draft = 1.0 if draft_probs is None else float(draft_probs[i, tok])
            if not float(uniform[i]) * draft < target:
                break
            out.append(tok)
            a += 1
        target_row = target_probs[d + b + a]
        if a < k:
            if draft_probs is None:
                residual = target_row.clone()
                residual[int(drafts[d + a])] = 0
            else:
                residual = (target_row - draft_probs[d + a]).clamp(min=0)
        else:
            residual = target_row
        scores = residual / noise[b]
        if float(scores.max()) == 0:
            scores = target_row / noise[b]
        out.append(int(scores.argmax()))
        rows.append(out + [PH] * (width - len(out)))
        accepts.append(a)
        d += k
    return rows, accepts


def make_case(counts: list[int], vocab: int, full: bool, gen: torch.Generator,
              dtype: torch.dtype = torch.float32, sharp: float = 1.0,
              draft_from_target: float = 0.0) -> dict[str, Any]:
    """Random distributions (softmax of ``sharp * randn``); drafts sampled from the draft rows
    (full) or from a random row (one-hot); ``draft_from_target`` mixes the target into the
    draft rows to raise acceptance."""
    total, batch = sum(counts), len(counts)
    target = torch.softmax(sharp * torch.randn(total + batch, vocab, generator=gen,
                                               dtype=torch.float64), dim=-1)
    own = torch.softmax(sharp * torch.randn(total, vocab, generator=gen, dtype=torch.float64),
                        dim=-1)
    # target row of each draft: row (draft index + request index)
    req = torch.repeat_interleave(torch.arange(batch), torch.tensor(counts, dtype=torch.int64))
    draft = (1 - draft_from_target) * own + draft_from_target * target[torch.arange(total) + req]
    drafts = (torch.multinomial(draft, 1, generator=gen)[:, 0] if total
              else torch.zeros(0, dtype=torch.int64))
    cu = _cumsum(counts)
    uniform, noise = rejection_sample_noise(cu, vocab, dtype, gen)
    return {"args": [drafts, cu, draft.to(dtype) if full else None, target.to(dtype), uniform,
                     noise], "counts": counts}


# --------------------------------------------------------------------------------------------
# Reference: hand cases, oracle
# --------------------------------------------------------------------------------------------


def _onehot_rows(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).to(torch.float32)


def test_greedy_target_and_one_hot_drafts_is_greedy_verification() -> None:
    # target one-hot rows (temperature 0): accept iff draft == target argmax
    vocab = 7
    drafts, counts = [3, 4, 5, 1, 2], [3, 0, 2]
    target_tokens = [3, 4, 6, 0, 2, 1, 2, 6]  # rows: [3,4,6,0] [2] [1,2,6]
    target = _onehot_rows(target_tokens, vocab)
    uniform = torch.full((5,), 0.999, dtype=torch.float64)
    noise = torch.rand(3, vocab) + 0.1
    for draft_probs in (None, _onehot_rows(drafts, vocab)):
        out, accept = rejection_sample_ref(_t(drafts), _cumsum(counts), draft_probs, target,
                                           uniform, noise)
        assert out.tolist() == [[3, 4, 6, PH], [2, PH, PH, PH], [1, 2, 6, PH]]
        assert accept.tolist() == [2, 0, 2]


def test_acceptance_threshold_is_u_times_draft_below_target() -> None:
    target = torch.tensor([[0.5, 0.5], [0.25, 0.75]])
    draft = torch.tensor([[0.25, 0.75]])  # draft token 1: ratio 0.5/0.75 = 2/3
    noise = torch.ones(1, 2)
    for u, accepted in ((0.66, True), (0.67, False), (0.0, True)):
        out, accept = rejection_sample_ref(_t([1]), _t([1]), draft, target,
                                           torch.tensor([u], dtype=torch.float64), noise)
        assert accept.tolist() == [int(accepted)]
        if accepted:
            assert out.tolist() == [[1, 1]]  # bonus: argmax(target[1] / 1)
        else:
            # residual max(target - draft, 0) = [0.25, 0]: token 0
            assert out.tolist() == [[0, PH]]


def test_zero_target_probability_is_always_rejected() -> None:
    target = torch.tensor([[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    noise = torch.rand(1, 3, generator=torch.Generator().manual_seed(0)) + 0.01
    out, accept = rejection_sample_ref(_t([0]), _t([1]), None, target,
                                       torch.zeros(1, dtype=torch.float64), noise)
    assert accept.tolist() == [0] and out[0, 0].item() in (1, 2)


def test_vanished_residual_falls_back_to_the_target_row() -> None:
    # draft dominates the target everywhere (unnormalized rows): the residual is all zero
    target = torch.tensor([[0.1, 0.2, 0.1], [0.3, 0.3, 0.4]])
    draft = torch.tensor([[0.5, 0.3, 0.2]])
    noise = torch.tensor([[1.0, 0.5, 2.0]])  # target scores 0.1, 0.4, 0.05 -> token 1
    out, accept = rejection_sample_ref(_t([0]), _t([1]), draft, target,
                                       torch.tensor([0.9], dtype=torch.float64), noise)
    assert accept.tolist() == [0] and out.tolist() == [[1, PH]]


def test_ties_take_the_first_index() -> None:
    target = torch.full((1, 5), 0.2)
    out, _ = rejection_sample_ref(_t([]), _t([0]), None, target, torch.zeros(0), torch.ones(1, 5))
    assert out.tolist() == [[0]]


def test_explicit_width_empty_batch_zero_drafts() -> None:
    gen = torch.Generator().manual_seed(1)
    case = make_case([0, 0], 5, False, gen)
    out, accept = rejection_sample_ref(*case["args"], max_num_draft_tokens=2)
    assert out.shape == (2, 3) and (out[:, 1:] == PH).all() and accept.tolist() == [0, 0]
    out, accept = rejection_sample_ref(_t([]), _t([]), None, torch.zeros(0, 5), torch.zeros(0),
                                       torch.ones(0, 5))
    assert out.shape == (0, 1) and accept.shape == (0,)


@pytest.mark.parametrize("full", [False, True], ids=["one-hot", "full"])
def test_reference_matches_oracle_on_random_batches(full: bool) -> None:
    gen = torch.Generator().manual_seed(5 + full)
    rng = random.Random(5)
    for trial in range(60):
        counts = [rng.randrange(0, 6) for _ in range(rng.randrange(1, 9))]
        dtype = torch.float64 if trial % 3 == 0 else torch.float32
        case = make_case(counts, rng.choice([2, 3, 17, 301]), full, gen, dtype,
                         sharp=rng.choice([0.5, 2.0, 6.0]),
                         draft_from_target=rng.choice([0.0, 0.7, 0.95]))
        width = rng.choice([None, max(counts) + 2])
        out, accept = rejection_sample_ref(*case["args"], max_num_draft_tokens=width)
        rows, accepts = oracle(case["args"][0], counts, *case["args"][2:], width=width)
        assert out.tolist() == rows and accept.tolist() == accepts


def test_launcher_on_cpu_runs_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the kernel must not run on CPU without TRITON_INTERPRET")

    monkeypatch.setattr(rs, "rejection_sample_triton", fail)
    case = make_case([3, 0, 2], 11, True, torch.Generator().manual_seed(2))
    out, accept = rs.rejection_sample(*case["args"])
    ref_out, ref_accept = rejection_sample_ref(*case["args"])
    assert torch.equal(out, ref_out) and torch.equal(accept, ref_accept)


@pytest.mark.skipif(_kernel_is_interpreted(), reason="this session already interprets Triton")
def test_interpret_set_after_import_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case([1], 4, False, torch.Generator().manual_seed(3))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="before"):
        rejection_sample(*case["args"])
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA"):
        rs.rejection_sample_triton(*case["args"])


def _bad_inputs() -> dict[str, list[Any]]:
    gen = torch.Generator().manual_seed(4)
    base = make_case([2, 1], 5, True, gen)["args"]  # drafts, cu, draft_probs, target, u, noise
    bad: dict[str, list[Any]] = {}

    def add(name: str, index: int, value: Any) -> None:
        args = list(base)
        args[index] = value
        bad[name] = args

    add("drafts-int32", 0, base[0].to(torch.int32))
    add("drafts-out-of-vocab", 0, torch.tensor([1, 5, 2]))
    add("drafts-negative", 0, torch.tensor([1, -1, 2]))
    add("cu-float", 1, base[1].float())
    add("cu-not-ending-at-total", 1, _t([2, 2]))
    add("cu-decreasing", 1, _t([3, 2]))
    add("draft-probs-shape", 2, base[2][:2])
    add("draft-probs-dtype", 2, base[2].double())
    add("target-rows", 3, base[3][:4])
    add("target-int", 3, base[3].to(torch.int64))
    add("target-half", 3, base[3].half())
    add("uniform-length", 4, base[4][:2])
    add("uniform-one", 4, torch.tensor([0.1, 1.0, 0.2], dtype=torch.float64))
    add("uniform-negative", 4, torch.tensor([0.1, -0.1, 0.2], dtype=torch.float64))
    add("noise-zero", 5, torch.cat([torch.zeros(1, 5), base[5][1:]]))
    add("noise-inf", 5, torch.cat([torch.full((1, 5), float("inf")), base[5][1:]]))
    add("noise-shape", 5, base[5][:1])
    add("noise-dtype", 5, base[5].double())
    add("not-a-tensor", 0, [1, 2, 3])
    bad["empty-vocab"] = [base[0][:0], _t([0]), None, torch.zeros(1, 0), torch.zeros(0),
                          torch.zeros(1, 0)]
    bad["drafts-for-empty-batch"] = [base[0], _t([]), None, base[3][:3], base[4], base[5][:0]]
    bad["max-too-small"] = [*base, 1]
    bad["max-negative"] = [*base, -1]
    return bad


BAD_INPUTS = _bad_inputs()


@pytest.mark.parametrize("args", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_inputs_raise_value_error(args: list[Any]) -> None:
    for fn in (rejection_sample_ref, rejection_sample):
        with pytest.raises(ValueError):
            fn(*args)


# --------------------------------------------------------------------------------------------
# Reference: output distribution (chi-square, >= 20,000 samples per tested distribution)
# --------------------------------------------------------------------------------------------


def test_chi2_sf_known_values() -> None:
    for stat, dof, p in ((3.841458820694124, 1, 0.05), (11.070497693516351, 5, 0.05),
                         (23.209251158954356, 10, 0.01), (0.0, 3, 1.0),
                         (149.44925277903875, 100, 0.001)):
        assert chi2_sf(stat, dof) == pytest.approx(p, rel=1e-6, abs=1e-12)
    assert chi2_pvalue([5000, 5000], [0.5, 0.5]) == pytest.approx(1.0)
    assert chi2_pvalue([6000, 4000], [0.5, 0.5]) < 1e-10


VOCAB = 6
K = 3
# fixed target rows (position 0..K, the last the bonus position) and draft rows (0..K-1)
TARGET_ROWS = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
                            [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],
                            [0.50, 0.00, 0.10, 0.10, 0.10, 0.20],
                            [0.10, 0.40, 0.05, 0.05, 0.20, 0.20]], dtype=torch.float64)
DRAFT_ROWS = torch.tensor([[0.10, 0.10, 0.30, 0.10, 0.20, 0.20],
                           [0.20, 0.20, 0.20, 0.10, 0.10, 0.20],
                           [0.30, 0.30, 0.00, 0.10, 0.20, 0.10]], dtype=torch.float64)


def _sample_ragged(counts: list[int], full: bool, seed: int, fixed_drafts: bool = False,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the reference once on a batch of many requests with the fixed rows."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(counts)
    cu = _cumsum(counts)
    # row j of each request: TARGET_ROWS[j] for j < k, TARGET_ROWS[K] at the bonus position
    target_idx = torch.cat([torch.tensor(list(range(k)) + [K]) for k in counts])
    draft_idx = torch.cat([torch.arange(k) for k in counts])
    draft_rows = DRAFT_ROWS[draft_idx]
    if fixed_drafts:  # an n-gram style proposer: a fixed token per position
        drafts = torch.tensor([2, 5, 1])[draft_idx]
    else:
        drafts = torch.multinomial(draft_rows, 1, replacement=True, generator=gen)[:, 0]
    uniform, noise = rejection_sample_noise(cu, VOCAB, dtype, gen)
    out, accept = rejection_sample_ref(drafts, cu, draft_rows.to(dtype) if full else None,
                                       TARGET_ROWS[target_idx].to(dtype), uniform, noise,
                                       max_num_draft_tokens=K)
    assert out.shape == (batch, K + 1)
    return out, accept


def _check_target_distribution(out: torch.Tensor, accept: torch.Tensor, counts: list[int],
                               k: int) -> None:
    """Among requests with ``k`` drafts, output position ``j`` (emitted when accept_len >= j)
    follows target row ``j`` (the bonus row K at j == k)."""
    rows = torch.tensor(counts) == k
    sub_out, sub_accept = out[rows], accept[rows]
    for j in range(k + 1):
        emitted = sub_accept >= j
        tokens = sub_out[emitted, j]
        assert (tokens >= 0).all()
        counts_j = torch.bincount(tokens, minlength=VOCAB).tolist()
        expected = TARGET_ROWS[j if j < k else K].tolist()
        n = int(emitted.sum())
        p = chi2_pvalue(counts_j, expected)
        assert p > P_MIN, (k, j, n, counts_j, expected, p)


def _acceptance_probs(full: bool, fixed_drafts: bool) -> list[float]:
    """P(draft j accepted) per position: sum_x min(target, draft) for sampled drafts with their
    probabilities; sum_x draft(x) target(x) for one-hot treatment of sampled drafts; the
    target probability of the fixed token for fixed drafts."""
    if fixed_drafts:
        return [float(TARGET_ROWS[j, t]) for j, t in enumerate([2, 5, 1])]
    if full:
        return [float(torch.minimum(TARGET_ROWS[j], DRAFT_ROWS[j]).sum()) for j in range(K)]
    return [float((TARGET_ROWS[j] * DRAFT_ROWS[j]).sum()) for j in range(K)]


@pytest.mark.parametrize("mode", ["full", "one-hot", "one-hot-fixed-drafts", "full-float64"])
def test_emitted_tokens_follow_the_target(mode: str) -> None:
    full = mode.startswith("full")
    fixed = mode == "one-hot-fixed-drafts"
    dtype = torch.float64 if mode.endswith("float64") else torch.float32
    n = 24_000
    counts = [K] * n
    out, accept = _sample_ragged(counts, full, seed=11, fixed_drafts=fixed, dtype=dtype)
    _check_target_distribution(out, accept, counts, K)
    # accept_len distribution: P(a) = prod_{j<a} beta_j * (1 - beta_a), beta_K = 0
    beta = _acceptance_probs(full, fixed) + [0.0]
    probs, run = [], 1.0
    for a in range(K + 1):
        probs.append(run * (1 - beta[a]))
        run *= beta[a]
    p = chi2_pvalue(torch.bincount(accept, minlength=K + 1).tolist(), probs)
    assert p > P_MIN, (torch.bincount(accept).tolist(), probs)
    # drafts before accept_len are emitted as is; padding after the extra token
    width = torch.arange(K + 1)[None, :]
    assert ((out == PH) == (width > accept[:, None])).all()


@pytest.mark.parametrize("full", [False, True], ids=["one-hot", "full"])
def test_ragged_batch_follows_the_target(full: bool) -> None:
    n = 20_000
    counts = [0, 1, 2, 3] * n  # 20,000 requests of each draft count, interleaved
    out, accept = _sample_ragged(counts, full, seed=12 + full)
    for k in range(K + 1):
        _check_target_distribution(out, accept, counts, k)
    assert (accept <= torch.tensor(counts)).all()


def test_full_draft_probs_accept_more_than_one_hot_on_sampled_drafts() -> None:
    beta_full, beta_one_hot = _acceptance_probs(True, False), _acceptance_probs(False, False)
    assert all(f > o for f, o in zip(beta_full, beta_one_hot))
    counts = [K] * 20_000
    _, acc_full = _sample_ragged(counts, True, seed=21)
    _, acc_one_hot = _sample_ragged(counts, False, seed=21)
    assert acc_full.double().mean() > acc_one_hot.double().mean()


# --------------------------------------------------------------------------------------------
# Triton kernel under the interpreter (one subprocess for every case)
# --------------------------------------------------------------------------------------------


def _interpret_cases() -> dict[str, dict[str, Any]]:
    gen = torch.Generator().manual_seed(1271)
    rng = random.Random(1271)
    cases: dict[str, dict[str, Any]] = {}

    def add(name: str, counts: list[int], vocab: int, full: bool, max_num: int | None = None,
            cu_dtype: torch.dtype = torch.int64, launcher: bool = False,
            dtype: torch.dtype = torch.float32, **kw: Any) -> None:
        case = make_case(counts, vocab, full, gen, dtype, **kw)
        case["args"][1] = case["args"][1].to(cu_dtype)
        cases[name] = {
            "func": MOD + ("rejection_sample" if launcher else "rejection_sample_triton"),
            "args": case["args"], "kwargs": {"max_num_draft_tokens": max_num},
            "disable": [MOD + "rejection_sample_ref"] if launcher else [],
        }

    for seed in range(6):
        counts = [rng.randrange(0, 6) for _ in range(7)]
        counts[rng.randrange(7)] = 5
        counts[rng.randrange(7)] = 0
        mix = [0.0, 0.6, 0.9][seed % 3]
        add(f"batch7-v1000-seed{seed}-full", counts, 1000, True, draft_from_target=mix,
            sharp=3.0)
        add(f"batch7-v1000-seed{seed}-one-hot", counts, 1000, False, sharp=6.0)
    add("v49152-full", [3, 0, 5, 1], 49152, True, draft_from_target=0.8, sharp=4.0)
    add("v49152-one-hot", [2, 4, 0], 49152, False, sharp=8.0)
    add("v49152-float64-full", [2, 3], 49152, True, dtype=torch.float64, draft_from_target=0.5)
    add("v4099-odd-chunks", [1, 2, 3], 4099, True, draft_from_target=0.7)
    add("v3-tiny-vocab", [5, 5, 0, 2, 1], 3, True)
    add("v1-single-token", [2, 0], 1, False)
    add("int32-cu-explicit-max", [5, 0, 3, 1], 257, False, max_num=8, cu_dtype=torch.int32)
    add("float64-one-hot", [4, 2, 0, 3], 97, False, dtype=torch.float64)
    add("all-zero-drafts", [0, 0, 0, 0, 0], 333, True)
    add("wide-block", [17, 3, 0, 16], 5, True, draft_from_target=0.98)
    add("launcher-full", [5, 0, 3, 1, 0, 4, 2], 500, True, launcher=True, draft_from_target=0.8)
    add("launcher-one-hot", [2, 2], 500, False, launcher=True)

    # hand-made: vanished residual (fallback to the target row), ties in the scores
    target = torch.tensor([[0.1, 0.2, 0.1], [0.3, 0.3, 0.4]])
    cases["residual-fallback"] = {
        "func": MOD + "rejection_sample_triton",
        "args": [_t([0]), _t([1]), torch.tensor([[0.5, 0.3, 0.2]]), target,
                 torch.tensor([0.9], dtype=torch.float64), torch.tensor([[1.0, 0.5, 2.0]])],
        "kwargs": {}, "disable": []}
    ties_vocab = 9000  # ties across vocabulary chunks: the first index must win
    cases["ties-across-chunks"] = {
        "func": MOD + "rejection_sample_triton",
        "args": [_t([]), _t([0, 0]), None, torch.full((2, ties_vocab), 1.0 / ties_vocab),
                 torch.zeros(0), torch.ones(2, ties_vocab)],
        "kwargs": {}, "disable": []}
    return cases


INTERPRET_CASES = _interpret_cases()


@pytest.fixture(scope="module")
def interpreted_results(run_interpreted: Any) -> dict[str, dict]:
    cases = [dict(c) for c in INTERPRET_CASES.values()]
    bad = BAD_INPUTS["max-too-small"]
    cases.append({"func": MOD + "rejection_sample_triton", "args": bad})  # errors still raised
    cases.append({"func": MOD + "_kernel_is_interpreted", "args": []})
    results = run_interpreted(cases)
    names = [*INTERPRET_CASES, "error-case", "is-interpreted"]
    return dict(zip(names, results, strict=True))


@pytest.mark.parametrize("name", INTERPRET_CASES)
def test_interpreted_kernel_matches_reference(name: str, interpreted_results: dict) -> None:
    result = interpreted_results[name]
    assert "ok" in result, result.get("error")
    out, accept = result["ok"]
    case = INTERPRET_CASES[name]
    ref_out, ref_accept = rejection_sample_ref(*case["args"], **case["kwargs"])
    assert out.dtype == torch.int64 and accept.dtype == torch.int64
    assert torch.equal(out, ref_out) and torch.equal(accept, ref_accept)


def test_interpreted_special_cases(interpreted_results: dict) -> None:
    assert interpreted_results["residual-fallback"]["ok"][0].tolist() == [[1, PH]]
    assert interpreted_results["ties-across-chunks"]["ok"][0].tolist() == [[0], [0]]
    accepted = sum(int(r["ok"][1].sum()) for n, r in interpreted_results.items()
                   if n.startswith("batch7") or n.startswith("v49152"))
    assert accepted > 0  # the cases exercise acceptance, not only rejection at 0


def test_interpreted_worker_really_interprets(interpreted_results: dict) -> None:
    assert interpreted_results["is-interpreted"] == {"ok": [True]}
    assert interpreted_results["error-case"]["error"].startswith("ValueError")


# --------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernel_matches_reference() -> None:
    gen = torch.Generator().manual_seed(7)
    rng = random.Random(7)
    for batch, max_drafts in [(1, 1), (7, 5), (64, 8), (256, 16), (3, 0)]:
        for full in (False, True):
            for dtype in (torch.float32, torch.float64):
                counts = [rng.randrange(0, max_drafts + 1) for _ in range(batch)]
                case = make_case(counts, 49152, full, gen, dtype, sharp=4.0,
                                 draft_from_target=0.8)
                ref_out, ref_accept = rejection_sample_ref(*case["args"])
                for cu_dtype in (torch.int64, torch.int32):
                    args = [a.cuda() if a is not None else None for a in case["args"]]
                    args[1] = args[1].to(cu_dtype)
                    out, accept = rejection_sample(*args)
                    assert out.is_cuda and accept.is_cuda
                    assert torch.equal(out.cpu(), ref_out), (batch, full, dtype)
                    assert torch.equal(accept.cpu(), ref_accept)
