"""The dense penalty kernel of kernels/logits_penalties.py (repetition, frequency, presence)
under the Triton interpreter (a subprocess) against the torch reference: random rows over odd
vocabularies and SmolLM2's 49,152 (float32 and float64, some rows neutral, -inf logits, zero
and negative penalties), counts only, seen only, and the launcher taking the kernel path; on
CUDA the same comparisons."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from specmesh.kernels.logits_penalties import dense_penalties, dense_penalties_ref

MOD = "specmesh.kernels.logits_penalties."


def _case(rows: int, vocab: int, seed: int, dtype=torch.float32, counts=True,
          seen=True) -> list:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    x[0, : min(3, vocab)] = -math.inf
    c = torch.randint(0, 4, (rows, vocab), generator=gen).to(torch.float32) * \
        (torch.rand(rows, vocab, generator=gen) < 0.1)
    s = (torch.rand(rows, vocab, generator=gen) < 0.2) | (c > 0)
    presence = torch.rand(rows, generator=gen) * 4 - 2
    frequency = torch.rand(rows, generator=gen) * 4 - 2
    repetition = torch.rand(rows, generator=gen) * 1.9 + 0.1
    presence[-1], frequency[-1], repetition[-1] = 0.0, 0.0, 1.0  # a neutral row
    return [x, c if counts else None, s if seen else None, presence, frequency, repetition]


CASES: dict[str, dict[str, Any]] = {
    "b5-v1271": {"func": MOD + "dense_penalties_triton", "args": _case(5, 1271, 0)},
    "b3-v49152": {"func": MOD + "dense_penalties_triton", "args": _case(3, 49152, 1)},
    "b4-v37-float64": {"func": MOD + "dense_penalties_triton",
                       "args": _case(4, 37, 2, torch.float64)},
    "counts-only": {"func": MOD + "dense_penalties_triton",
                    "args": _case(3, 2050, 3, seen=False)},
    "seen-only": {"func": MOD + "dense_penalties_triton",
                  "args": _case(3, 2050, 4, counts=False)},
    "launcher": {"func": MOD + "dense_penalties", "args": _case(2, 999, 5),
                 "disable": [MOD + "dense_penalties_ref"]},
}


@pytest.fixture(scope="module")
def interpreted(run_interpreted: Any) -> dict[str, dict]:
    cases = [dict(c) for c in CASES.values()]
    cases.append({"func": MOD + "_kernel_is_interpreted", "args": []})
    return dict(zip([*CASES, "is-interpreted"], run_interpreted(cases), strict=True))


@pytest.mark.parametrize("name", CASES)
def test_interpreted_kernel_equals_reference(name: str, interpreted: dict) -> None:
    result = interpreted[name]
    assert "ok" in result, result.get("error")
    (out,) = result["ok"]
    ref = dense_penalties_ref(*CASES[name]["args"])
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    assert not torch.equal(ref, CASES[name]["args"][0])  # the case penalizes something
    assert interpreted["is-interpreted"] == {"ok": [True]}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernel_matches_reference() -> None:
    for case in CASES.values():
        args = case["args"]
        out = dense_penalties(*[a.cuda() if a is not None else None for a in args])
        assert out.is_cuda
        torch.testing.assert_close(out.cpu(), dense_penalties_ref(*args), rtol=1e-6, atol=1e-6)
