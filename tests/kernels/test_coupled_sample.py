"""Tests of kernels/coupled_sample.py and kernels/counter_noise.py: the counter-based noise
(against a pure-python splitmix64, its distribution), Gumbel-max sampling and coupled verification (chi-square against
the target, output independent of the drafts, speculation on == off in a decode loop), the
Triton kernels (interpreted, in a subprocess) against the references exactly, and on CUDA."""

from __future__ import annotations

import importlib
import math
import random
from typing import Any

import pytest
import torch
from _chi2 import chi2_pvalue

from specmesh.kernels.constants import PLACEHOLDER_TOKEN_ID
from specmesh.kernels.counter_noise import coupled_exponential_noise, seed_to_int64
from specmesh.kernels.coupled_sample import (
    _kernel_is_interpreted,
    coupled_sample,
    coupled_sample_ref,
    gumbel_sample,
    gumbel_sample_ref,
)

cs = importlib.import_module("specmesh.kernels.coupled_sample")
cn = importlib.import_module("specmesh.kernels.counter_noise")
PH = PLACEHOLDER_TOKEN_ID
MOD = "specmesh.kernels.coupled_sample."
NOISE_MOD = "specmesh.kernels.counter_noise."
P_MIN = 1e-3
M64 = (1 << 64) - 1


def _t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _cumsum(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0)


# --------------------------------------------------------------------------------------------
# Noise
# --------------------------------------------------------------------------------------------


def _py_mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _py_uniform(seed: int, position: int, v: int) -> float:
    """The generator spelled out on unsigned python ints."""
    gamma = 0x9E3779B97F4A7C15
    key = _py_mix(_py_mix((seed + gamma) & M64) ^ (position & M64))
    h = _py_mix((key + (v + 1) * gamma) & M64)
    return ((h >> 12) * 2 + 1) * 2.0 ** -53


SEEDS = [0, 1, -1, 42, 2 ** 63 - 1, -(2 ** 63), 123456789012345]
POSITIONS = [0, 1, 2, 17, 2 ** 40, 2 ** 62]


def test_noise_is_splitmix64_and_minus_log_uniform() -> None:
    vocab = 37
    seeds = _t([s for s in SEEDS for _ in POSITIONS])
    positions = _t([p for _ in SEEDS for p in POSITIONS])
    noise = coupled_exponential_noise(seeds, positions, vocab)
    assert noise.dtype == torch.float64 and noise.shape == (len(seeds), vocab)
    for n, (s, p) in enumerate(zip(seeds.tolist(), positions.tolist())):
        for v in range(vocab):
            u = _py_uniform(s & M64, p, v)
            assert 0 < u < 1
            assert noise[n, v].item() == pytest.approx(-math.log(u), rel=2e-15, abs=0)


def test_log_is_accurate_on_the_whole_unit_interval() -> None:
    u = torch.cat([torch.rand(200_000, dtype=torch.float64, generator=torch.Generator()
                              .manual_seed(0)),
                   torch.tensor([2.0 ** -53, 1 - 2.0 ** -53, 0.5, 1 / math.sqrt(2),
                                 math.nextafter(1 / math.sqrt(2), 1), 0.25, 1e-300],
                                dtype=torch.float64)])
    u = u.clamp(min=2.0 ** -53)
    log = cn._log_unit(u)
    rel = ((log - torch.log(u)).abs() / torch.log(u).abs()).max().item()
    assert rel < 2e-15


def test_uniforms_are_uniform_and_rows_independent() -> None:
    seeds = torch.arange(400).repeat_interleave(50) * 7919 - 3
    positions = torch.arange(50).repeat(400)
    u = torch.exp(-coupled_exponential_noise(seeds, positions, 64))  # [20,000, 64]
    bins = torch.bincount((u * 20).long().flatten(), minlength=20)
    assert chi2_pvalue(bins.tolist(), [1.0] * 20) > P_MIN
    assert coupled_exponential_noise(seeds, positions, 64).mean().item() == pytest.approx(
        1.0, abs=0.01)
    # pairs: (position i, position i+1) of one seed, and (seed s, seed s+1) at one position
    first = (u[:, 0] * 4).long()
    by_seed = first.view(400, 50)
    for a, b in ((by_seed[:, :-1], by_seed[:, 1:]), (by_seed[:-1, :], by_seed[1:, :])):
        joint = torch.bincount((a * 4 + b).flatten(), minlength=16)
        assert chi2_pvalue(joint.tolist(), [1.0] * 16) > P_MIN
    # vocabulary neighbours within a row
    joint = torch.bincount(((u[:, :-1] * 4).long() * 4 + (u[:, 1:] * 4).long()).flatten(),
                           minlength=16)
    assert chi2_pvalue(joint.tolist(), [1.0] * 16) > P_MIN


def test_seed_to_int64() -> None:
    assert seed_to_int64(0) == 0 and seed_to_int64(42) == 42
    assert seed_to_int64(2 ** 63) == -(2 ** 63) and seed_to_int64(2 ** 64 - 1) == -1
    assert seed_to_int64(-5) == -5
    for bad in (2 ** 64, -(2 ** 63) - 1, 1.0, True, "1"):
        with pytest.raises(ValueError):
            seed_to_int64(bad)


# --------------------------------------------------------------------------------------------
# Gumbel-max sampling
# --------------------------------------------------------------------------------------------


TARGET = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10, 0.00], dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gumbel_sample_over_seeds_follows_probs(dtype: torch.dtype) -> None:
    n = 20_000
    probs = TARGET.to(dtype).expand(n, -1).contiguous()
    tokens = gumbel_sample(probs, torch.arange(n) * 31 + 5, torch.full((n,), 7))
    assert chi2_pvalue(torch.bincount(tokens, minlength=6).tolist(), TARGET.tolist()) > P_MIN


def test_gumbel_sample_over_positions_follows_probs() -> None:
    n = 20_000
    probs = TARGET.expand(n, -1)
    tokens = gumbel_sample_ref(probs, torch.full((n,), 123), torch.arange(n))
    assert chi2_pvalue(torch.bincount(tokens, minlength=6).tolist(), TARGET.tolist()) > P_MIN


def test_gumbel_sample_is_deterministic_and_keyed() -> None:
    probs = torch.softmax(torch.randn(1, 5000, generator=torch.Generator().manual_seed(1)), -1)
    probs = probs.expand(64, -1)
    seeds, positions = torch.arange(64) // 8, torch.arange(64) % 8
    a = gumbel_sample_ref(probs, seeds, positions)
    assert torch.equal(a, gumbel_sample_ref(probs, seeds, positions))
    assert len(set(a.tolist())) > 40  # 64 different keys give (mostly) different tokens
    # unnormalized rows sample the same token as normalized ones (a scale changes no argmax
    # up to rounding; a power of two changes no bit)
    assert torch.equal(gumbel_sample_ref(probs * 4, seeds, positions), a)


def test_one_hot_rows_sample_their_token() -> None:
    rows = torch.nn.functional.one_hot(_t([3, 0, 9, 9]), 10).double()
    assert gumbel_sample_ref(rows, _t([1, 2, 3, 4]), _t([0, 0, 5, 6])).tolist() == [3, 0, 9, 9]
    assert gumbel_sample_ref(torch.zeros(1, 4), _t([1]), _t([0])).tolist() == [0]  # all zero


# --------------------------------------------------------------------------------------------
# Coupled verification
# --------------------------------------------------------------------------------------------


def _target_tokens(target_probs: torch.Tensor, counts: list[int], seeds: torch.Tensor,
                   positions: torch.Tensor) -> list[list[int]]:
    """The target token of every row, request by request (k + 1 each)."""
    out, r = [], 0
    for b, k in enumerate(counts):
        rows = target_probs[r:r + k + 1]
        out.append(gumbel_sample_ref(rows, seeds[b].repeat(k + 1),
                                     positions[b] + torch.arange(k + 1)).tolist())
        r += k + 1
    return out


def _make(counts: list[int], vocab: int, gen: torch.Generator,
          dtype: torch.dtype = torch.float64, sharp: float = 2.0,
          coupled_drafts: bool = False, one_hot_rows: bool = False) -> list[Any]:
    batch, total = len(counts), sum(counts)
    target = torch.softmax(sharp * torch.randn(total + batch, vocab, generator=gen,
                                               dtype=torch.float64), dim=-1)
    if one_hot_rows:
        target = torch.nn.functional.one_hot(target.argmax(-1), vocab).double()
    seeds = torch.randint(-(2 ** 63), 2 ** 63 - 1, (batch,), generator=gen)
    positions = torch.randint(0, 4096, (batch,), generator=gen)
    if coupled_drafts:  # the drafter samples its own distribution with the same noise
        tokens = _target_tokens(target, counts, seeds, positions)
        keep = torch.rand(total, generator=gen) < 0.8  # 80% agree, then a wrong token
        drafts_t = _t([t for row, k in zip(tokens, counts) for t in row[:k]])
        drafts_t = torch.where(keep, drafts_t, (drafts_t + 1) % vocab)
    else:
        drafts_t = torch.randint(0, vocab, (total,), generator=gen)
    return [drafts_t, _cumsum(counts), target.to(dtype), seeds, positions]


def test_output_is_the_target_tokens_prefix() -> None:
    gen = torch.Generator().manual_seed(3)
    rng = random.Random(3)
    for trial in range(40):
        counts = [rng.randrange(0, 6) for _ in range(rng.randrange(1, 8))]
        args = _make(counts, rng.choice([2, 5, 300]), gen, sharp=rng.choice([0.5, 3.0, 8.0]),
                     coupled_drafts=trial % 2 == 0)
        width = rng.choice([None, max(counts) + 3])
        out, accept = coupled_sample_ref(*args, max_num_draft_tokens=width)
        tokens = _target_tokens(args[2], counts, args[3], args[4])
        drafts, d = args[0].tolist(), 0
        for b, k in enumerate(counts):
            a = 0
            while a < k and drafts[d + a] == tokens[b][a]:
                a += 1
            assert accept[b].item() == a
            w = (max(counts) if width is None else width) + 1
            assert out[b].tolist() == tokens[b][:a + 1] + [PH] * (w - a - 1)
            d += k


def test_output_is_independent_of_the_drafts() -> None:
    gen = torch.Generator().manual_seed(4)
    counts = [4, 0, 2, 5, 1, 3] * 50
    base = _make(counts, 50, gen, sharp=3.0, coupled_drafts=True)
    outs = []
    for variant in range(4):
        args = list(base)
        if variant == 1:  # garbage drafts
            args[0] = torch.randint(0, 50, base[0].shape, generator=gen)
        elif variant == 2:  # all the same token
            args[0] = torch.full_like(base[0], 7)
        elif variant == 3:  # no drafts at all: one target row per request
            rows = torch.cumsum(torch.tensor(counts) + 1, 0) - torch.tensor(counts) - 1
            args = [_t([]), torch.zeros(len(counts), dtype=torch.int64), base[2][rows],
                    base[3], base[4]]
        outs.append(coupled_sample_ref(*args))
    for out, accept in outs[1:]:
        ref_out, ref_accept = outs[0]
        for b in range(len(counts)):
            n = min(int(accept[b]), int(ref_accept[b])) + 1
            assert out[b, :n].tolist() == ref_out[b, :n].tolist()
    assert outs[0][1].sum() > outs[1][1].sum()  # coupled drafts are accepted more often


K = 3
TARGET_ROWS = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
                            [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],
                            [0.50, 0.00, 0.10, 0.10, 0.10, 0.20],
                            [0.10, 0.40, 0.05, 0.05, 0.20, 0.20]], dtype=torch.float64)
DRAFT_ROWS = torch.tensor([[0.10, 0.10, 0.30, 0.10, 0.20, 0.20],
                           [0.20, 0.20, 0.20, 0.10, 0.10, 0.20],
                           [0.30, 0.30, 0.00, 0.10, 0.20, 0.10]], dtype=torch.float64)


@pytest.mark.parametrize("drafter", ["independent", "coupled"])
def test_emitted_tokens_follow_the_target(drafter: str) -> None:
    n = 20_000
    gen = torch.Generator().manual_seed(9)
    seeds = torch.randint(-(2 ** 63), 2 ** 63 - 1, (n,), generator=gen)
    positions = torch.randint(0, 1000, (n,), generator=gen)
    if drafter == "coupled":  # Gumbel-max of the draft rows with the request's noise
        drafts = torch.stack([gumbel_sample_ref(DRAFT_ROWS[j].expand(n, -1), seeds,
                                                positions + j) for j in range(K)], dim=1)
    else:
        drafts = torch.stack([torch.multinomial(DRAFT_ROWS[j], n, replacement=True,
                                                generator=gen) for j in range(K)], dim=1)
    target = TARGET_ROWS.repeat(n, 1)  # rows 0..K of every request
    out, accept = coupled_sample(drafts.flatten(), torch.arange(1, n + 1) * K, target, seeds,
                                 positions)
    for j in range(K + 1):
        emitted = accept >= j
        counts = torch.bincount(out[emitted, j], minlength=6).tolist()
        assert chi2_pvalue(counts, TARGET_ROWS[j].tolist()) > P_MIN, (j, counts)
    mean_accept = accept.double().mean().item()
    if drafter == "coupled":  # the Gumbel coupling accepts with P >= (1 - tv) / (1 + tv)
        tv = [0.5 * (TARGET_ROWS[j] - DRAFT_ROWS[j]).abs().sum().item() for j in range(K)]
        assert accept.gt(0).double().mean().item() > (1 - tv[0]) / (1 + tv[0]) - 0.02
    else:
        beta = [float((TARGET_ROWS[j] * DRAFT_ROWS[j]).sum()) for j in range(K)]
        expected = beta[0] + beta[0] * beta[1] + beta[0] * beta[1] * beta[2]
        assert mean_accept == pytest.approx(expected, abs=0.02)


def _markov(vocab: int, seed: int, sharp: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(vocab, vocab, generator=g, dtype=torch.float64), -1)


@pytest.mark.parametrize("drafter", ["garbage", "coupled-model", "oracle", "none"])
def test_speculative_decode_loop_equals_plain_decode(drafter: str) -> None:
    """A Markov 'model' (next-token rows depend on the previous token): decoding with coupled
    verification of any drafts gives plain decode's tokens, request by request, in a batch."""
    vocab, length, batch = 40, 30, 5
    target = _markov(vocab, 0, 2.0)
    draft_model = 0.7 * target + 0.3 * _markov(vocab, 1, 2.0)
    seeds = _t([11, -7, 2 ** 62, 0, 11])
    start = [3, 3, 9, 0, 17]
    plain = []
    for b in range(batch):
        seq = [start[b]]
        for i in range(length):
            seq.append(int(gumbel_sample_ref(target[seq[-1]][None], seeds[b:b + 1], _t([i]))))
        plain.append(seq[1:])

    rng = random.Random(5)
    committed: list[list[int]] = [[s] for s in start]
    drafted = accepted = 0
    while min(len(c) for c in committed) <= length:
        drafts, counts, rows, positions = [], [], [], []
        for b in range(batch):
            pos = len(committed[b]) - 1  # output position of the next token
            k = 0 if drafter == "none" else rng.randrange(0, 5)
            ds, prev = [], committed[b][-1]
            for j in range(k):
                if drafter == "garbage":
                    d = rng.randrange(vocab)
                elif drafter == "coupled-model":
                    d = int(gumbel_sample_ref(draft_model[prev][None], seeds[b:b + 1],
                                              _t([pos + j])))
                else:  # oracle: the target's own coupled sample
                    d = int(gumbel_sample_ref(target[prev][None], seeds[b:b + 1],
                                              _t([pos + j])))
                ds.append(d)
                prev = d
            context = [committed[b][-1], *ds]
            rows.append(target[context])
            drafts += ds
            counts.append(k)
            positions.append(pos)
        out, accept = coupled_sample(_t(drafts), _cumsum(counts), torch.cat(rows), seeds,
                                     _t(positions))
        drafted += sum(counts)
        accepted += int(accept.sum())
        for b in range(batch):
            committed[b] += out[b, :int(accept[b]) + 1].tolist()
    for b in range(batch):
        assert committed[b][1:length + 1] == plain[b], b
    assert plain[0] != plain[1]  # same start, different seeds
    if drafter == "oracle":
        assert accepted == drafted > 0
    elif drafter == "coupled-model":
        assert accepted > 0
    elif drafter == "garbage":
        assert drafted > 0


def test_same_seed_different_start_differs_and_same_everything_repeats() -> None:
    target = _markov(40, 0, 2.0)
    rows = target[[3, 3]]
    a = gumbel_sample_ref(rows, _t([11, 11]), _t([0, 0]))
    assert a[0] == a[1]
    many = gumbel_sample_ref(target[3].expand(200, -1), torch.arange(200),
                             torch.zeros(200, dtype=torch.int64))
    assert len(set(many.tolist())) > 5  # different seeds give different outputs


def test_launcher_on_cpu_runs_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the kernel must not run on CPU without TRITON_INTERPRET")

    monkeypatch.setattr(cs, "coupled_sample_triton", fail)
    monkeypatch.setattr(cs, "gumbel_sample_triton", fail)
    args = _make([3, 0, 2], 11, torch.Generator().manual_seed(2))
    out, accept = cs.coupled_sample(*args)
    ref_out, ref_accept = coupled_sample_ref(*args)
    assert torch.equal(out, ref_out) and torch.equal(accept, ref_accept)
    row_seeds = args[3].repeat(3)[:8]
    assert torch.equal(cs.gumbel_sample(args[2], row_seeds, torch.arange(8)),
                       gumbel_sample_ref(args[2], row_seeds, torch.arange(8)))


@pytest.mark.skipif(_kernel_is_interpreted(), reason="this session already interprets Triton")
def test_interpret_set_after_import_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _make([1], 4, torch.Generator().manual_seed(3))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="before"):
        coupled_sample(*args)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA"):
        cs.coupled_sample_triton(*args)
    with pytest.raises(ValueError, match="CUDA"):
        cs.gumbel_sample_triton(args[2], _t([1, 2]), _t([0, 1]))


def _bad_inputs() -> dict[str, tuple[str, list[Any]]]:
    base = _make([2, 1], 5, torch.Generator().manual_seed(4))  # drafts, cu, target, seeds, pos
    bad: dict[str, tuple[str, list[Any]]] = {}

    def add(name: str, index: int, value: Any) -> None:
        args = list(base)
        args[index] = value
        bad[name] = ("coupled_sample", args)

    add("drafts-int32", 0, base[0].to(torch.int32))
    add("cu-not-ending-at-total", 1, _t([2, 2]))
    add("cu-decreasing", 1, _t([3, 2]))
    add("target-rows", 2, base[2][:4])
    add("target-int", 2, base[2].long())
    add("target-half", 2, base[2].half())
    add("target-1d", 2, base[2][0])
    add("target-empty-vocab", 2, base[2][:, :0])
    add("seeds-int32", 3, base[3].int())
    add("seeds-length", 3, base[3][:1])
    add("positions-float", 4, base[4].double())
    add("positions-2d", 4, base[4][None])
    add("not-a-tensor", 2, base[2].tolist())
    bad["max-too-small"] = ("coupled_sample", [*base, 1])
    bad["gumbel-probs-int"] = ("gumbel_sample", [base[2].long(), _t([0] * 5), _t([0] * 5)])
    bad["gumbel-seeds-length"] = ("gumbel_sample", [base[2], _t([0] * 4), _t([0] * 5)])
    bad["gumbel-positions-length"] = ("gumbel_sample", [base[2], _t([0] * 5), _t([0] * 6)])
    bad["noise-vocab-zero"] = ("coupled_exponential_noise", [_t([0]), _t([0]), 0])
    bad["noise-vocab-bool"] = ("coupled_exponential_noise", [_t([0]), _t([0]), True])
    return bad


BAD_INPUTS = _bad_inputs()


@pytest.mark.parametrize("case", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_inputs_raise_value_error(case: tuple[str, list[Any]]) -> None:
    name, args = case
    if name == "coupled_exponential_noise":
        fns = [getattr(cn, name)]
    else:
        fns = [getattr(cs, name), getattr(cs, name + "_ref")]
    for fn in fns:
        with pytest.raises(ValueError):
            fn(*args)


# --------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (one subprocess for every case)
# --------------------------------------------------------------------------------------------


def _interpret_cases() -> dict[str, dict[str, Any]]:
    gen = torch.Generator().manual_seed(1271)
    rng = random.Random(1271)
    cases: dict[str, dict[str, Any]] = {}

    def add(name: str, counts: list[int], vocab: int, max_num: int | None = None,
            cu_dtype: torch.dtype = torch.int64, launcher: bool = False, **kw: Any) -> None:
        args = _make(counts, vocab, gen, **kw)
        args[1] = args[1].to(cu_dtype)
        cases[name] = {
            "func": MOD + ("coupled_sample" if launcher else "coupled_sample_triton"),
            "args": args, "kwargs": {"max_num_draft_tokens": max_num},
            "disable": [MOD + "coupled_sample_ref", MOD + "gumbel_sample_ref"] if launcher
            else [],
        }

    for seed in range(4):
        counts = [rng.randrange(0, 6) for _ in range(7)]
        counts[rng.randrange(7)] = 5
        counts[rng.randrange(7)] = 0
        add(f"batch7-v1000-seed{seed}", counts, 1000, coupled_drafts=seed % 2 == 0,
            dtype=torch.float32 if seed < 2 else torch.float64, sharp=4.0)
    add("v49152-float32", [2, 0], 49152, coupled_drafts=True, dtype=torch.float32,
        sharp=6.0)
    add("v49152-float64", [1], 49152, coupled_drafts=True, sharp=6.0)
    add("v4099-odd-chunks", [2, 1, 3], 4099, coupled_drafts=True, dtype=torch.float32)
    add("v1-single-token", [2, 0, 1], 1)
    add("v3-flat", [5, 5, 0], 3, sharp=0.1, coupled_drafts=True)
    add("one-hot-rows", [4, 0, 3], 257, one_hot_rows=True, coupled_drafts=True)
    add("int32-cu-explicit-max", [5, 0, 3, 1], 257, max_num=8, cu_dtype=torch.int32,
        coupled_drafts=True)
    add("all-zero-drafts", [0, 0, 0, 0], 333)
    add("wide-block", [17, 3, 0, 16], 5, coupled_drafts=True, sharp=8.0)
    add("launcher", [5, 0, 3, 1, 0, 4, 2], 500, launcher=True, coupled_drafts=True)

    seeds = _t(SEEDS)
    positions = _t([0, 1, 5, 100, 2 ** 40, 2 ** 62, 7])
    probs = torch.softmax(4 * torch.randn(len(SEEDS), 49152, generator=gen), dim=-1)
    edge = [2, 3, 5]  # seeds 2**63 - 1 and -2**63, positions up to 2**62 (V = 49,152 is slow
    # in the interpreter: three rows; every seed with a small vocabulary below)
    cases["gumbel-v49152"] = {"func": MOD + "gumbel_sample_triton",
                              "args": [probs[edge], seeds[edge], positions[edge]], "kwargs": {}}
    cases["gumbel-launcher-v777-float64"] = {
        "func": MOD + "gumbel_sample", "args": [probs[:, :777].double(), seeds, positions],
        "kwargs": {}, "disable": [MOD + "gumbel_sample_ref"]}
    cases["gumbel-ties"] = {"func": MOD + "gumbel_sample_triton",  # all zero: the first index
                            "args": [torch.zeros(2, 5000), _t([1, 2]), _t([0, 0])], "kwargs": {}}
    cases["noise-v49152"] = {"func": NOISE_MOD + "coupled_exponential_noise_triton",
                             "args": [seeds[edge], positions[edge], 49152], "kwargs": {}}
    cases["noise-v3"] = {"func": NOISE_MOD + "coupled_exponential_noise_triton",
                         "args": [seeds, positions, 3], "kwargs": {}}
    return cases


INTERPRET_CASES = _interpret_cases()
_REFS = {"coupled_sample_triton": coupled_sample_ref, "coupled_sample": coupled_sample_ref,
         "gumbel_sample_triton": gumbel_sample_ref, "gumbel_sample": gumbel_sample_ref,
         "coupled_exponential_noise_triton": coupled_exponential_noise}


@pytest.fixture(scope="module")
def interpreted_results(run_interpreted: Any) -> dict[str, dict]:
    cases = [dict(c) for c in INTERPRET_CASES.values()]
    cases.append({"func": MOD + "coupled_sample_triton",  # errors still raised
                  "args": BAD_INPUTS["max-too-small"][1]})
    cases += [{"func": mod + "_kernel_is_interpreted", "args": []} for mod in (MOD, NOISE_MOD)]
    results = run_interpreted(cases)
    names = [*INTERPRET_CASES, "error-case", "is-interpreted", "noise-is-interpreted"]
    return dict(zip(names, results, strict=True))


@pytest.mark.parametrize("name", INTERPRET_CASES)
def test_interpreted_kernel_matches_reference(name: str, interpreted_results: dict) -> None:
    result = interpreted_results[name]
    assert "ok" in result, result.get("error")
    case = INTERPRET_CASES[name]
    ref = _REFS[case["func"].rsplit(".", 1)[1]](*case["args"], **case["kwargs"])
    ref = list(ref) if isinstance(ref, tuple) else [ref]
    assert len(result["ok"]) == len(ref)
    for got, want in zip(result["ok"], ref):
        assert got.dtype == want.dtype and torch.equal(got, want)
        if got.dtype == torch.float64:  # the noise: bit for bit
            assert torch.equal(got.view(torch.int64), want.view(torch.int64))


def test_interpreted_special_cases(interpreted_results: dict) -> None:
    assert interpreted_results["gumbel-ties"]["ok"][0].tolist() == [0, 0]
    accepted = sum(int(r["ok"][1].sum()) for n, r in interpreted_results.items()
                   if n.startswith(("batch7", "v49152")))
    assert accepted > 0


def test_interpreted_worker_really_interprets(interpreted_results: dict) -> None:
    assert interpreted_results["is-interpreted"] == {"ok": [True]}
    assert interpreted_results["noise-is-interpreted"] == {"ok": [True]}
    assert interpreted_results["error-case"]["error"].startswith("ValueError")


# --------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernel_matches_reference() -> None:
    gen = torch.Generator().manual_seed(7)
    rng = random.Random(7)
    seeds = torch.randint(-(2 ** 63), 2 ** 63 - 1, (64,), generator=gen)
    positions = torch.randint(0, 2 ** 40, (64,), generator=gen)
    for vocab in (49152, 1, 4099):
        noise = cn.coupled_exponential_noise_triton(seeds.cuda(), positions.cuda(), vocab)
        want = coupled_exponential_noise(seeds, positions, vocab)
        assert torch.equal(noise.cpu().view(torch.int64), want.view(torch.int64)), vocab
    for batch, max_drafts in [(1, 1), (7, 5), (64, 8), (3, 0)]:
        for dtype in (torch.float32, torch.float64):
            counts = [rng.randrange(0, max_drafts + 1) for _ in range(batch)]
            args = _make(counts, 49152, gen, dtype, sharp=4.0, coupled_drafts=True)
            ref_out, ref_accept = coupled_sample_ref(*args)
            for cu_dtype in (torch.int64, torch.int32):
                cuda_args = [a.cuda() for a in args]
                cuda_args[1] = cuda_args[1].to(cu_dtype)
                out, accept = coupled_sample(*cuda_args)
                assert out.is_cuda and accept.is_cuda
                assert torch.equal(out.cpu(), ref_out), (batch, dtype)
                assert torch.equal(accept.cpu(), ref_accept)
