"""The Triton kernels of kernels/tree_walk.py and kernels/tree_rejection_sample.py against the
torch references, exactly (``torch.equal`` on tokens, accept lengths and accepted node ids):
under ``TRITON_INTERPRET=1`` in a subprocess (random and hand-built trees, ragged batches with
empty trees, chains, odd vocabularies from 1 to 49,152, float32/float64, noise per row or per
request) and on CUDA."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from test_tree_verify import make_tree_case, make_walk_case

from specmesh.kernels.constants import PLACEHOLDER_TOKEN_ID
from specmesh.kernels.tree_rejection_sample import tree_rejection_sample, tree_rejection_sample_ref
from specmesh.kernels.tree_walk import tree_walk, tree_walk_ref

PH = PLACEHOLDER_TOKEN_ID
MOD = {"tree_walk": "specmesh.kernels.tree_walk.",
       "tree_rejection_sample": "specmesh.kernels.tree_rejection_sample."}


def _t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _interpret_cases() -> dict[str, dict[str, Any]]:
    gen = torch.Generator().manual_seed(2305)
    rng = random.Random(2305)
    cases: dict[str, dict[str, Any]] = {}

    def case(name: str, op: str, args: list[Any], max_depth: int | None = None,
             launcher: bool = False) -> None:
        cases[name] = {"func": MOD[op] + (op if launcher else op + "_triton"), "args": args,
                       "kwargs": {"max_depth": max_depth},
                       "disable": [MOD[op] + op + "_ref"] if launcher else []}

    def walk(name: str, counts: list[int], vocab: int, parents: list[int] | None = None,
             cu_dtype: torch.dtype = torch.int64, **kw: Any) -> None:
        args = make_walk_case(counts, vocab, rng, parents)
        args[1] = args[1].to(cu_dtype)
        case(name, "tree_walk", args, **kw)

    def sample(name: str, counts: list[int], vocab: int, full: bool,
               dtype: torch.dtype = torch.float32, per_row: bool = True,
               parents: list[int] | None = None, cu_dtype: torch.dtype = torch.int64,
               max_depth: int | None = None, launcher: bool = False, **kw: Any) -> None:
        args = make_tree_case(counts, vocab, full, gen, rng, dtype, per_row=per_row,
                              parents=parents, **kw)
        args[1] = args[1].to(cu_dtype)
        case(name, "tree_rejection_sample", args, max_depth, launcher)

    for seed in range(6):
        counts = [rng.randrange(0, 10) for _ in range(seed % 5 + 2)]
        walk(f"walk-random-{seed}", counts, [2, 3, 5][seed % 3])
    walk("walk-ragged-empty", [0, 7, 0, 0, 1, 9], 3)
    walk("walk-all-empty", [0, 0, 0], 5)
    walk("walk-chain", [6, 2, 0, 5], 2, parents=[j - 1 for k in (6, 2, 0, 5) for j in range(k)])
    walk("walk-wide-37-nodes", [37, 3], 2)
    walk("walk-int32-cu-explicit-depth", [4, 0, 6], 3, cu_dtype=torch.int32, max_depth=9)
    walk("walk-launcher", [5, 1, 8], 3, launcher=True)

    for seed in range(8):
        counts = [rng.randrange(0, 8) for _ in range(seed % 4 + 1)]
        vocab = [2, 3, 17, 1000, 257][seed % 5]
        full = seed % 2 == 0
        dtype = torch.float64 if seed % 3 == 0 else torch.float32
        sample(f"sample-b{len(counts)}-v{vocab}-seed{seed}-{'full' if full else 'one-hot'}",
               counts, vocab, full, dtype, per_row=seed % 4 != 1,
               sharp=rng.choice([1.0, 3.0, 6.0]), draft_from_target=rng.choice([0.0, 0.7, 0.95]))
    sample("sample-ragged-empty", [0, 6, 0, 3, 0], 101, True, draft_from_target=0.9, sharp=2.0)
    sample("sample-all-empty", [0, 0, 0, 0], 333, True)
    sample("sample-chain-full", [5, 0, 3], 64, True, parents=[-1, 0, 1, 2, 3, -1, 0, 1],
           draft_from_target=0.9, sharp=3.0)
    sample("v49152-full", [4, 0, 5, 2], 49152, True, draft_from_target=0.9, sharp=4.0)
    sample("v49152-one-hot", [3, 5, 0], 49152, False, sharp=8.0, draft_from_target=0.9)
    sample("v49152-float64-full-request-noise", [3, 4], 49152, True, dtype=torch.float64,
           per_row=False, draft_from_target=0.95, sharp=4.0)
    sample("v4099-odd-chunks", [2, 5, 1], 4099, True, draft_from_target=0.8)
    sample("v1-single-token", [2, 0, 3], 1, False)
    sample("int32-cu-explicit-depth", [5, 0, 3, 1], 257, False, cu_dtype=torch.int32,
           max_depth=8)
    sample("wide-tree", [19, 3], 5, True, draft_from_target=0.6)
    sample("launcher-full", [5, 0, 3, 1, 4], 500, True, launcher=True, draft_from_target=0.8)
    sample("launcher-one-hot", [3, 2], 500, False, launcher=True, draft_from_target=0.8,
           sharp=4.0)

    def hand(name: str, *args: Any) -> None:
        case(name, "tree_rejection_sample", list(args))

    # the second sibling sees the normalized residual (0, 0.6, 0.4): 0.55 < 0.6 accepts
    hand("normalized-residual", _t([0, 1]), _t([2]), _t([-1, -1]), None,
         torch.tensor([[0.5, 0.3, 0.2], [1.0, 0, 0], [0, 1.0, 0]]),
         torch.tensor([0.51, 0.55], dtype=torch.float64), torch.ones(3, 3))
    # the residual vanishes at the second sibling: it keeps (0, 0, 1)
    hand("vanished-residual", _t([0, 1]), _t([2]), _t([-1, -1]),
         torch.tensor([[0.75, 0.25, 0.0], [0.0, 0.0, 1.0]]),
         torch.tensor([[0.5, 0.25, 0.25], [0.2, 0.3, 0.5], [0.1, 0.1, 0.8]]),
         torch.tensor([0.9, 0.1], dtype=torch.float64), torch.tensor([[0.1, 1.0, 1.0]] * 3))
    # per-row noise: the stop node's row
    hand("noise-of-the-stop-row", _t([0, 3]), _t([2]), _t([-1, 0]), None,
         torch.full((3, 4), 0.25), torch.zeros(2, dtype=torch.float64),
         torch.tensor([[1, 1, 1, 0.1], [1, 1, 0.1, 1], [1, 0.1, 1, 1]]))
    ties_vocab = 9000  # ties across vocabulary chunks: the first index must win
    hand("ties-across-chunks", _t([]), _t([0, 0]), _t([]), None,
         torch.full((2, ties_vocab), 1.0 / ties_vocab), torch.zeros(0),
         torch.ones(2, ties_vocab))
    return cases


INTERPRET_CASES = _interpret_cases()


@pytest.fixture(scope="module")
def interpreted_results(run_interpreted: Any) -> dict[str, dict]:
    cases = [dict(c) for c in INTERPRET_CASES.values()]
    bad = INTERPRET_CASES["walk-random-0"]["args"]
    cases.append({"func": MOD["tree_walk"] + "tree_walk_triton",
                  "args": [*bad[:2], -bad[2] - 5, bad[3]]})
    cases += [{"func": mod + "_kernel_is_interpreted", "args": []} for mod in MOD.values()]
    results = run_interpreted(cases)
    names = [*INTERPRET_CASES, "error-case", *(f"is-interpreted-{op}" for op in MOD)]
    return dict(zip(names, results, strict=True))


def _reference(case: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    fn = tree_walk_ref if "tree_walk" in case["func"] else tree_rejection_sample_ref
    return fn(*case["args"], **case["kwargs"])


@pytest.mark.parametrize("name", INTERPRET_CASES)
def test_interpreted_kernel_matches_reference(name: str, interpreted_results: dict) -> None:
    result = interpreted_results[name]
    assert "ok" in result, result.get("error")
    got = result["ok"]
    want = _reference(INTERPRET_CASES[name])
    assert len(got) == 3
    for g, w in zip(got, want):
        assert g.dtype == torch.int64 and torch.equal(g, w), (name, g, w)


def test_interpreted_special_cases(interpreted_results: dict) -> None:
    assert interpreted_results["normalized-residual"]["ok"][0].tolist() == [[1, 1]]
    assert interpreted_results["vanished-residual"]["ok"][0].tolist() == [[2, PH]]
    assert interpreted_results["noise-of-the-stop-row"]["ok"][0].tolist() == [[0, 3, 1]]
    assert interpreted_results["ties-across-chunks"]["ok"][0].tolist() == [[0], [0]]
    results = {n: r["ok"] for n, r in interpreted_results.items() if n in INTERPRET_CASES}
    for prefix in ("walk", "sample", "v49152"):
        accepted = [r[2] for n, r in results.items() if n.startswith(prefix)]
        assert sum(int((a >= 0).sum()) for a in accepted) > 0, prefix  # paths were accepted
        assert any(bool((a >= 1).any()) for a in accepted), prefix  # beyond node 0


def test_interpreted_worker_really_interprets(interpreted_results: dict) -> None:
    for op in MOD:
        assert interpreted_results[f"is-interpreted-{op}"] == {"ok": [True]}
    assert interpreted_results["error-case"]["error"].startswith("ValueError")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernels_match_references() -> None:
    gen = torch.Generator().manual_seed(13)
    rng = random.Random(13)
    for batch, max_nodes in [(1, 1), (7, 6), (64, 12), (256, 24), (3, 0)]:
        counts = [rng.randrange(0, max_nodes + 1) for _ in range(batch)]
        walk_args = make_walk_case(counts, 3, rng)
        want = tree_walk_ref(*walk_args)
        for cu_dtype in (torch.int64, torch.int32):
            args = [a.cuda() for a in walk_args]
            args[1] = args[1].to(cu_dtype)
            got = tree_walk(*args)
            assert all(g.is_cuda and torch.equal(g.cpu(), w) for g, w in zip(got, want))
        for full in (False, True):
            for dtype in (torch.float32, torch.float64):
                for per_row in (True, False):
                    args = make_tree_case(counts, 49152, full, gen, rng, dtype, sharp=4.0,
                                          draft_from_target=0.9, per_row=per_row)
                    want = tree_rejection_sample_ref(*args)
                    cuda_args = [a.cuda() if a is not None else None for a in args]
                    got = tree_rejection_sample(*cuda_args)
                    assert all(g.is_cuda for g in got)
                    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want)), \
                        (batch, full, dtype, per_row)
