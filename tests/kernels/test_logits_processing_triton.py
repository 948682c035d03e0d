"""The Triton kernel of kernels/logits_processing.py under the interpreter (a subprocess) against
the torch reference: random mixed batches on odd shapes and a 49,152-token vocabulary (every
option on and off per row, float32 / float64 / bfloat16 logits), top-k ties, top-p boundaries
inside a run of equal values, -inf logits, greedy rows (float64 ties float32 would merge), and
the launcher taking the kernel path (up to MAX_KERNEL_VOCAB; the reference past it); on
CUDA the same comparisons. Supports (which tokens
survive) are equal; probabilities agree to float32 rounding (module docstring)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from specmesh.kernels.logits_processing import process_logits, process_logits_ref

MOD = "specmesh.kernels.logits_processing."


def _random_case(rows: int, vocab: int, seed: int, dtype=torch.float32, scale=3.0) -> list:
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * scale).to(dtype)
    t = torch.rand(rows, generator=gen) * 1.5 + 0.2
    k = torch.randint(-1, vocab + 2, (rows,), generator=gen)
    p = torch.rand(rows, generator=gen) * 0.9 + 0.1
    m = torch.rand(rows, generator=gen) * 0.2
    t[0], k[1 % rows], p[2 % rows], m[3 % rows] = 0.0, 0, 1.0, 0.0  # greedy; options off
    k[rows - 1] = min(5, vocab - 1)
    return [logits, t, k, p, m]


def _hand_cases() -> dict[str, list]:
    f = lambda v: torch.tensor(v, dtype=torch.float32)
    i = lambda v: torch.tensor(v, dtype=torch.int64)
    ties = torch.log(torch.tensor([[0.1, 0.1, 0.1, 0.1, 0.6], [0.2, 0.2, 0.2, 0.2, 0.2]]))
    inf = torch.tensor([[-math.inf, 0.0, 1.0, -math.inf, 1.0]])
    near = torch.tensor([[1.0, 1.0 + 1e-12, 0.5]], dtype=torch.float64)
    return {
        "top-p-splits-ties": [ties, f([1.0, 1.0]), None, f([0.75, 0.5]), None],
        "top-k-keeps-ties": [torch.tensor([[3.0, 1.0, 3.0, 2.0, 3.0]]), f([1.0]), i([2]), None,
                             None],
        "inf-logits": [inf, f([0.8]), i([3]), f([0.9]), f([0.1])],
        "greedy-float64-near-tie": [near, f([0.0]), None, None, None],
        "no-options": [torch.randn(3, 50, generator=torch.Generator().manual_seed(2)),
                       f([1.0, 0.5, 2.0]), None, None, None],
    }


def _cases() -> dict[str, dict[str, Any]]:
    cases = {}
    for name, (rows, vocab, dtype) in {
            "b7-v1271": (7, 1271, torch.float32), "b5-v4099": (5, 4099, torch.float32),
            "b5-v37-float64": (5, 37, torch.float64), "b4-v100-bf16": (4, 100, torch.bfloat16),
            "b4-v49152": (4, 49152, torch.float32), "b2-v1": (2, 1, torch.float32)}.items():
        cases[name] = {"func": MOD + "process_logits_triton",
                       "args": _random_case(rows, vocab, len(cases), dtype)}
    for name, args in _hand_cases().items():
        cases[name] = {"func": MOD + "process_logits_triton", "args": args}
    cases["launcher"] = {"func": MOD + "process_logits", "args": _random_case(4, 257, 9),
                         "disable": [MOD + "process_logits_ref"]}
    # past MAX_KERNEL_VOCAB the launcher keeps the reference (the kernel is disabled)
    cases["launcher-large-vocab"] = {"func": MOD + "process_logits",
                                     "args": _random_case(2, 8193, 10),
                                     "disable": [MOD + "process_logits_triton"]}
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def interpreted(run_interpreted: Any) -> dict[str, dict]:
    cases = [dict(c) for c in CASES.values()]
    cases.append({"func": MOD + "_kernel_is_interpreted", "args": []})
    results = run_interpreted(cases)
    return dict(zip([*CASES, "is-interpreted"], results, strict=True))


def _compare(out: torch.Tensor, args: list) -> None:
    ref = process_logits_ref(*args)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.equal(out > 0, ref > 0), (out > 0).ne(ref > 0).nonzero().tolist()
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", CASES)
def test_interpreted_kernel_matches_reference(name: str, interpreted: dict) -> None:
    result = interpreted[name]
    assert "ok" in result, result.get("error")
    (out,) = result["ok"]
    _compare(out, CASES[name]["args"])


def test_hand_cases_are_what_the_reference_says(interpreted: dict) -> None:
    (out,) = interpreted["top-p-splits-ties"]["ok"]
    # ascending stable order: the two lowest-index 0.1s go (0.1, 0.2 <= 0.25), the rest stay
    assert (out[0] > 0).tolist() == [False, False, True, True, True]
    (out,) = interpreted["top-k-keeps-ties"]["ok"]
    assert (out[0] > 0).tolist() == [True, False, True, False, True]
    (out,) = interpreted["greedy-float64-near-tie"]["ok"]
    assert out[0].tolist() == [0.0, 1.0, 0.0]
    assert interpreted["is-interpreted"] == {"ok": [True]}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernel_matches_reference() -> None:
    for args in [_random_case(64, 8192, 1), _random_case(7, 1271, 2),
                 _random_case(16, 4099, 3, torch.bfloat16), *_hand_cases().values()]:
        cuda = [a.cuda() if a is not None else None for a in args]
        out = process_logits(*cuda)
        assert out.is_cuda
        _compare(out.cpu(), args)
