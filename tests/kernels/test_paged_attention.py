"""Tests of the paged attention reference (kernels/paged_attention.py): equal to a per-request
float64 SDPA oracle on odd shapes, batch invariant in bfloat16 and float32 (a row's result does not depend
on its chunk or batch: what makes bf16 speculation exact), and its validation errors."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from specmesh.kernels import cpu_attention
from specmesh.kernels.paged_attention import paged_attention, paged_attention_ref
from specmesh.kernels.paged_attention_plan import plan_paged_attention

TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 3e-2}


def _case(h, hkv, d, bs, q_lens, kv_lens, dtype, seed=0, num_blocks=None):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-n // bs) for n in kv_lens]
    num_blocks = num_blocks or sum(need) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)  # non-contiguous, shuffled tables
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n] + [ids[0]] * rng.randrange(3))  # tables may be longer
        at += n
    k = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), h, d, generator=g).to(dtype)
    return q, k, v, tables


def _oracle(q, k, v, tables, q_lens, kv_lens, scale):
    """Per-request float64 SDPA with the bottom-right causal mask."""
    out, off = [], 0
    hkv, d = k.shape[2], k.shape[3]
    for ql, n, t in zip(q_lens, kv_lens, tables):
        kk = k[t].reshape(-1, hkv, d)[:n].double().transpose(0, 1)
        vv = v[t].reshape(-1, hkv, d)[:n].double().transpose(0, 1)
        mask = torch.arange(n)[None, :] <= torch.arange(n - ql, n)[:, None]
        o = F.scaled_dot_product_attention(q[off:off + ql].double().transpose(0, 1), kk, vv,
                                           attn_mask=mask, scale=scale,
                                           enable_gqa=q.shape[1] != hkv)
        out.append(o.transpose(0, 1))
        off += ql
    return torch.cat(out)


SHAPES = [
    # h, hkv, d, block_size, q_lens, kv_lens
    (9, 3, 64, 16, [1, 5, 3, 1, 7], [40, 300, 3, 17, 129]),
    (4, 1, 40, 3, [2, 6], [2, 11]),          # q_len == kv_len chunk, odd head dim, GQA 4:1
    (4, 4, 16, 1, [1, 1, 4], [1, 9, 4]),     # block size 1, MHA
    (6, 2, 80, 7, [5], [5 + 7 * 3 + 1]),     # verify chunk crossing block boundaries
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_equals_sdpa_oracle(shape, dtype):
    h, hkv, d, bs, q_lens, kv_lens = shape
    q, k, v, tables = _case(h, hkv, d, bs, q_lens, kv_lens, dtype)
    scale = d ** -0.5
    out = paged_attention_ref(q, k, v, tables, q_lens, kv_lens, scale)
    assert out.shape == q.shape and out.dtype == dtype
    ref = _oracle(q, k, v, tables, q_lens, kv_lens, scale)
    assert (out.double() - ref).abs().max().item() < TOL[dtype]
    # the launcher on CPU is the compiled kernel where it builds, else the reference; a
    # prebuilt plan gives the same result
    plan = plan_paged_attention(q_lens, kv_lens, tables, bs)
    cpu = cpu_attention.supports(q)
    expect = cpu_attention.paged_attention_cpu(q, k, v, tables, q_lens, kv_lens, scale) \
        if cpu else out
    assert torch.equal(paged_attention(q, k, v, tables, q_lens, kv_lens, scale, plan=plan),
                       expect)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES + [(9, 3, 64, 16, [5, 5, 5], [63, 64, 65]),
                                            (14, 2, 64, 16, [5, 1], [700, 300])])
def test_rows_are_batch_invariant(shape, dtype):
    """Row j of a chunk == that row computed alone (kv length = what it sees), bit for bit, and
    == the same row in a batch padded by other, longer requests."""
    h, hkv, d, bs, q_lens, kv_lens = shape
    q, k, v, tables = _case(h, hkv, d, bs, q_lens, kv_lens, dtype, seed=3)
    scale = d ** -0.5
    out = paged_attention_ref(q, k, v, tables, q_lens, kv_lens, scale)
    off = 0
    for ql, n, t in zip(q_lens, kv_lens, tables):
        for j in range(ql):
            alone = paged_attention_ref(q[off + j:off + j + 1], k, v, [t], [1], [n - ql + j + 1],
                                        scale)
            assert torch.equal(alone[0], out[off + j]), (ql, n, j)
        off += ql
    # each request alone == inside the batch
    off = 0
    for ql, n, t in zip(q_lens, kv_lens, tables):
        alone = paged_attention_ref(q[off:off + ql], k, v, [t], [ql], [n], scale)
        assert torch.equal(alone, out[off:off + ql])
        off += ql


def test_tensor_arguments_and_longer_tables():
    h, hkv, d, bs, q_lens, kv_lens = SHAPES[0]
    q, k, v, tables = _case(h, hkv, d, bs, q_lens, kv_lens, torch.float32)
    width = max(len(t) for t in tables) + 2
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    a = paged_attention_ref(q, k, v, tables, q_lens, kv_lens, 0.125)
    b = paged_attention_ref(q, k, v, padded, torch.tensor(q_lens), torch.tensor(kv_lens), 0.125)
    assert torch.equal(a, b)


@pytest.mark.parametrize("q_lens,kv_lens,tables,match", [
    ([], [], [], "one query length"),
    ([1, 2], [3], [[0], [1]], "one query length"),
    ([0], [3], [[0]], "1 <= query_len <= kv_len"),
    ([4], [3], [[0]], "1 <= query_len <= kv_len"),
    ([1], [9], [[0, 1]], "cannot hold"),
])
def test_plan_errors(q_lens, kv_lens, tables, match):
    with pytest.raises(ValueError, match=match):
        plan_paged_attention(q_lens, kv_lens, tables, 4)


def test_tensor_errors():
    k = torch.zeros(4, 4, 2, 8)
    with pytest.raises(ValueError, match="dtypes differ"):
        paged_attention_ref(torch.zeros(1, 2, 8, dtype=torch.float64), k, k, [[0]], [1], [1], 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_ref(torch.zeros(1, 2, 4), k, k, [[0]], [1], [1], 1.0)
    with pytest.raises(ValueError, match="query_lens sum"):
        paged_attention_ref(torch.zeros(3, 2, 8), k, k, [[0]], [1], [1], 1.0)
    with pytest.raises(ValueError, match="block_size must be"):
        plan_paged_attention([1], [1], [[0]], 0)
