"""Tests of kernels/block_verify.py (block verification, Sun et al. arXiv 2403.10444): the rule's
formulas by exact enumeration (the committed tokens continued by the target follow the target;
the paper's 11/9 example), the torch reference against hand cases and a per-request oracle
written from the paper's Algorithm 2, its output distribution (chi-square on a context-dependent
target, one-hot and full draft probs) and its accept length against rejection sampling's.
The Triton kernel is compared with the reference in test_block_verify_triton.py."""

from __future__ import annotations

import importlib
import itertools
import math
import random
from fractions import Fraction
from typing import Any

import pytest
import torch
from _chi2 import chi2_pvalue

from specmesh.kernels.constants import PLACEHOLDER_TOKEN_ID
from specmesh.kernels.block_verify import block_verify, block_verify_noise, block_verify_ref
from specmesh.kernels.rejection_sample import rejection_sample_ref

bv = importlib.import_module("specmesh.kernels.block_verify")
PH = PLACEHOLDER_TOKEN_ID
P_MIN = 1e-3


def _t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _cumsum(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0)


def make_case(counts: list[int], vocab: int, full: bool, gen: torch.Generator,
              dtype: torch.dtype = torch.float32, sharp: float = 1.0,
              draft_from_target: float = 0.0) -> dict[str, Any]:
    """Random distributions (softmax of ``sharp * randn``); drafts sampled from the draft rows;
    ``draft_from_target`` mixes the target into the draft rows to raise acceptance. Draft probs
    are passed (full) or not (one-hot)."""
    total, batch = sum(counts), len(counts)
    target = torch.softmax(sharp * torch.randn(total + batch, vocab, generator=gen,
                                               dtype=torch.float64), dim=-1)
    own = torch.softmax(sharp * torch.randn(total, vocab, generator=gen, dtype=torch.float64),
                        dim=-1)
    req = torch.repeat_interleave(torch.arange(batch), torch.tensor(counts, dtype=torch.int64))
    draft = (1 - draft_from_target) * own + draft_from_target * target[torch.arange(total) + req]
    drafts = (torch.multinomial(draft, 1, generator=gen)[:, 0] if total
              else torch.zeros(0, dtype=torch.int64))
    cu = _cumsum(counts)
    uniform, noise = block_verify_noise(cu, vocab, dtype, gen)
    return {"args": [drafts, cu, draft.to(dtype) if full else None, target.to(dtype), uniform,
                     noise], "counts": counts}


# --------------------------------------------------------------------------------------------
# The rule itself: exact enumeration with fractions (Algorithm 2 as the module documents it)
# --------------------------------------------------------------------------------------------


def _exact_block(gamma: int, vocab: int, target, draft,
                 with_dist: bool = True) -> tuple[dict, Fraction]:
    """Distribution of the committed tokens continued by the target up to ``gamma + 1`` tokens
    (when ``with_dist``), and E[accept_len]; ``target(prefix)`` / ``draft(prefix)`` are rows
    (lists of Fractions, or floats for the mean alone). With independent eta_i,
    P(tau = i) = h_i * prod_{j > i} (1 - h_j)."""
    out: dict[tuple, Fraction] = {}
    mean = Fraction(0)
    for xs in itertools.product(range(vocab), repeat=gamma):
        px = math.prod((draft(xs[:i])[xs[i]] for i in range(gamma)), start=Fraction(1))
        if px == 0:
            continue
        p = [Fraction(1)]
        for i in range(1, gamma + 1):
            t, q = target(xs[:i - 1])[xs[i - 1]], draft(xs[:i - 1])[xs[i - 1]]
            p.append(min(p[-1] * t / q, Fraction(1)))
        h = [Fraction(1)]
        for i in range(1, gamma):
            s = sum(max(p[i] * a - b, 0) for a, b in zip(target(xs[:i]), draft(xs[:i])))
            den = s + 1 - p[i]
            h.append(s / den if den else Fraction(1))
        h.append(p[gamma])
        for tau in range(gamma + 1):
            pt = h[tau] * math.prod((1 - h[j] for j in range(tau + 1, gamma + 1)),
                                    start=Fraction(1))
            if pt == 0:
                continue
            mean += px * pt * tau
            if not with_dist:
                continue
            if tau == gamma:
                res = target(xs)
            else:
                r = [max(p[tau] * a - b, 0) for a, b in zip(target(xs[:tau]), draft(xs[:tau]))]
                res = [v / sum(r) for v in r]
            for y, ry in enumerate(res):
                for rest in itertools.product(range(vocab), repeat=gamma - tau):
                    seq = xs[:tau] + (y,) + rest
                    pr = px * pt * ry * math.prod(
                        (target(seq[:j])[seq[j]] for j in range(tau + 1, gamma + 1)),
                        start=Fraction(1))
                    if pr:
                        out[seq] = out.get(seq, 0) + pr
    return out, mean


def _exact_target(gamma: int, vocab: int, target) -> dict:
    out = {}
    for seq in itertools.product(range(vocab), repeat=gamma + 1):
        pr = math.prod((target(seq[:j])[seq[j]] for j in range(gamma + 1)), start=Fraction(1))
        if pr:
            out[seq] = pr
    return out


def test_paper_example_exact_accept_lengths() -> None:
    """Sun et al. §1: t = (1/3, 2/3), q = (2/3, 1/3), gamma = 2: token verification accepts
    10/9 drafts per iteration, block verification 11/9, and stays exact."""
    t = [Fraction(1, 3), Fraction(2, 3)]
    q = [Fraction(2, 3), Fraction(1, 3)]
    dist, mean = _exact_block(2, 2, lambda _: t, lambda _: q)
    assert mean == Fraction(11, 9)
    assert dist == _exact_target(2, 2, lambda _: t)
    beta = sum(min(a, b) for a, b in zip(t, q))
    assert beta + beta ** 2 == Fraction(10, 9)  # token verification


def test_rule_is_exact_for_context_dependent_rows_by_enumeration() -> None:
    rng = random.Random(0)

    def row(vocab: int) -> list[Fraction]:
        w = [rng.randint(0, 5) for _ in range(vocab)]  # zeros included
        if not sum(w):
            w[rng.randrange(vocab)] = 1
        return [Fraction(x, sum(w)) for x in w]

    for _ in range(12):
        vocab, gamma = rng.choice([2, 3]), rng.choice([1, 2, 3])
        rows_t: dict = {}
        rows_q: dict = {}

        def target(prefix, rows=rows_t, vocab=vocab):
            return rows.setdefault(prefix, row(vocab))

        def draft(prefix, rows=rows_q, vocab=vocab):
            return rows.setdefault(prefix, row(vocab))

        dist, _ = _exact_block(gamma, vocab, target, draft)
        assert dist == _exact_target(gamma, vocab, target)


# --------------------------------------------------------------------------------------------
# Reference: hand cases, oracle
# --------------------------------------------------------------------------------------------


def oracle(drafts: torch.Tensor, counts: list[int], draft_probs: torch.Tensor | None,
           target_probs: torch.Tensor, uniform: torch.Tensor, noise: torch.Tensor,
           width: int | None = None) -> tuple[list[list[int]], list[int]]:
    """Algorithm 2 request by request, position by position, as the paper writes it (h_i as a
    quotient, eta_i < h_i); row ops in float64 torch."""
    width = (max(counts, default=0) if width is None else width) + 1
    vocab = target_probs.shape[1]
    rows, accepts = [], []
    d = 0
    for b, k in enumerate(counts):
        def t_row(j: int) -> torch.Tensor:
            return target_probs[d + b + j].double()

        def q_row(j: int) -> torch.Tensor:
            if draft_probs is None:
                return torch.nn.functional.one_hot(drafts[d + j], vocab).double()
            return draft_probs[d + j].double()

        p, tau = [1.0], 0
        for i in range(1, k + 1):
            x = int(drafts[d + i - 1])
            num = p[-1] * float(t_row(i - 1)[x])
            q = float(q_row(i - 1)[x])
            p.append(0.0 if num <= 0 else (1.0 if num >= q else num / q))
            eta = float(uniform[d + i - 1])
            if i < k:
                s = float(torch.clamp(p[i] * t_row(i) - q_row(i), min=0).sum())
                den = s + (1.0 - p[i])
                passed = den == 0 or eta < s / den
            else:
                passed = eta * q < num  # eta < p_k
            if passed:
                tau = i
        if tau < k:
            residual = torch.clamp(p[tau] * t_row(tau) - q_row(tau), min=0)
        else:
            residual = t_row(k)
        scores = residual / noise[b].double()
        if float(scores.max()) == 0:
            scores = t_row(tau) / noise[b].double()
        out = drafts[d: d + tau].tolist() + [int(scores.argmax())]
        rows.append(out + [PH] * (width - len(out)))
        accepts.append(tau)
        d += k
    return rows, accepts


@pytest.mark.parametrize("full", [False, True], ids=["one-hot", "full"])
def test_reference_matches_oracle_on_random_batches(full: bool) -> None:
    gen = torch.Generator().manual_seed(3 + full)
    rng = random.Random(3)
    accepted = 0
    for trial in range(50):
        counts = [rng.randrange(0, 7) for _ in range(rng.randrange(1, 6))]
        dtype = torch.float64 if trial % 3 == 0 else torch.float32
        case = make_case(counts, rng.choice([2, 3, 17, 301]), full, gen, dtype,
                         sharp=rng.choice([0.5, 2.0, 6.0]),
                         draft_from_target=rng.choice([0.0, 0.7, 0.95]))
        width = rng.choice([None, max(counts) + 2])
        out, accept = block_verify_ref(*case["args"], max_num_draft_tokens=width)
        rows, accepts = oracle(case["args"][0], counts, *case["args"][2:], width=width)
        assert out.tolist() == rows and accept.tolist() == accepts, trial
        accepted += int(accept.sum())
    assert accepted > 0


def test_joint_acceptance_keeps_a_draft_token_verification_would_reject() -> None:
    """The paper's example with drafts (a, b): p_1 = 1/2, p_2 = 1 = h_2, so both drafts pass
    for any eta_1, also eta_1 = 0.9 where token verification rejects the first one."""
    target = torch.tensor([[1 / 3, 2 / 3]] * 3, dtype=torch.float64)
    draft = torch.tensor([[2 / 3, 1 / 3]] * 2, dtype=torch.float64)
    uniform = torch.tensor([0.9, 0.5], dtype=torch.float64)
    noise = torch.ones(1, 2, dtype=torch.float64)
    out, accept = block_verify_ref(_t([0, 1]), _t([2]), draft, target, uniform, noise)
    assert accept.tolist() == [2] and out.tolist() == [[0, 1, 1]]
    _, rej_accept = rejection_sample_ref(_t([0, 1]), _t([2]), draft, target, uniform, noise)
    assert rej_accept.tolist() == [0]


def test_one_draft_is_rejection_sampling_exactly() -> None:
    """k <= 1 (float64): same tests (eta * q < t), same residual, same noise -> same output."""
    gen = torch.Generator().manual_seed(9)
    for full in (False, True):
        case = make_case([1, 0, 1, 1, 0, 1] * 20, 13, full, gen, torch.float64, sharp=2.0)
        out, accept = block_verify_ref(*case["args"])
        want_out, want_accept = rejection_sample_ref(*case["args"])
        assert torch.equal(out, want_out) and torch.equal(accept, want_accept)


def test_greedy_target_and_one_hot_drafts_is_greedy_verification() -> None:
    vocab = 7
    drafts, counts = [3, 4, 5, 1, 2], [3, 0, 2]
    target_tokens = [3, 4, 6, 0, 2, 1, 2, 6]  # rows: [3,4,6,0] [2] [1,2,6]
    target = torch.nn.functional.one_hot(torch.tensor(target_tokens), vocab).float()
    noise = torch.rand(3, vocab, generator=torch.Generator().manual_seed(0)) + 0.1
    for u in (0.0, 0.5, 0.999):
        uniform = torch.full((5,), u, dtype=torch.float64)
        for draft_probs in (None, torch.nn.functional.one_hot(_t(drafts), vocab).float()):
            out, accept = block_verify_ref(_t(drafts), _cumsum(counts), draft_probs, target,
                                           uniform, noise)
            assert out.tolist() == [[3, 4, 6, PH], [2, PH, PH, PH], [1, 2, 6, PH]]
            assert accept.tolist() == [2, 0, 2]


def test_zero_target_probability_stops_the_block_there() -> None:
    # draft 1 has target probability 0: p_2 = p_3 = 0, no position from 2 on can pass
    target = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.3, 0.3, 0.4], [1, 0, 0]],
                          dtype=torch.float64)
    uniform = torch.zeros(3, dtype=torch.float64)
    noise = torch.ones(1, 3, dtype=torch.float64)
    out, accept = block_verify_ref(_t([1, 0, 2]), _t([3]), None, target, uniform, noise)
    assert accept.tolist() == [1] and out[0, 0].item() == 1 and out[0, 1].item() in (1, 2)


def test_vanished_residual_falls_back_to_the_target_row() -> None:
    # draft dominates the target everywhere (unnormalized rows): the residual is all zero
    target = torch.tensor([[0.1, 0.2, 0.1], [0.3, 0.3, 0.4]])
    draft = torch.tensor([[0.5, 0.3, 0.2]])
    noise = torch.tensor([[1.0, 0.5, 2.0]])  # target scores 0.1, 0.4, 0.05 -> token 1
    out, accept = block_verify_ref(_t([0]), _t([1]), draft, target,
                                   torch.tensor([0.9], dtype=torch.float64), noise)
    assert accept.tolist() == [0] and out.tolist() == [[1, PH]]


def test_explicit_width_empty_batch_zero_drafts() -> None:
    gen = torch.Generator().manual_seed(1)
    case = make_case([0, 0], 5, False, gen)
    out, accept = block_verify_ref(*case["args"], max_num_draft_tokens=2)
    assert out.shape == (2, 3) and (out[:, 1:] == PH).all() and accept.tolist() == [0, 0]
    out, accept = block_verify_ref(_t([]), _t([]), None, torch.zeros(0, 5), torch.zeros(0),
                                   torch.ones(0, 5))
    assert out.shape == (0, 1) and accept.shape == (0,)


def test_launcher_on_cpu_runs_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the kernel must not run on CPU without TRITON_INTERPRET")

    monkeypatch.setattr(bv, "block_verify_triton", fail)
    case = make_case([3, 0, 2], 11, True, torch.Generator().manual_seed(2))
    out, accept = bv.block_verify(*case["args"])
    ref_out, ref_accept = block_verify_ref(*case["args"])
    assert torch.equal(out, ref_out) and torch.equal(accept, ref_accept)


def test_bad_inputs_raise_value_error() -> None:
    base = make_case([2, 1], 5, True, torch.Generator().manual_seed(4))["args"]
    bad = []
    for index, value in ((0, base[0].to(torch.int32)), (0, _t([1, 5, 2])), (1, _t([2, 2])),
                         (2, base[2][:2]), (3, base[3][:4]), (4, base[4][:2]),
                         (4, torch.tensor([0.1, 1.0, 0.2], dtype=torch.float64)),
                         (5, torch.zeros_like(base[5]))):
        args = list(base)
        args[index] = value
        bad.append(args)
    bad.append([*base, 1])  # max_num_draft_tokens below a request's count
    for args in bad:
        for fn in (block_verify_ref, block_verify):
            with pytest.raises(ValueError):
                fn(*args)


# --------------------------------------------------------------------------------------------
# Output distribution: chi-square on a context-dependent target (>= 20,000 samples)
# --------------------------------------------------------------------------------------------

VOCAB = 4
K = 3
# TARGET[j][prev]: the target's row at position j after token prev (j = 0: after the prompt,
# one row); DRAFT[j][prev] likewise for the draft model (positions 0..K-1). Zeros included.
TARGET = [
    torch.tensor([[0.40, 0.30, 0.20, 0.10]] * VOCAB),
    torch.tensor([[0.10, 0.20, 0.30, 0.40], [0.50, 0.00, 0.25, 0.25],
                  [0.25, 0.25, 0.25, 0.25], [0.05, 0.60, 0.05, 0.30]]),
    torch.tensor([[0.70, 0.10, 0.10, 0.10], [0.20, 0.20, 0.00, 0.60],
                  [0.10, 0.45, 0.35, 0.10], [0.30, 0.30, 0.30, 0.10]]),
    torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.10, 0.10, 0.40, 0.40],
                  [0.60, 0.20, 0.10, 0.10], [0.00, 0.50, 0.50, 0.00]]),
]
DRAFT = [
    torch.tensor([[0.20, 0.50, 0.20, 0.10]] * VOCAB),
    torch.tensor([[0.30, 0.30, 0.30, 0.10], [0.40, 0.10, 0.40, 0.10],
                  [0.10, 0.10, 0.70, 0.10], [0.25, 0.25, 0.25, 0.25]]),
    torch.tensor([[0.40, 0.40, 0.10, 0.10], [0.10, 0.30, 0.30, 0.30],
                  [0.30, 0.30, 0.20, 0.20], [0.60, 0.00, 0.20, 0.20]]),
]
FIXED_DRAFTS = [1, 2, 0]


def _context_batch(n: int, full: bool, fixed: bool, seed: int,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """``n`` requests with K drafts each: drafts sampled autoregressively from DRAFT (or the
    fixed ones), target rows from TARGET along the drafted prefix."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.zeros(n, K, dtype=torch.int64)
    draft_rows = torch.zeros(n, K, VOCAB, dtype=torch.float64)
    target_rows = torch.zeros(n, K + 1, VOCAB, dtype=torch.float64)
    prev = torch.zeros(n, dtype=torch.int64)
    for j in range(K):
        draft_rows[:, j] = DRAFT[j][prev].double()
        target_rows[:, j] = TARGET[j][prev].double()
        drafts[:, j] = (torch.full((n,), FIXED_DRAFTS[j]) if fixed
                        else torch.multinomial(draft_rows[:, j], 1, generator=gen)[:, 0])
        prev = drafts[:, j]
    target_rows[:, K] = TARGET[K][prev].double()
    cu = _cumsum([K] * n)
    uniform, noise = block_verify_noise(cu, VOCAB, dtype, gen)
    args = [drafts.reshape(-1), cu, draft_rows.reshape(-1, VOCAB).to(dtype) if full else None,
            target_rows.reshape(-1, VOCAB).to(dtype), uniform, noise]
    return args, gen


def _complete(out: torch.Tensor, accept: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The committed tokens continued by the target (TARGET rows) up to K + 1 tokens."""
    seq = out.clone()
    for j in range(1, K + 1):
        todo = accept < j  # position j was not committed
        rows = TARGET[j][seq[todo, j - 1]].double()
        seq[todo, j] = torch.multinomial(rows, 1, generator=gen)[:, 0]
    return seq


def _exact_joint(positions: tuple[int, ...]) -> dict[tuple[int, ...], float]:
    """P(z at ``positions``) for z ~ the target over K + 1 tokens."""
    probs: dict[tuple[int, ...], float] = {}
    for z in itertools.product(range(VOCAB), repeat=K + 1):
        pr = float(TARGET[0][0, z[0]])
        for j in range(1, K + 1):
            pr *= float(TARGET[j][z[j - 1], z[j]])
        key = tuple(z[i] for i in positions)
        probs[key] = probs.get(key, 0.0) + pr
    return probs


def _pvalue(seq: torch.Tensor, positions: tuple[int, ...]) -> float:
    exact = _exact_joint(positions)
    keys = sorted(exact)
    index = {k: i for i, k in enumerate(keys)}
    counts = [0] * len(keys)
    for row in seq[:, list(positions)].tolist():
        key = tuple(row)
        if key not in index:
            return 0.0  # a sequence the target never produces
        counts[index[key]] += 1
    return chi2_pvalue(counts, [exact[k] for k in keys])


@pytest.mark.parametrize("mode", ["full", "one-hot", "one-hot-fixed-drafts", "full-float64"])
def test_emitted_tokens_follow_the_target(mode: str) -> None:
    """The committed tokens continued by the target follow the target: positions 1 and 2 (the
    ones block verification decides jointly), each and together, and positions 0..2."""
    full = mode.startswith("full")
    dtype = torch.float64 if mode.endswith("float64") else torch.float32
    n = 24_000
    args, gen = _context_batch(n, full, mode == "one-hot-fixed-drafts", seed=31, dtype=dtype)
    out, accept = block_verify_ref(*args)
    assert ((out == PH) == (torch.arange(K + 1)[None, :] > accept[:, None])).all()
    seq = _complete(out, accept, gen)
    for positions in ((1,), (2,), (1, 2), (0, 1, 2), (3,)):
        p = _pvalue(seq, positions)
        assert p > P_MIN, (mode, positions, p)
    assert 0 < accept.double().mean() < K


# --------------------------------------------------------------------------------------------
# Accept length against standard rejection sampling
# --------------------------------------------------------------------------------------------


def _fixed_rows_batch(target_rows: torch.Tensor, draft_rows: torch.Tensor, n: int,
                      gen: torch.Generator) -> list:
    """``n`` requests with the same context-free rows (K = len(draft_rows)); drafts sampled
    from the draft rows."""
    k, vocab = draft_rows.shape
    drafts = torch.multinomial(draft_rows.repeat(n, 1), 1, replacement=True,
                               generator=gen)[:, 0]
    return [drafts, _cumsum([k] * n), draft_rows.repeat(n, 1), target_rows.repeat(n, 1)]


def _mean_accepts(target_rows: torch.Tensor, draft_rows: torch.Tensor, n: int, seed: int,
                  full: bool = True) -> tuple[float, float, float]:
    """(block mean, rejection mean, standard error of their difference) over ``n`` requests
    each, independent randomness."""
    means, variances = [], []
    for i, fn in enumerate((block_verify_ref, rejection_sample_ref)):
        gen = torch.Generator().manual_seed(seed + i)
        drafts, cu, draft, target = _fixed_rows_batch(target_rows, draft_rows, n, gen)
        uniform, noise = block_verify_noise(cu, target.shape[1], target.dtype, gen)
        _, accept = fn(drafts, cu, draft if full else None, target, uniform, noise)
        means.append(float(accept.double().mean()))
        variances.append(float(accept.double().var()))
    return means[0], means[1], math.sqrt(sum(variances) / n)


def _exact_means(target_rows: torch.Tensor, draft_rows: torch.Tensor) -> tuple[float, float]:
    """Exact E[accept_len] of block (enumeration) and token verification (prod of beta_i)."""
    k, vocab = draft_rows.shape
    t, q = target_rows.tolist(), draft_rows.tolist()
    _, block_mean = _exact_block(k, vocab, lambda pre: t[len(pre)], lambda pre: q[len(pre)],
                                 with_dist=False)
    beta = [sum(min(a, b) for a, b in zip(t[j], q[j])) for j in range(k)]
    token_mean = sum(math.prod(beta[:a]) for a in range(1, k + 1))
    return float(block_mean), float(token_mean)


def _random_rows(gen: torch.Generator, k: int, vocab: int, sharp: float,
                 mix: float) -> tuple[torch.Tensor, torch.Tensor]:
    target = torch.softmax(sharp * torch.randn(k + 1, vocab, generator=gen,
                                               dtype=torch.float64), dim=-1)
    own = torch.softmax(sharp * torch.randn(k, vocab, generator=gen, dtype=torch.float64), -1)
    return target, (1 - mix) * own + mix * target[:k]


RANDOM_ROW_CASES = [(2, 3, 1.0, 0.0), (3, 4, 2.0, 0.5), (4, 3, 3.0, 0.3), (5, 2, 1.5, 0.6),
                    (3, 6, 2.5, 0.8)]


@pytest.mark.parametrize("case", RANDOM_ROW_CASES, ids=lambda c: f"k{c[0]}-v{c[1]}")
def test_block_accepts_at_least_as_many_as_rejection_on_random_cases(case: tuple) -> None:
    """Monte Carlo over 20,000 requests per rule (tolerance 4 standard errors), and the exact
    expectations (enumeration) in the same order; the reference's means match the exact ones."""
    k, vocab, sharp, mix = case
    target, draft = _random_rows(torch.Generator().manual_seed(100 + k * vocab), k, vocab,
                                 sharp, mix)
    exact_block, exact_token = _exact_means(target, draft)
    assert exact_block >= exact_token - 1e-12
    block, rejection, se = _mean_accepts(target, draft, 20_000, seed=7 * k + vocab)
    assert block >= rejection - 4 * se, (block, rejection, se)
    assert abs(block - exact_block) < 5 * se and abs(rejection - exact_token) < 5 * se


def test_one_hot_drafts_accept_as_many_as_rejection() -> None:
    """With one-hot drafts both rules accept prod_j t_j[x_j] in expectation."""
    target, draft = _random_rows(torch.Generator().manual_seed(5), 4, 5, 2.0, 0.6)
    block, rejection, se = _mean_accepts(target, draft, 20_000, seed=55, full=False)
    assert abs(block - rejection) < 4 * se, (block, rejection, se)


def test_block_accepts_strictly_more_on_the_paper_example() -> None:
    """t = (1/3, 2/3), q = (2/3, 1/3) at both positions, K = 2: 11/9 against 10/9."""
    target = torch.tensor([[1 / 3, 2 / 3]] * 3, dtype=torch.float64)
    draft = torch.tensor([[2 / 3, 1 / 3]] * 2, dtype=torch.float64)
    block, rejection, se = _mean_accepts(target, draft, 40_000, seed=77)
    assert block > rejection + 0.05 and block - rejection > 8 * se, (block, rejection, se)
    assert abs(block - 11 / 9) < 5 * se and abs(rejection - 10 / 9) < 5 * se
