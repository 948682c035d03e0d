"""A 16-bit KV cache for a float32 model (``--kv-cache-dtype``, engine/kv_cache.py): which
dtypes a model may pair with, writes rounded as torch rounds, the compiled rounding equal to
torch's bit for bit, every attention path reading the stored K/V (a verify chunk's rows equal
one-token steps bit for bit, on the compiled kernel and on the reference), and the runner's
refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.models import tiny_llama

from specmesh.engine.dtypes import resolve_kv_cache_dtype
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.runner import ModelRunner, SeqChunk
from specmesh.kernels import layer_ops

KV16 = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("name, model, want", [
    ("auto", "float32", torch.float32), ("auto", "bfloat16", torch.bfloat16),
    ("auto", "float64", torch.float64), ("bfloat16", "float32", torch.bfloat16),
    ("float16", "float32", torch.float16), ("bfloat16", "bfloat16", torch.bfloat16),
    (torch.float16, torch.float32, torch.float16)])
def test_kv_cache_dtype_resolves(name, model, want):
    assert resolve_kv_cache_dtype(name, model) is want


@pytest.mark.parametrize("name, model, match", [
    ("float16", "bfloat16", "needs a float32 model"), ("bfloat16", "float64", "float32 model"),
    ("float32", "float32", "unknown kv_cache_dtype"), ("fp8", "float32", "unknown"),
    ("auto", "int8", "unsupported model dtype")])
def test_kv_cache_dtype_refusals(name, model, match):
    with pytest.raises(ValueError, match=match):
        resolve_kv_cache_dtype(name, model)


@pytest.mark.parametrize("dtype", KV16)
def test_writes_round_to_the_cache_dtype(dtype):
    _, model, cfg = tiny_llama(seed=0, dtype=torch.float32)
    cache = KVCache(cfg, 4, 4, dtype=dtype)
    k, v = torch.randn(3, cfg.num_kv_heads, cfg.head_dim), torch.randn(3, cfg.num_kv_heads,
                                                                         cfg.head_dim)
    cache.write(1, torch.tensor([5, 2, 9]), k, v)
    gk, gv = cache.gather(1, [1, 0, 2], 12)
    assert gk.dtype == dtype and torch.equal(gk[[1, 6, 9]], k.to(dtype))
    assert torch.equal(gv[[1, 6, 9]], v.to(dtype))


@pytest.mark.parametrize("dtype", KV16)
def test_the_compiled_rounding_is_torchs_bit_for_bit(dtype):
    """What the compiled decoder layers write a 16-bit cache with (kernels/cpu_layer_ops.cpp):
    random bit patterns over every exponent, plus the edges of rounding (ties either way,
    float16's subnormals, its overflow to infinity, signed zeros and infinities)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-2 ** 31, 2 ** 31, (200_000,), generator=g,
                      dtype=torch.int64).to(torch.int32).view(torch.float32)
    edges = []
    for base in (0x477FE000, 0x477FF000, 0x38800000, 0x387FF000, 0x33000000, 0x33800000,
                 0x3F800000, 0x00000000, 0x7F7FFFFF, 0x7F800000):
        edges += range(max(0, base - 600), min(0x7F800001, base + 600))
    e = torch.tensor(edges, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([x, e, -e])
    x = x[~torch.isnan(x)]
    got = layer_ops.to_kv16(x, dtype)
    assert torch.equal(got.view(torch.int16), x.to(dtype).view(torch.int16))
    assert torch.isnan(layer_ops.to_kv16(torch.tensor([float("nan")]), dtype)).all()
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        layer_ops.to_kv16(x, torch.float32)


@pytest.fixture(scope="module")
def tiny64():
    """float32, head_dim 64 (the compiled attention's vector path)."""
    _, model, cfg = tiny_llama(seed=4, dtype=torch.float32, vocab_size=96, hidden_size=256,
                               num_heads=4, num_kv_heads=2, init_std=0.1)
    return model, cfg


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("dtype", KV16)
def test_a_verify_chunk_equals_one_token_steps_bit_for_bit(tiny64, dtype, compiled,
                                                           monkeypatch):
    """The exactness of speculation with a 16-bit cache: the rows of one forward over
    ``[last] + 4 drafts`` read the same rounded K/V as five one-token steps, and give their
    logits bit for bit (compiled kernel, and the torch reference with it switched off)."""
    if not compiled:
        monkeypatch.setenv("SPECMESH_CPU_ATTENTION", "0")
    model, cfg = tiny64
    prompt = [int(t) for t in torch.randint(0, 96, (70,), generator=torch.Generator()
                                            .manual_seed(2))]
    tail = [5, 17, 33, 2, 80]
    table = list(range(8))
    outs, caches = [], []
    for chunked in (True, False):
        runner = ModelRunner(model, cfg, KVCache(cfg, 8, 16, dtype=dtype))
        runner.prefill(prompt, table)
        if chunked:
            outs.append(runner.forward([SeqChunk(tail, len(prompt), table)])[0])
        else:
            outs.append(torch.cat([runner.forward([SeqChunk([t], len(prompt) + i, table)])[0]
                                   for i, t in enumerate(tail)]))
        caches.append(runner.kv_cache.data)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0], caches[1]) and caches[0].dtype == dtype


@pytest.mark.parametrize("dtype", KV16)
def test_whole_prompts_attend_to_the_stored_kv(tiny64, dtype):
    """A prompt prefilled whole (SDPA over the chunk's own K/V) reads its K/V as the cache
    holds them, as a prompt prefilled token by token (every step reads the cache) does: the
    two agree to float rounding, much closer than either to a float32 cache."""
    model, cfg = tiny64
    prompt = list(range(3, 60))
    table = list(range(4))

    def last_logits(kv_dtype, chunk_size):
        runner = ModelRunner(model, cfg, KVCache(cfg, 4, 16, dtype=kv_dtype))
        return runner.prefill(prompt, table, chunk_size=chunk_size)

    whole, stepwise = last_logits(dtype, None), last_logits(dtype, 1)
    full = last_logits(torch.float32, None)
    near = (whole - stepwise).abs().max().item()
    assert near < 5e-5
    assert (whole - full).abs().max().item() > 20 * near


def test_the_runner_refuses_other_pairs():
    _, model, cfg = tiny_llama(seed=0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a float32 model may have"):
        ModelRunner(model, cfg, KVCache(cfg, 4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="a float32 model may have"):
        ModelRunner(model, cfg, KVCache(cfg, 4, 4, dtype=torch.float32))
    gpu = SimpleNamespace(dtype=torch.float32, device=torch.device("cuda"))
    with pytest.raises(ValueError, match="CPU only"):
        ModelRunner(gpu, cfg, KVCache(cfg, 4, 4, dtype=torch.bfloat16))
