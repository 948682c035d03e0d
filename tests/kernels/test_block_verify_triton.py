"""The Triton kernel of kernels/block_verify.py against the torch reference, exactly
(``torch.equal`` on tokens and accept lengths): under ``TRITON_INTERPRET=1`` in a subprocess
(odd shapes: batch 1..5, 0..6 drafts per request, ragged, vocabularies from 1 to 49,152) and on
CUDA."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from test_block_verify import make_case

from specmesh.kernels.constants import PLACEHOLDER_TOKEN_ID
from specmesh.kernels.block_verify import block_verify, block_verify_ref

PH = PLACEHOLDER_TOKEN_ID
MOD = "specmesh.kernels.block_verify."


def _t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _interpret_cases() -> dict[str, dict[str, Any]]:
    gen = torch.Generator().manual_seed(2403)
    rng = random.Random(2403)
    cases: dict[str, dict[str, Any]] = {}

    def add(name: str, counts: list[int], vocab: int, full: bool, max_num: int | None = None,
            cu_dtype: torch.dtype = torch.int64, launcher: bool = False,
            dtype: torch.dtype = torch.float32, **kw: Any) -> None:
        case = make_case(counts, vocab, full, gen, dtype, **kw)
        case["args"][1] = case["args"][1].to(cu_dtype)
        cases[name] = {
            "func": MOD + ("block_verify" if launcher else "block_verify_triton"),
            "args": case["args"], "kwargs": {"max_num_draft_tokens": max_num},
            "disable": [MOD + "block_verify_ref"] if launcher else [],
        }

    for seed in range(10):
        batch = seed % 5 + 1
        counts = [rng.randrange(0, 7) for _ in range(batch)]
        vocab = [2, 3, 17, 1000, 257][seed % 5]
        full = seed % 2 == 0
        add(f"b{batch}-v{vocab}-seed{seed}-{'full' if full else 'one-hot'}", counts, vocab,
            full, dtype=torch.float64 if seed % 3 == 0 else torch.float32,
            sharp=rng.choice([1.0, 3.0, 6.0]), draft_from_target=rng.choice([0.0, 0.7, 0.95]))
    add("ragged-0-to-6", [0, 6, 1, 5, 2], 101, True, draft_from_target=0.9, sharp=2.0)
    add("v49152-full", [3, 0, 5, 1, 6], 49152, True, draft_from_target=0.9, sharp=4.0)
    add("v49152-one-hot", [2, 4, 0], 49152, False, sharp=8.0)
    add("v49152-float64-full", [2, 6], 49152, True, dtype=torch.float64, draft_from_target=0.95,
        sharp=4.0)
    add("v4099-odd-chunks", [1, 2, 6], 4099, True, draft_from_target=0.8)
    add("v1-single-token", [2, 0], 1, False)
    add("int32-cu-explicit-max", [5, 0, 3, 1], 257, False, max_num=8, cu_dtype=torch.int32)
    add("all-zero-drafts", [0, 0, 0, 0, 0], 333, True)
    add("high-acceptance", [6, 6, 6], 7, True, draft_from_target=0.99, sharp=0.5)
    add("launcher-full", [5, 0, 3, 1, 4], 500, True, launcher=True, draft_from_target=0.8)
    add("launcher-one-hot", [2, 2], 500, False, launcher=True)

    def hand(name: str, *args: Any) -> None:
        cases[name] = {"func": MOD + "block_verify_triton", "args": list(args), "kwargs": {},
                       "disable": []}

    # vanished residual (fallback to the target row)
    hand("residual-fallback", _t([0]), _t([1]), torch.tensor([[0.5, 0.3, 0.2]]),
         torch.tensor([[0.1, 0.2, 0.1], [0.3, 0.3, 0.4]]), torch.tensor([0.9], dtype=torch.float64),
         torch.tensor([[1.0, 0.5, 2.0]]))
    # the paper's example: drafts (a, b) pass jointly whatever eta_1
    hand("joint-acceptance", _t([0, 1]), _t([2]),
         torch.tensor([[2 / 3, 1 / 3]] * 2, dtype=torch.float64),
         torch.tensor([[1 / 3, 2 / 3]] * 3, dtype=torch.float64),
         torch.tensor([0.9, 0.5], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64))
    # one-hot target rows (greedy): zero denominators (p_i = 1, S_i = 0) stop there
    onehot = torch.nn.functional.one_hot(_t([3, 4, 6, 0, 2, 1, 2, 6]), 7).float()
    hand("greedy-target", _t([3, 4, 5, 1, 2]), _t([3, 3, 5]), None, onehot,
         torch.full((5,), 0.5, dtype=torch.float64), torch.ones(3, 7))
    # ties across vocabulary chunks: the first index must win
    ties_vocab = 9000
    hand("ties-across-chunks", _t([]), _t([0, 0]), None,
         torch.full((2, ties_vocab), 1.0 / ties_vocab), torch.zeros(0), torch.ones(2, ties_vocab))
    return cases


INTERPRET_CASES = _interpret_cases()


@pytest.fixture(scope="module")
def interpreted_results(run_interpreted: Any) -> dict[str, dict]:
    cases = [dict(c) for c in INTERPRET_CASES.values()]
    first = INTERPRET_CASES["launcher-full"]["args"]
    cases.append({"func": MOD + "block_verify_triton", "args": [*first, 1]})  # errors raised
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
    ref_out, ref_accept = block_verify_ref(*case["args"], **case["kwargs"])
    assert out.dtype == torch.int64 and accept.dtype == torch.int64
    assert torch.equal(out, ref_out) and torch.equal(accept, ref_accept)


def test_interpreted_special_cases(interpreted_results: dict) -> None:
    assert interpreted_results["residual-fallback"]["ok"][0].tolist() == [[1, PH]]
    assert interpreted_results["joint-acceptance"]["ok"][0].tolist() == [[0, 1, 1]]
    assert interpreted_results["greedy-target"]["ok"][0].tolist() == \
        [[3, 4, 6, PH], [2, PH, PH, PH], [1, 2, 6, PH]]
    assert interpreted_results["ties-across-chunks"]["ok"][0].tolist() == [[0], [0]]
    accepted = sum(int(r["ok"][1].sum()) for n, r in interpreted_results.items()
                   if n.startswith(("b", "v49152", "ragged", "high")))
    assert accepted > 0  # the cases exercise acceptance, not only rejection at 0


def test_interpreted_worker_really_interprets(interpreted_results: dict) -> None:
    assert interpreted_results["is-interpreted"] == {"ok": [True]}
    assert interpreted_results["error-case"]["error"].startswith("ValueError")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernel_matches_reference() -> None:
    gen = torch.Generator().manual_seed(11)
    rng = random.Random(11)
    for batch, max_drafts in [(1, 1), (5, 6), (64, 8), (256, 16), (3, 0)]:
        for full in (False, True):
            for dtype in (torch.float32, torch.float64):
                counts = [rng.randrange(0, max_drafts + 1) for _ in range(batch)]
                case = make_case(counts, 49152, full, gen, dtype, sharp=4.0,
                                 draft_from_target=0.9)
                ref_out, ref_accept = block_verify_ref(*case["args"])
                for cu_dtype in (torch.int64, torch.int32):
                    args = [a.cuda() if a is not None else None for a in case["args"]]
                    args[1] = args[1].to(cu_dtype)
                    out, accept = block_verify(*args)
                    assert out.is_cuda and accept.is_cuda
                    assert torch.equal(out.cpu(), ref_out), (batch, full, dtype)
                    assert torch.equal(accept.cpu(), ref_accept)
