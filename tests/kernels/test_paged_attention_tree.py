"""Token-tree masks (kernels/paged_attention_plan.py) in kernels/paged_attention.py: reference
and Triton kernel (interpreted on CPU, and on CUDA when there is one) against a per-row oracle,
chains untouched bit for bit, and every tree row bit for bit the row its root-to-node path
computes when laid out as a plain chain (what one-token decode steps along that path compute)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_paged_attention_triton import TOL, _args, make_batch

from specmesh.kernels import cpu_attention
from specmesh.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from specmesh.kernels.paged_attention_plan import plan_paged_attention

MOD = "specmesh.kernels.paged_attention."


def tree_mask(parents: list[int]) -> torch.Tensor:
    """Ancestry mask of ``[root] + nodes`` (written out here, independent of engine/)."""
    n = len(parents) + 1
    anc = [{0}]
    for j, p in enumerate(parents):
        anc.append(anc[p + 1] | {j + 1})
    return torch.tensor([[c in anc[i] for c in range(n)] for i in range(n)])


def oracle(batch: dict[str, Any], masks: list[torch.Tensor | None]) -> torch.Tensor:
    """Row j of request b attends (float64) to the positions before its chunk and the chunk
    rows its mask allows."""
    q, k, v = (batch[n].to(torch.float64) for n in ("q", "k_cache", "v_cache"))
    bs, hkv = k.shape[1], k.shape[2]
    group = q.shape[1] // hkv
    out, t = torch.empty_like(q), 0
    for b, (ql, n) in enumerate(zip(batch["query_lens"], batch["kv_lens"])):
        slots = [(batch["block_tables"][b][p // bs], p % bs) for p in range(n)]
        keys = torch.stack([k[blk, off] for blk, off in slots])
        values = torch.stack([v[blk, off] for blk, off in slots])
        mask = masks[b] if masks[b] is not None else torch.ones(ql, ql, dtype=torch.bool).tril()
        for j in range(ql):
            seen = list(range(n - ql)) + [n - ql + c for c in range(ql) if mask[j, c]]
            for h in range(q.shape[1]):
                w = torch.softmax(keys[seen, h // group] @ q[t, h] * batch["scale"], dim=0)
                out[t, h] = w @ values[seen, h // group]
            t += 1
    return out


# request 0: a tree of 9 nodes whose chunk (positions 62 .. 71) crosses a KV tile (64) and a
# block boundary; request 1: a chain; request 2: a small tree at the very start of its KV
TREE = [-1, -1, 0, 1, 1, 2, -1, 5, 3]
CASES = {
    "f32-bs4": ([10, 4, 3], [72, 30, 3], 4, 2, 32, 4, torch.float32),
    "f64-bs16": ([10, 4, 3], [72, 30, 3], 4, 1, 16, 16, torch.float64),
    "bf16-bs3": ([10, 4, 3], [72, 30, 3], 6, 2, 32, 3, torch.bfloat16),
}
MASKS = [tree_mask(TREE), None, tree_mask([-1, -1])]
BATCHES = {name: make_batch(*c[:6], dtype=c[6], seed=7 + i) for i, (name, c) in
           enumerate(CASES.items())}


#: the CPU implementations: the torch reference and the compiled kernel (its own tests are in
#: test_cpu_attention.py; a machine with a compiler must build it)
IMPLS = [pytest.param(paged_attention_ref, id="reference"),
         pytest.param(cpu_attention.paged_attention_cpu, id="compiled",
                      marks=pytest.mark.skipif(not cpu_attention.has_compiler(),
                                               reason="no C++ compiler"))]


@pytest.mark.parametrize("attend", IMPLS)
def test_matches_the_oracle_with_tree_masks(attend):
    for batch in BATCHES.values():
        out = attend(*_args(batch), tree_masks=MASKS)
        torch.testing.assert_close(out.double(), oracle(batch, MASKS), **TOL[out.dtype])


@pytest.mark.parametrize("attend", IMPLS)
def test_chain_rows_and_chain_masks_are_bit_identical(attend):
    batch = BATCHES["f32-bs4"]
    plain = attend(*_args(batch))
    with_trees = attend(*_args(batch), tree_masks=MASKS)
    rows = slice(10, 14)  # request 1, the chain
    assert torch.equal(with_trees[rows], plain[rows])
    chain_mask = [torch.ones(q, q, dtype=torch.bool).tril() for q in batch["query_lens"]]
    assert torch.equal(attend(*_args(batch), tree_masks=chain_mask), plain)
    assert not torch.allclose(with_trees[:10], plain[:10])  # the mask does something


def path_layout(batch: dict[str, Any], masks: list[torch.Tensor | None], b: int,
                j: int) -> list[Any]:
    """Arguments of a one-row batch: row ``j`` of request ``b`` with its path (the chunk rows
    its mask allows, in order) copied to consecutive positions after the KV before the chunk,
    in a copy of the cache; what a one-token decode step at the end of that path reads."""
    ql, n = batch["query_lens"][b], batch["kv_lens"][b]
    table, bs = batch["block_tables"][b], batch["k_cache"].shape[1]
    start = n - ql
    path = [c for c in range(ql) if masks[b][j, c]]
    out = dict(batch)
    for name in ("k_cache", "v_cache"):
        cache = batch[name].clone()
        rows = [cache[table[(start + c) // bs], (start + c) % bs].clone() for c in path]
        for d, row in enumerate(rows):
            cache[table[(start + d) // bs], (start + d) % bs] = row
        out[name] = cache
    t = sum(batch["query_lens"][:b]) + j
    out.update(q=batch["q"][t:t + 1], block_tables=[table], query_lens=[1],
               kv_lens=[start + len(path)])
    return _args(out)


def _tree_rows() -> list[tuple[int, int]]:
    return [(b, j) for b, m in enumerate(MASKS) if m is not None for j in range(m.shape[0])]


#: float32 queries over a 16-bit KV cache (--kv-cache-dtype): the CPU implementations only
KV16_BATCHES = {f"f32-{str(dt)[6:]}-kv": dict(BATCHES["f32-bs4"],
                                              k_cache=BATCHES["f32-bs4"]["k_cache"].to(dt),
                                              v_cache=BATCHES["f32-bs4"]["v_cache"].to(dt))
                for dt in (torch.bfloat16, torch.float16)}


@pytest.mark.parametrize("attend", IMPLS)
def test_16bit_cache_trees_match_the_oracle_and_their_paths(attend):
    for name, batch in KV16_BATCHES.items():
        out = attend(*_args(batch), tree_masks=MASKS)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), oracle(batch, MASKS), **TOL[torch.float32])
        for b, j in _tree_rows():
            t = sum(batch["query_lens"][:b]) + j
            alone = attend(*path_layout(batch, MASKS, b, j))
            assert torch.equal(out[t], alone[0]), f"{name}: request {b} row {j}"


@pytest.mark.parametrize("attend", IMPLS)
def test_tree_rows_equal_their_path_laid_out_as_a_chain(attend):
    """Row j of a tree reads its ancestors where they lie in the chunk (not consecutive: a
    side branch skips the rows of branch 0); its result must still equal, bit for bit, the
    one-row step over the same path laid out consecutively, or output with tree speculation
    drifts from output without it (seen in bf16: 1 of 12 held-out chat prompts)."""
    for name, batch in BATCHES.items():
        out = attend(*_args(batch), tree_masks=MASKS)
        for b, j in _tree_rows():
            t = sum(batch["query_lens"][:b]) + j
            alone = attend(*path_layout(batch, MASKS, b, j))
            assert torch.equal(out[t], alone[0]), f"{name}: request {b} row {j}"


@pytest.mark.parametrize("mask,match", [
    (torch.ones(3, 3, dtype=torch.bool), "lower-triangular"),
    (torch.eye(3, dtype=torch.bool), "root column"),
    (torch.ones(2, 2, dtype=torch.bool).tril(), "bool \\[3, 3\\]"),
])
def test_bad_tree_masks_are_refused(mask, match):
    with pytest.raises(ValueError, match=match):
        plan_paged_attention([3], [5], [[0, 1]], 4, tree_masks=[mask])


@pytest.fixture(scope="module")
def interpreted(run_interpreted: Any) -> list[dict]:
    cases = []
    for batch in BATCHES.values():
        cases.append({"func": MOD + "paged_attention_triton", "args": _args(batch),
                      "kwargs": {"tree_masks": MASKS}})
        cases.append({"func": MOD + "paged_attention_triton", "args": _args(batch)})
    for batch in BATCHES.values():
        for b, j in _tree_rows():
            cases.append({"func": MOD + "paged_attention_triton",
                          "args": path_layout(batch, MASKS, b, j)})
    return run_interpreted(cases, timeout=300)


def test_interpreted_kernel_with_tree_masks_matches_reference(interpreted: list[dict]) -> None:
    for i, batch in enumerate(BATCHES.values()):
        tree, plain = interpreted[2 * i], interpreted[2 * i + 1]
        assert "ok" in tree, tree.get("error")
        ref = paged_attention_ref(*_args(batch), tree_masks=MASKS)
        torch.testing.assert_close(tree["ok"][0], ref, **TOL[ref.dtype])
        torch.testing.assert_close(tree["ok"][0].double(), oracle(batch, MASKS),
                                   **TOL[ref.dtype])
        # the chain request's rows do not change when a tree shares its launch
        assert torch.equal(tree["ok"][0][10:14], plain["ok"][0][10:14])


def test_interpreted_kernel_tree_rows_equal_their_path_as_a_chain(interpreted: list[dict]):
    rows = _tree_rows()
    alone = iter(interpreted[2 * len(BATCHES):])
    for i, name in enumerate(BATCHES):
        tree = interpreted[2 * i]["ok"][0]
        for b, j in rows:
            one = next(alone)
            assert "ok" in one, one.get("error")
            t = sum(BATCHES[name]["query_lens"][:b]) + j
            assert torch.equal(tree[t], one["ok"][0][0]), f"{name}: request {b} row {j}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernel_with_tree_masks_matches_reference() -> None:
    for batch in BATCHES.values():
        cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        ref = paged_attention_ref(*_args(batch), tree_masks=MASKS)
        out = paged_attention_triton(*_args(cuda), tree_masks=MASKS)
        torch.testing.assert_close(out.cpu(), ref, **TOL[ref.dtype])
        plain = paged_attention_triton(*_args(cuda))
        assert torch.equal(out[10:14], plain[10:14])
