"""Tests of kernels/greedy_verify.py: the torch reference against hand cases and a python-loop
oracle, the Triton kernel (interpreted, in a subprocess) against the reference, and on CUDA."""

from __future__ import annotations

import importlib
import random
from typing import Any

import pytest
import torch

from specmesh.kernels.constants import PLACEHOLDER_TOKEN_ID
from specmesh.kernels.greedy_verify import greedy_verify, greedy_verify_ref
from specmesh.kernels.greedy_verify import _kernel_is_interpreted

# the module (``kernels.greedy_verify`` as an attribute is the launcher function)
gv = importlib.import_module("specmesh.kernels.greedy_verify")
PH = PLACEHOLDER_TOKEN_ID


def _t(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def oracle(drafts: list[int], counts: list[int], targets: list[int],
           width: int | None = None) -> tuple[list[list[int]], list[int]]:
    """The rule, spelled out with python lists."""
    width = (max(counts, default=0) if width is None else width) + 1
    rows, accepts = [], []
    d = t = 0
    for k in counts:
        ds, ts = drafts[d:d + k], targets[t:t + k + 1]
        a = 0
        while a < k and ds[a] == ts[a]:
            a += 1
        row = ds[:a] + [ts[a]]
        rows.append(row + [PH] * (width - len(row)))
        accepts.append(a)
        d, t = d + k, t + k + 1
    return rows, accepts


def make_case(counts: list[int], vocab: int, agree: float, rng: random.Random,
              ) -> tuple[list[int], list[int], list[int]]:
    """Random drafts/targets: each draft equals its target with probability ``agree``."""
    drafts, targets = [], []
    for k in counts:
        ts = [rng.randrange(vocab) for _ in range(k + 1)]
        for j in range(k):
            same = rng.random() < agree
            drafts.append(ts[j] if same else (ts[j] + rng.randrange(1, vocab)) % vocab)
        targets += ts
    return drafts, counts, targets


def _cumsum(counts: list[int]) -> list[int]:
    out, total = [], 0
    for k in counts:
        total += k
        out.append(total)
    return out


def _check(drafts: list[int], counts: list[int], targets: list[int], out: torch.Tensor,
           accept: torch.Tensor, width: int | None = None) -> None:
    rows, accepts = oracle(drafts, counts, targets, width)
    assert out.dtype == torch.int64 and accept.dtype == torch.int64
    assert out.tolist() == rows
    assert accept.tolist() == accepts


# --------------------------------------------------------------------------------------------
# Reference: hand cases
# --------------------------------------------------------------------------------------------


HAND_CASES = {
    "all-accepted-bonus": ([3, 4, 5], [3], [3, 4, 5, 6], [[3, 4, 5, 6]], [3]),
    "reject-at-0": ([3, 4], [2], [7, 4, 5], [[7, PH, PH]], [0]),
    "reject-in-middle-later-match-ignored": (
        [1, 2, 3, 4], [4], [1, 9, 3, 4, 5], [[1, 9, PH, PH, PH]], [1]),
    "empty-drafts-for-some": (
        [1, 2], [0, 2, 2], [9, 1, 2, 3, 8], [[9, PH, PH], [1, 2, 3], [8, PH, PH]], [0, 2, 0]),
    "all-empty": ([], [0, 0, 0], [4, 5, 6], [[4], [5], [6]], [0, 0, 0]),
    "mixed": ([5, 6, 7, 1, 2, 9, 4], [3, 3, 6, 7], [5, 6, 7, 8, 4, 1, 3, 9, 9, 4, 0],
              [[5, 6, 7, 8], [4, PH, PH, PH], [1, 3, PH, PH], [4, 0, PH, PH]], [3, 0, 1, 1]),
}


@pytest.mark.parametrize("cu_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("case", HAND_CASES.values(), ids=HAND_CASES.keys())
def test_reference_hand_cases(case: tuple, cu_dtype: torch.dtype) -> None:
    drafts, cu, targets, rows, accepts = case
    for fn in (greedy_verify_ref, greedy_verify):  # the launcher runs the reference on CPU
        out, accept = fn(_t(drafts), _t(cu, cu_dtype), _t(targets))
        assert out.tolist() == rows
        assert accept.tolist() == accepts


def test_explicit_max_num_draft_tokens_pads_wider() -> None:
    out, accept = greedy_verify_ref(_t([3, 4]), _t([2]), _t([3, 5, 6]), max_num_draft_tokens=4)
    assert out.tolist() == [[3, 5, PH, PH, PH]] and accept.tolist() == [1]
    out, accept = greedy_verify_ref(_t([]), _t([0]), _t([8]), max_num_draft_tokens=2)
    assert out.tolist() == [[8, PH, PH]] and accept.tolist() == [0]


def test_empty_batch() -> None:
    out, accept = greedy_verify_ref(_t([]), _t([]), _t([]))
    assert out.shape == (0, 1) and accept.shape == (0,)
    out, accept = greedy_verify_ref(_t([]), _t([]), _t([]), max_num_draft_tokens=3)
    assert out.shape == (0, 4)


def test_reference_matches_oracle_on_random_batches() -> None:
    rng = random.Random(0)
    for _ in range(300):
        counts = [rng.randrange(0, 7) for _ in range(rng.randrange(1, 12))]
        drafts, counts, targets = make_case(counts, rng.choice([2, 5, 1271]),
                                            rng.choice([0.0, 0.5, 0.9, 1.0]), rng)
        cu_dtype = rng.choice([torch.int32, torch.int64])
        out, accept = greedy_verify_ref(_t(drafts), _t(_cumsum(counts), cu_dtype), _t(targets))
        _check(drafts, counts, targets, out, accept)


def test_launcher_on_cpu_runs_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the kernel must not run on CPU without TRITON_INTERPRET")

    monkeypatch.setattr(gv, "greedy_verify_triton", fail)
    drafts, cu, targets, rows, accepts = HAND_CASES["mixed"]
    out, accept = gv.greedy_verify(_t(drafts), _t(cu), _t(targets))
    assert out.tolist() == rows and accept.tolist() == accepts


@pytest.mark.skipif(_kernel_is_interpreted(), reason="this session already interprets Triton")
def test_interpret_set_after_import_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="before"):
        greedy_verify(_t([1]), _t([1]), _t([1, 2]))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA"):
        gv.greedy_verify_triton(_t([1]), _t([1]), _t([1, 2]))


BAD_INPUTS = {
    "drafts-int32": (_t([1], torch.int32), _t([1]), _t([1, 2]), None),
    "targets-float": (_t([1]), _t([1]), torch.tensor([1.0, 2.0]), None),
    "cu-float": (_t([1]), torch.tensor([1.0]), _t([1, 2]), None),
    "drafts-2d": (_t([1]).view(1, 1), _t([1]), _t([1, 2]), None),
    "targets-too-short": (_t([1]), _t([1]), _t([1]), None),
    "targets-too-long": (_t([1]), _t([1]), _t([1, 2, 3]), None),
    "cu-not-ending-at-total": (_t([1, 2]), _t([1, 1]), _t([1, 2, 3, 4]), None),
    "cu-decreasing": (_t([1, 2]), _t([2, 1, 2]), _t([1, 2, 3, 4, 5]), None),
    "cu-negative": (_t([1]), _t([-1, 1]), _t([1, 2, 3]), None),
    "max-too-small": (_t([1, 2]), _t([2]), _t([1, 2, 3]), 1),
    "max-negative": (_t([]), _t([0]), _t([1]), -1),
    "max-bool": (_t([]), _t([0]), _t([1]), True),
    "drafts-for-empty-batch": (_t([1]), _t([]), _t([1]), None),
    "not-a-tensor": ([1], _t([1]), _t([1, 2]), None),
}


@pytest.mark.parametrize("args", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_inputs_raise_value_error(args: tuple) -> None:
    drafts, cu, targets, max_num = args
    for fn in (greedy_verify_ref, greedy_verify):
        with pytest.raises(ValueError):
            fn(drafts, cu, targets, max_num_draft_tokens=max_num)


# --------------------------------------------------------------------------------------------
# Triton kernel under the interpreter (one subprocess for every case)
# --------------------------------------------------------------------------------------------


def _interpret_cases() -> dict[str, dict[str, Any]]:
    rng = random.Random(1271)
    cases: dict[str, dict[str, Any]] = {}

    def add(name: str, counts: list[int], agree: float, vocab: int = 1271,
            max_num: int | None = None, cu_dtype: torch.dtype = torch.int64,
            launcher: bool = False) -> None:
        drafts, counts, targets = make_case(counts, vocab, agree, rng)
        cases[name] = {
            "func": "specmesh.kernels.greedy_verify." + ("greedy_verify" if launcher
                                                else "greedy_verify_triton"),
            "args": [_t(drafts), _t(_cumsum(counts), cu_dtype), _t(targets)],
            "kwargs": {"max_num_draft_tokens": max_num},
            # the launcher must take the kernel path under TRITON_INTERPRET=1
            "disable": ["specmesh.kernels.greedy_verify.greedy_verify_ref"] if launcher else [],
            "expect": (drafts, counts, targets, max_num),
        }

    for seed in range(8):
        counts = [rng.randrange(0, 6) for _ in range(7)]  # batch 7, up to 5 drafts, some 0
        counts[rng.randrange(7)] = 5
        counts[rng.randrange(7)] = 0
        agree = [0.0, 0.3, 0.7, 0.9, 1.0][seed % 5]
        add(f"batch7-seed{seed}-agree{agree}", counts, agree)
    add("batch7-int32-cu", [5, 0, 3, 1, 0, 4, 2], 0.8, cu_dtype=torch.int32)
    add("batch7-explicit-max", [5, 0, 3, 1, 0, 4, 2], 0.8, max_num=9)
    add("batch1", [4], 0.75)
    add("batch1-all-accepted", [5], 1.0)
    add("batch1-no-drafts", [0], 0.5)
    add("all-zero-drafts", [0, 0, 0, 0, 0], 0.5)
    add("wide-block", [17, 3, 0, 16], 0.95, vocab=2)
    add("v49152", [3, 0, 5, 1, 6], 0.7, vocab=49152)
    add("launcher-batch7", [5, 0, 3, 1, 0, 4, 2], 0.8, launcher=True)
    add("launcher-all-zero", [0, 0, 0], 0.5, launcher=True)
    return cases


INTERPRET_CASES = _interpret_cases()


@pytest.fixture(scope="module")
def interpreted_results(run_interpreted: Any) -> dict[str, dict]:
    cases = [{k: v for k, v in c.items() if k != "expect"} for c in INTERPRET_CASES.values()]
    cases.append({"func": "specmesh.kernels.greedy_verify.greedy_verify_triton",  # errors still raised
                  "args": [_t([1, 2]), _t([2]), _t([1, 2, 3])],
                  "kwargs": {"max_num_draft_tokens": 1}})
    cases.append({"func": "specmesh.kernels.greedy_verify._kernel_is_interpreted", "args": []})
    results = run_interpreted(cases)
    names = [*INTERPRET_CASES, "error-case", "is-interpreted"]
    return dict(zip(names, results, strict=True))


@pytest.mark.parametrize("name", INTERPRET_CASES)
def test_interpreted_kernel_matches_reference(name: str, interpreted_results: dict) -> None:
    result = interpreted_results[name]
    assert "ok" in result, result.get("error")
    out, accept = result["ok"]
    case = INTERPRET_CASES[name]
    ref_out, ref_accept = greedy_verify_ref(*case["args"], **case["kwargs"])
    assert torch.equal(out, ref_out) and torch.equal(accept, ref_accept)
    drafts, counts, targets, max_num = case["expect"]
    _check(drafts, counts, targets, out, accept, max_num)


def test_interpreted_worker_really_interprets(interpreted_results: dict) -> None:
    assert interpreted_results["is-interpreted"] == {"ok": [True]}
    assert interpreted_results["error-case"]["error"].startswith("ValueError")


# --------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernel_matches_reference() -> None:
    rng = random.Random(7)
    for batch, max_drafts in [(1, 1), (7, 5), (64, 8), (256, 16), (3, 0)]:
        for agree in (0.0, 0.6, 0.95, 1.0):
            counts = [rng.randrange(0, max_drafts + 1) for _ in range(batch)]
            drafts, counts, targets = make_case(counts, 49152, agree, rng)
            args = (_t(drafts), _t(_cumsum(counts)), _t(targets))
            ref_out, ref_accept = greedy_verify_ref(*args)
            for cu_dtype in (torch.int64, torch.int32):
                cuda_args = (args[0].cuda(), args[1].to(cu_dtype).cuda(), args[2].cuda())
                out, accept = greedy_verify(*cuda_args)
                assert out.is_cuda and accept.is_cuda
                assert torch.equal(out.cpu(), ref_out) and torch.equal(accept.cpu(), ref_accept)
                out, _ = greedy_verify(*cuda_args, max_num_draft_tokens=max(counts) + 2)
                assert torch.equal(out.cpu()[:, : ref_out.shape[1]], ref_out)
                assert (out.cpu()[:, ref_out.shape[1]:] == PH).all()
