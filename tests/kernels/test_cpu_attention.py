"""Tests of the compiled CPU paged attention (kernels/cpu_attention.py, .cpp): equal to a
float64 SDPA oracle on odd shapes (every code path: head_dim 64 and 128 with 1 to 14 query
heads per KV head, and the generic loops), rows batch invariant bit for bit (alone, in a longer
chunk, in a padded batch; lengths around its 16-position blocks and its 512-position splits,
and any thread count), the launcher's choice, and the build's errors. Token trees (rows equal
to their path laid out as a chain): test_paged_attention_tree.py, over both CPU
implementations."""

from __future__ import annotations

import ctypes
import logging

import pytest
import torch
from test_paged_attention import SHAPES, TOL, _case, _oracle

from specmesh.kernels import cpu_attention
from specmesh.kernels.cpu_build import CpuKernel
from specmesh.kernels.paged_attention import paged_attention, paged_attention_ref

pytestmark = pytest.mark.skipif(not cpu_attention.has_compiler(),
                                reason="no C++ compiler to build the CPU attention kernel")


def test_kernel_builds_where_there_is_a_compiler():
    """Where a compiler exists the kernel must build (else every test here would pass on the
    torch reference's fallback without running it)."""
    assert cpu_attention.available(), cpu_attention.KERNEL.failed

attend = cpu_attention.paged_attention_cpu

KERNEL_SHAPES = SHAPES + [
    # h, hkv, d, block_size, q_lens, kv_lens: the register paths (d 64 / 128, groups of 4 heads
    # and a remainder) and the generic one (d 48)
    (14, 1, 128, 16, [5, 1, 2], [97, 16, 33]),
    (8, 2, 64, 8, [1, 4], [15, 48]),
    (3, 3, 48, 5, [3, 1], [31, 1]),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", KERNEL_SHAPES)
def test_equals_sdpa_oracle(shape, dtype):
    h, hkv, d, bs, q_lens, kv_lens = shape
    q, k, v, tables = _case(h, hkv, d, bs, q_lens, kv_lens, dtype)
    out = attend(q, k, v, tables, q_lens, kv_lens, d ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype
    ref = _oracle(q, k, v, tables, q_lens, kv_lens, d ** -0.5)
    assert (out.double() - ref).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape", KERNEL_SHAPES + [
    (9, 3, 64, 16, [5, 5, 5], [63, 64, 65]), (9, 3, 64, 16, [5, 1], [700, 300]),
    (9, 3, 64, 16, [3, 3], [17, 34]), (9, 3, 64, 16, [5, 3], [514, 1025])])
def test_rows_are_batch_invariant(shape, dtype):
    """Row j of a chunk == that row computed alone (what a one-token decode step at its position
    computes), bit for bit, and each request alone == the same request inside the batch."""
    h, hkv, d, bs, q_lens, kv_lens = shape
    q, k, v, tables = _case(h, hkv, d, bs, q_lens, kv_lens, dtype, seed=3)
    out = attend(q, k, v, tables, q_lens, kv_lens, d ** -0.5)
    off = 0
    for ql, n, t in zip(q_lens, kv_lens, tables):
        for j in range(ql):
            alone = attend(q[off + j:off + j + 1], k, v, [t], [1], [n - ql + j + 1], d ** -0.5)
            assert torch.equal(alone[0], out[off + j]), (ql, n, j)
        assert torch.equal(attend(q[off:off + ql], k, v, [t], [ql], [n], d ** -0.5),
                           out[off:off + ql])
        off += ql


def test_thread_count_does_not_change_results():
    h, hkv, d, bs, q_lens, kv_lens = 9, 3, 64, 16, [5, 1, 3], [1300, 47, 129]
    q, k, v, tables = _case(h, hkv, d, bs, q_lens, kv_lens, torch.bfloat16, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend(q, k, v, tables, q_lens, kv_lens, 0.125)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(attend(q, k, v, tables, q_lens, kv_lens, 0.125), one)
    finally:
        torch.set_num_threads(threads)


def test_launcher_takes_the_kernel_on_cpu_unless_the_caller_turns_it_off():
    h, hkv, d, bs, q_lens, kv_lens = SHAPES[0]
    q, k, v, tables = _case(h, hkv, d, bs, q_lens, kv_lens, torch.bfloat16)
    args = (q, k, v, tables, q_lens, kv_lens, 0.125)
    kernel, ref = attend(*args), paged_attention_ref(*args)
    assert not torch.equal(kernel, ref)  # they round differently, so the choice shows
    assert torch.equal(paged_attention(*args), kernel)
    assert torch.equal(paged_attention(*args, cpu_kernel=False), ref)  # backend choice off
    assert cpu_attention.available()  # the kernel itself stays loaded for other callers


def test_unsupported_dtype_is_refused_and_left_to_the_reference():
    q, k, v, tables = _case(4, 2, 16, 4, [1], [5], torch.float16)
    assert not cpu_attention.supports(q)
    with pytest.raises(ValueError, match="CPU attention kernel takes"):
        attend(q, k, v, tables, [1], [5], 0.25)
    torch.testing.assert_close(paged_attention(q, k, v, tables, [1], [5], 0.25),
                               paged_attention_ref(q, k, v, tables, [1], [5], 0.25))


def test_build_failure_is_a_clear_error_and_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SPECMESH_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match="building the CPU attention kernel failed"):
        cpu_attention.build()
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind
    monkeypatch.setattr(cpu_attention.KERNEL, "lib", None)
    monkeypatch.setattr(cpu_attention.KERNEL, "failed", None)
    with caplog.at_level(logging.WARNING, logger="specmesh.kernels.cpu_build"):
        assert cpu_attention.library() is None
    assert "using the torch reference" in caplog.text
    q, k, v, tables = _case(4, 2, 16, 4, [1], [5], torch.float32)
    assert torch.equal(paged_attention(q, k, v, tables, [1], [5], 0.25),
                       paged_attention_ref(q, k, v, tables, [1], [5], 0.25))


def test_built_library_is_reused(monkeypatch, tmp_path):
    """A build lands in ``$SPECMESH_KERNEL_CACHE`` and the next build of the same source reuses
    it, while another source gets a library of its own. A one-function source takes the same
    path through kernels/cpu_build.py as the attention kernel, without compiling it again."""
    source = tmp_path / "tiny_kernel.cpp"
    source.write_text('extern "C" int specmesh_tiny(int x) { return x + 1; }\n')
    kernel = CpuKernel(source, "a tiny kernel", "nothing",
                       {"specmesh_tiny": ([ctypes.c_int], ctypes.c_int)})
    monkeypatch.setenv("SPECMESH_KERNEL_CACHE", str(tmp_path / "cache"))
    first = kernel.build()
    assert first.parent == tmp_path / "cache" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert kernel.build() == first and first.stat().st_mtime_ns == stamp
    assert kernel.library().specmesh_tiny(41) == 42
    source.write_text('extern "C" int specmesh_tiny(int x) { return x + 2; }\n')
    assert kernel.build() != first


def test_block_ids_outside_the_cache_are_a_clear_error():
    q, k, v, tables = _case(4, 2, 16, 4, [1], [5], torch.float32)
    for bad in (k.shape[0], -1):
        with pytest.raises(ValueError, match="block_tables hold ids outside"):
            attend(q, k, v, [[tables[0][0], bad]], [1], [5], 0.25)


# -- a 16-bit KV cache of a float32 model (--kv-cache-dtype, engine/kv_cache.py) -------------

KV16 = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("kv_dtype", KV16)
@pytest.mark.parametrize("shape", KERNEL_SHAPES)
def test_16bit_cache_equals_the_oracle_and_the_reference(shape, kv_dtype):
    """float32 queries over a bfloat16 / float16 cache: float32 results as accurate as over a
    float32 cache holding the same (widened) values, on every code path."""
    h, hkv, d, bs, q_lens, kv_lens = shape
    q, k, v, tables = _case(h, hkv, d, bs, q_lens, kv_lens, torch.float32, seed=11)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    out = attend(q, k, v, tables, q_lens, kv_lens, d ** -0.5)
    assert out.shape == q.shape and out.dtype == torch.float32
    ref = _oracle(q, k, v, tables, q_lens, kv_lens, d ** -0.5)  # the widened cache, float64
    assert (out.double() - ref).abs().max().item() < TOL[torch.float32]
    wide = attend(q, k.float(), v.float(), tables, q_lens, kv_lens, d ** -0.5)
    assert torch.equal(out, wide)  # widening as read == widening first, bit for bit
    torch.testing.assert_close(out, paged_attention_ref(q, k, v, tables, q_lens, kv_lens,
                                                        d ** -0.5), rtol=0, atol=2e-6)


@pytest.mark.parametrize("kv_dtype", KV16)
@pytest.mark.parametrize("shape", [(9, 3, 64, 16, [5, 1], [700, 300]),
                                   (14, 1, 128, 16, [5, 1, 2], [97, 16, 33]),
                                   (3, 3, 48, 5, [3, 1], [31, 1]),
                                   (9, 3, 64, 16, [5, 3], [514, 1025])])
def test_16bit_cache_rows_are_batch_invariant(shape, kv_dtype):
    """What speculation's exactness rests on with a 16-bit cache: a verify row reads the same
    stored K/V a one-token step at its position reads, and computes the same bits."""
    h, hkv, d, bs, q_lens, kv_lens = shape
    q, k, v, tables = _case(h, hkv, d, bs, q_lens, kv_lens, torch.float32, seed=4)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    out = attend(q, k, v, tables, q_lens, kv_lens, d ** -0.5)
    off = 0
    for ql, n, t in zip(q_lens, kv_lens, tables):
        for j in range(ql):
            alone = attend(q[off + j:off + j + 1], k, v, [t], [1], [n - ql + j + 1], d ** -0.5)
            assert torch.equal(alone[0], out[off + j]), (ql, n, j)
        off += ql


@pytest.mark.parametrize("kv_dtype", KV16)
@pytest.mark.parametrize("d", [64, 128, 48])
def test_16bit_values_are_widened_exactly(kv_dtype, d):
    """Over one position the softmax weight is exactly 1, so the output is that position's
    value widened to float32, bit for bit: the kernel's 16-bit loads (the vector path at head
    dim 64 / 128, the scalar loops at 48) are exact for every finite value of the dtype,
    subnormals and the extremes included."""
    g = torch.Generator().manual_seed(d)
    bits = torch.randint(-2 ** 15, 2 ** 15, (64, 1, 2, d), generator=g, dtype=torch.int32)
    v = bits.to(torch.int16).view(kv_dtype)
    v = torch.where(torch.isfinite(v), v, torch.zeros_like(v))
    v[0, 0, 0, :4] = torch.tensor([1, 2 ** 10 - 1, 2 ** 15 + 1, 0x7bff],  # tiny and huge
                                  dtype=torch.int32).to(torch.int16).view(kv_dtype)
    k = torch.zeros_like(v)  # every score 0: no overflow from random huge keys
    q = torch.randn(64, 4, d, generator=g)
    tables = [[b] for b in range(64)]
    out = attend(q, k, v, tables, [1] * 64, [1] * 64, d ** -0.5)
    want = v[:, 0].float().repeat_interleave(2, dim=1)  # query heads 2j, 2j+1 read KV head j
    assert torch.equal(out, want)


def test_16bit_cache_goes_to_the_kernel_unless_the_caller_turns_it_off():
    h, hkv, d, bs, q_lens, kv_lens = SHAPES[0]
    q, k, v, tables = _case(h, hkv, d, bs, q_lens, kv_lens, torch.float32)
    args = (q, k.to(torch.bfloat16), v.to(torch.bfloat16), tables, q_lens, kv_lens, 0.125)
    assert cpu_attention.supports(q, kv_dtype=torch.bfloat16)
    assert cpu_attention.supports(q, kv_dtype=torch.float16)
    assert not cpu_attention.supports(q.to(torch.bfloat16), kv_dtype=torch.float16)
    kernel, ref = attend(*args), paged_attention_ref(*args)
    assert not torch.equal(kernel, ref)  # they round differently, so the choice shows
    assert torch.equal(paged_attention(*args), kernel)
    assert torch.equal(paged_attention(*args, cpu_kernel=False), ref)  # backend choice off


@pytest.mark.parametrize("q_dtype, k_dtype, v_dtype", [
    (torch.bfloat16, torch.float16, torch.float16),  # only a float32 model has a 16-bit cache
    (torch.float64, torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16, torch.float16),  # keys and values of one dtype
    (torch.bfloat16, torch.float32, torch.float32),  # never wider than q
])
def test_other_dtype_pairs_are_refused(q_dtype, k_dtype, v_dtype):
    q, k, v, tables = _case(4, 2, 16, 4, [1], [5], torch.float32)
    q, k, v = q.to(q_dtype), k.to(k_dtype), v.to(v_dtype)
    for fn in (attend, paged_attention_ref, paged_attention):
        with pytest.raises(ValueError, match="dtypes differ|CPU attention kernel takes"):
            fn(q, k, v, tables, [1], [5], 0.25)


def test_the_triton_kernel_refuses_a_16bit_cache():
    from specmesh.kernels.paged_attention import paged_attention_triton

    q, k, v, tables = _case(4, 2, 16, 4, [1], [5], torch.float32)
    with pytest.raises(ValueError, match="cache of q's dtype only"):
        paged_attention_triton(q, k.to(torch.bfloat16), v.to(torch.bfloat16), tables, [1], [5],
                               0.25)
