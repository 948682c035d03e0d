"""Tests of the Triton kernel of kernels/paged_attention.py: interpreted on CPU (one subprocess
with ``TRITON_INTERPRET=1`` for every case) against the torch reference on ragged batches with
odd shapes, batch invariance (a row equals the same row computed alone, exactly), the
validation errors, and on CUDA (gpu-marked). The reference's own tests are in
test_paged_attention.py."""

from __future__ import annotations

import importlib
import random
from typing import Any

import pytest
import torch

from specmesh.kernels import cpu_attention
from specmesh.kernels.cpu_attention import paged_attention_cpu
from specmesh.kernels.paged_attention import (
    _kernel_is_interpreted,
    paged_attention,
    paged_attention_ref,
    paged_attention_triton,
)
from specmesh.kernels.paged_attention_plan import plan_paged_attention

pa = importlib.import_module("specmesh.kernels.paged_attention")
MOD = "specmesh.kernels.paged_attention."
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float64: dict(atol=1e-12, rtol=1e-12),
       torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2), torch.float16: dict(atol=1e-3, rtol=1e-3)}


def make_batch(query_lens: list[int], kv_lens: list[int], heads: int, kv_heads: int,
               head_dim: int, block_size: int, dtype: torch.dtype = torch.float32,
               seed: int = 0, spare_blocks: int = 3, pad_columns: int = 0,
               ) -> dict[str, Any]:
    """A ragged batch over a paged cache whose blocks are handed out in a shuffled order (each
    request's blocks are neither contiguous nor increasing); table rows padded with a valid id
    (``pad_columns`` more than the widest request needs)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(needed) + pad_columns
    tables, i = [], 0
    for k in needed:
        tables.append(order[i:i + k] + [order[-1]] * (width - k))
        i += k
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return {
        "q": torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(dtype),
        "k_cache": torch.randn(shape, generator=gen).to(dtype),
        "v_cache": torch.randn(shape, generator=gen).to(dtype),
        "block_tables": tables, "query_lens": list(query_lens), "kv_lens": list(kv_lens),
        "scale": head_dim ** -0.5,
    }


ARG_ORDER = ("q", "k_cache", "v_cache", "block_tables", "query_lens", "kv_lens", "scale")


def _args(batch: dict[str, Any]) -> list[Any]:
    return [batch[name] for name in ARG_ORDER]


def alone(batch: dict[str, Any], token: int) -> dict[str, Any]:
    """Query token ``token`` of ``batch`` as a one-token request with its visible length."""
    b, row = 0, token
    while row >= batch["query_lens"][b]:
        row -= batch["query_lens"][b]
        b += 1
    visible = batch["kv_lens"][b] - batch["query_lens"][b] + row + 1
    return {**batch, "q": batch["q"][token:token + 1].clone(),
            "block_tables": [batch["block_tables"][b]], "query_lens": [1], "kv_lens": [visible]}


def oracle(batch: dict[str, Any]) -> torch.Tensor:
    """The semantics spelled out with a python loop per query row, in float64."""
    q, k, v = (batch[n].to(torch.float64) for n in ("q", "k_cache", "v_cache"))
    bs, hkv = k.shape[1], k.shape[2]
    group = q.shape[1] // hkv
    out, t = torch.empty_like(q), 0
    for b, (ql, n) in enumerate(zip(batch["query_lens"], batch["kv_lens"])):
        slots = [(batch["block_tables"][b][p // bs], p % bs) for p in range(n)]
        keys = torch.stack([k[blk, off] for blk, off in slots])  # [n, Hkv, D]
        values = torch.stack([v[blk, off] for blk, off in slots])
        for j in range(ql):
            m = n - ql + j + 1
            for h in range(q.shape[1]):
                w = torch.softmax(keys[:m, h // group] @ q[t, h] * batch["scale"], dim=0)
                out[t, h] = w @ values[:m, h // group]
            t += 1
    return out


# --------------------------------------------------------------------------------------------
# Interpreted kernel (one subprocess for every case)
# --------------------------------------------------------------------------------------------

# name: (query_lens, kv_lens, H, Hkv, D, block_size, dtype); every batch mixes 1-token decode
# rows, verify chunks (q = 5) and a prefill chunk with q == kv; several kv_lens are not
# multiples of the block size, and some exceed one KV tile (64 positions).
SHAPES: dict[str, tuple] = {
    "mha-f32-bs3-d64": ([1, 5, 9, 1], [7, 20, 9, 70], 4, 4, 64, 3, torch.float32),
    "gqa9x3-f32-bs16-d64": ([5, 1, 12, 3], [37, 1, 12, 130], 9, 3, 64, 16, torch.float32),
    "gqa4x1-f32-bs1-d40": ([1, 5, 6], [50, 17, 6], 4, 1, 40, 1, torch.float32),
    "gqa9x3-f32-bs3-d40": ([6, 1, 5], [6, 65, 64], 9, 3, 40, 3, torch.float32),
    "gqa9x3-bf16-bs16-d64": ([5, 1, 12, 3], [37, 1, 12, 130], 9, 3, 64, 16, torch.bfloat16),
    "gqa4x1-bf16-bs3-d40": ([1, 5, 6], [50, 17, 6], 4, 1, 40, 3, torch.bfloat16),
    "mha-f16-bs16-d80": ([1, 5, 4], [33, 18, 4], 2, 2, 80, 16, torch.float16),
    "gqa9x3-f64-bs3-d40": ([1, 5, 7], [40, 5, 7], 9, 3, 40, 3, torch.float64),
    "gqa4x1-f64-bs16-d64": ([5, 1], [21, 66], 4, 1, 64, 16, torch.float64),
}
BATCHES = {name: make_batch(*s[:6], dtype=s[6], seed=i) for i, (name, s) in
           enumerate(SHAPES.items())}
INVARIANCE = ("gqa9x3-f32-bs16-d64", "gqa9x3-bf16-bs16-d64", "gqa4x1-f32-bs1-d40")


def _strided(batch: dict[str, Any]) -> dict[str, Any]:
    """The same values with non-contiguous q (a slice of wider rows) and caches (a permuted
    [blocks, Hkv, block_size, D] layout, one layer of a larger cache)."""
    q = batch["q"]
    wide = torch.zeros(q.shape[0], q.shape[1], q.shape[2] + 8, dtype=q.dtype)
    wide[..., 3:3 + q.shape[2]] = q
    caches = {}
    for name in ("k_cache", "v_cache"):
        c = batch[name]
        store = torch.zeros((2, c.shape[0], c.shape[2], c.shape[1], c.shape[3]), dtype=c.dtype)
        store[1] = c.permute(0, 2, 1, 3)
        caches[name] = store[1].permute(0, 2, 1, 3)
        assert not caches[name].is_contiguous()
    return {**batch, "q": wide[..., 3:3 + q.shape[2]], **caches}


def _padded(batch: dict[str, Any], query_len: int, kv_len: int, pad_columns: int,
            ) -> dict[str, Any]:
    """``batch`` with one more request (on new blocks) and ``pad_columns`` more table columns
    (padded with block 0)."""
    extra = make_batch([query_len], [kv_len], batch["q"].shape[1], batch["k_cache"].shape[2],
                       batch["q"].shape[2], batch["k_cache"].shape[1], batch["q"].dtype,
                       seed=99, spare_blocks=0)
    base = batch["k_cache"].shape[0]
    tables = batch["block_tables"] + [[base + i for i in extra["block_tables"][0]]]
    width = max(map(len, tables)) + pad_columns
    return {**batch, "q": torch.cat([batch["q"], extra["q"]]),
            **{n: torch.cat([batch[n], extra[n]]) for n in ("k_cache", "v_cache")},
            "block_tables": [t + [0] * (width - len(t)) for t in tables],
            "query_lens": batch["query_lens"] + [query_len],
            "kv_lens": batch["kv_lens"] + [kv_len]}


def _plan_call(batch: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    return {"__call__": "specmesh.kernels.paged_attention_plan.plan_paged_attention",
            "args": [batch["query_lens"], batch["kv_lens"], batch["block_tables"],
                     batch["k_cache"].shape[1]], "kwargs": kwargs}


def _interpret_cases() -> dict[str, dict[str, Any]]:
    cases: dict[str, dict[str, Any]] = {}

    def add(name: str, batch: dict[str, Any], launcher: bool = False, **kwargs: Any) -> None:
        cases[name] = {"func": MOD + ("paged_attention" if launcher else "paged_attention_triton"),
                       "args": _args(batch), "kwargs": kwargs,
                       "disable": [MOD + "paged_attention_ref"] if launcher else [],
                       "batch": batch}

    for name, batch in BATCHES.items():
        add(name, batch)
    g = BATCHES["gqa9x3-f32-bs16-d64"]
    add("with-plan", g, plan=_plan_call(g))
    add("plan-without-token-visible", g, plan={
        "__call__": "dataclasses.replace", "args": [_plan_call(g)],
        "kwargs": {"token_visible": None}})
    add("int32-tensor-lengths-and-table", {
        **g, "block_tables": torch.tensor(g["block_tables"], dtype=torch.int32),
        "query_lens": torch.tensor(g["query_lens"], dtype=torch.int32),
        "kv_lens": torch.tensor(g["kv_lens"], dtype=torch.int32)})
    add("strided-q-and-caches", _strided(BATCHES["gqa9x3-bf16-bs16-d64"]))
    add("launcher-takes-the-kernel", BATCHES["gqa4x1-f32-bs1-d40"], launcher=True)
    # padding invariance: wider tables and an extra request change nothing in the other rows
    add("padded-batch", _padded(g, query_len=2, kv_len=40, pad_columns=4))
    for name in INVARIANCE:
        batch = BATCHES[name]
        for t in range(batch["q"].shape[0]):
            add(f"{name}/alone-{t}", alone(batch, t))
    return cases


INTERPRET_CASES = _interpret_cases()
ERROR_CASES = {
    "block-id-out-of-range": {**BATCHES["gqa4x1-f32-bs1-d40"],
                              "block_tables": [[0] * 50, [0] * 49 + [10 ** 6], [0] * 50]},
    "bad-lengths": {**BATCHES["gqa4x1-f32-bs1-d40"], "kv_lens": [50, 4, 6]},
}


@pytest.fixture(scope="module")
def interpreted(run_interpreted: Any) -> dict[str, dict]:
    cases = [{k: v for k, v in c.items() if k != "batch"} for c in INTERPRET_CASES.values()]
    cases += [{"func": MOD + "paged_attention_triton", "args": _args(b)}
              for b in ERROR_CASES.values()]
    cases.append({"func": MOD + "_kernel_is_interpreted", "args": []})
    names = [*INTERPRET_CASES, *ERROR_CASES, "is-interpreted"]
    return dict(zip(names, run_interpreted(cases, timeout=300), strict=True))


def _result(interpreted: dict[str, dict], name: str) -> torch.Tensor:
    result = interpreted[name]
    assert "ok" in result, result.get("error")
    (out,) = result["ok"]
    return out


def test_worker_really_interprets(interpreted: dict[str, dict]) -> None:
    assert interpreted["is-interpreted"] == {"ok": [True]}


CHECKED = [n for n in INTERPRET_CASES if "/alone-" not in n]


@pytest.mark.parametrize("name", CHECKED)
def test_interpreted_kernel_matches_reference(name: str, interpreted: dict[str, dict]) -> None:
    out = _result(interpreted, name)
    batch = INTERPRET_CASES[name]["batch"]
    ref = paged_attention_ref(*_args(batch))
    assert out.dtype == batch["q"].dtype and out.shape == batch["q"].shape
    assert out.is_contiguous()
    torch.testing.assert_close(out, ref, **TOL[out.dtype])


@pytest.mark.parametrize("name", [n for n in SHAPES if "f64" in n])
def test_interpreted_float64_kernel_matches_the_oracle(name: str,
                                                      interpreted: dict[str, dict]) -> None:
    torch.testing.assert_close(_result(interpreted, name), oracle(BATCHES[name]),
                               atol=1e-12, rtol=1e-12)


def test_plan_and_argument_forms_give_the_same_bits(interpreted: dict[str, dict]) -> None:
    base = _result(interpreted, "gqa9x3-f32-bs16-d64")
    for name in ("with-plan", "plan-without-token-visible", "int32-tensor-lengths-and-table"):
        assert torch.equal(_result(interpreted, name), base), name
    assert torch.equal(_result(interpreted, "strided-q-and-caches"),
                       _result(interpreted, "gqa9x3-bf16-bs16-d64"))


def test_padding_and_other_requests_change_no_bits(interpreted: dict[str, dict]) -> None:
    base = _result(interpreted, "gqa9x3-f32-bs16-d64")
    padded = _result(interpreted, "padded-batch")
    assert torch.equal(padded[: base.shape[0]], base)


@pytest.mark.parametrize("name", INVARIANCE)
def test_row_equals_the_row_computed_alone_exactly(name: str,
                                                   interpreted: dict[str, dict]) -> None:
    out = _result(interpreted, name)
    for t in range(out.shape[0]):
        assert torch.equal(_result(interpreted, f"{name}/alone-{t}")[0], out[t]), t


def test_interpreted_validation_errors(interpreted: dict[str, dict]) -> None:
    assert interpreted["block-id-out-of-range"]["error"].startswith("ValueError: block_tables")
    assert interpreted["bad-lengths"]["error"].startswith("ValueError: request 1")


# --------------------------------------------------------------------------------------------
# In-process (compiled-mode triton on CPU): validation and launcher dispatch
# --------------------------------------------------------------------------------------------


def _small(**changes: Any) -> list[Any]:
    batch = {**make_batch([1, 3], [5, 3], 4, 2, 16, 2), **changes}
    return _args(batch)


BAD_INPUTS = {
    "q-2d": (dict(q=torch.zeros(4, 64)), "need q"),
    "k-v-shapes-differ": (dict(v_cache=torch.zeros(6, 2, 2, 8)), "need q"),
    "head-dim-differs": (dict(q=torch.zeros(4, 4, 8)), "head_dim"),
    "heads-not-multiple": (dict(q=torch.zeros(4, 3, 16)), "multiple"),
    "dtypes-differ": (dict(q=torch.zeros(4, 4, 16, dtype=torch.float64)), "dtypes differ"),
    "int-dtype": (dict(q=torch.zeros(4, 4, 16, dtype=torch.int32),
                       k_cache=torch.zeros(6, 2, 2, 16, dtype=torch.int32),
                       v_cache=torch.zeros(6, 2, 2, 16, dtype=torch.int32)), "supports"),
    "rows-mismatch": (dict(q=torch.zeros(5, 4, 16)), "rows"),
    "query-longer-than-kv": (dict(kv_lens=[5, 2]), "query_len <= kv_len"),
    "zero-query-rows": (dict(query_lens=[0, 4], kv_lens=[5, 4]), "query_len"),
    "table-too-short": (dict(block_tables=[[0, 1, 2], [3]]), "cannot hold"),
    "lengths-differ": (dict(kv_lens=[5]), "one query length"),
    "float-lengths": (dict(query_lens=torch.tensor([1.0, 3.0])), "int32/int64"),
}


@pytest.mark.parametrize("changes,match", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_inputs_raise_value_error(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        paged_attention_triton(*_small(**changes))


def test_plan_on_another_device_is_refused() -> None:
    args = _small()
    plan = plan_paged_attention(args[4], args[5], args[3], 2, "meta")
    with pytest.raises(ValueError, match="plan's tensors"):
        paged_attention_triton(*args, plan=plan)


@pytest.mark.skipif(_kernel_is_interpreted(), reason="this session already interprets Triton")
def test_cpu_tensors_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA"):
        paged_attention_triton(*_small())
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # too late: triton is imported
    for fn in (paged_attention_triton, paged_attention):
        with pytest.raises(RuntimeError, match="before"):
            fn(*_small())


def test_launcher_on_cpu_runs_no_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without TRITON_INTERPRET the CPU launcher runs the compiled CPU kernel, or the reference
    where that is off (kernels/cpu_attention.py; its own tests are test_cpu_attention.py)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the kernel must not run on CPU without TRITON_INTERPRET")

    monkeypatch.setattr(pa, "paged_attention_triton", fail)
    expect = paged_attention_cpu(*_small()) if cpu_attention.supports(_small()[0]) \
        else paged_attention_ref(*_small())
    assert torch.equal(paged_attention(*_small()), expect)
    assert torch.equal(paged_attention(*_small(), cpu_kernel=False),
                       paged_attention_ref(*_small()))


def test_reference_matches_the_oracle() -> None:
    for name in ("gqa9x3-f32-bs16-d64", "gqa4x1-f64-bs16-d64", "mha-f32-bs3-d64"):
        batch = BATCHES[name]
        torch.testing.assert_close(paged_attention_ref(*_args(batch)).to(torch.float64),
                                   oracle(batch), **TOL[batch["q"].dtype])


def test_plan_token_visible() -> None:
    tables = [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9, 10, 11]]
    plan = plan_paged_attention([1, 5, 3], [7, 5, 10], tables, 2)
    assert plan.token_visible.dtype == torch.int32
    assert plan.token_visible.tolist() == [7, 1, 2, 3, 4, 5, 8, 9, 10]


# --------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------


def _cuda(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernel_matches_reference_and_launcher_dispatches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(5)
    shapes = list(SHAPES.values()) + [
        # SmolLM2-135M-like decode/verify batch, long contexts
        ([1] * 16 + [6] * 8 + [100], [rng.randrange(1, 3000) for _ in range(16)]
         + [rng.randrange(6, 3000) for _ in range(8)] + [100], 9, 3, 64, 16, torch.bfloat16),
        ([6] * 4 + [1] * 4, [rng.randrange(6, 900) for _ in range(8)], 32, 8, 128, 16,
         torch.float16),
    ]
    calls = []

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return paged_attention_triton(*args, **kwargs)

    for i, (qls, kls, h, hkv, d, bs, dtype) in enumerate(shapes):
        batch = _cuda(make_batch(qls, kls, h, hkv, d, bs, dtype=dtype, seed=100 + i))
        ref = paged_attention_ref(*_args(batch))
        out = paged_attention_triton(*_args(batch))
        assert out.is_cuda and out.dtype == dtype
        torch.testing.assert_close(out, ref, **TOL[dtype])
        plan = plan_paged_attention(batch["query_lens"], batch["kv_lens"],
                                    batch["block_tables"], bs, "cuda")
        assert torch.equal(paged_attention_triton(*_args(batch), plan=plan), out)
        with monkeypatch.context() as m:
            m.setattr(pa, "paged_attention_ref", None)  # the launcher must not take it
            m.setattr(pa, "paged_attention_triton", counting)
            assert torch.equal(paged_attention(*_args(batch), plan=plan), out)
        for t in rng.sample(range(out.shape[0]), min(6, out.shape[0])):
            assert torch.equal(paged_attention_triton(*_args(alone(batch, t)))[0], out[t])
    assert len(calls) == len(shapes)
