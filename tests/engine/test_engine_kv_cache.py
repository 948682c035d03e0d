"""KVCache write/gather, chunked KV transfer between caches, and sizing helpers."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine.config import ModelConfig
from specmesh.engine.kv_cache import KVCache, num_blocks_for_memory
from specmesh.engine.runner import ModelRunner, SeqChunk
from helpers.models import tiny_llama

SMOL = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                   num_heads=9, num_kv_heads=3, head_dim=64)


def test_sizes():
    cache = KVCache(SMOL, num_blocks=2, block_size=16, dtype="float32")
    assert cache.bytes_per_token == 30 * 2 * 3 * 64 * 4 == 46080
    assert KVCache(SMOL, 1, 16, torch.bfloat16).bytes_per_token == 23040
    assert num_blocks_for_memory(SMOL, 16, "float32", 46080 * 16 * 10 + 5) == 10
    assert num_blocks_for_memory(SMOL, 16, torch.bfloat16, 46080 * 16 * 10) == 20
    with pytest.raises(ValueError):
        KVCache(SMOL, 2, 16, dtype="int8")


def test_write_gather():
    cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=4)
    cache = KVCache(cfg, num_blocks=4, block_size=2, dtype=torch.float64)
    k, v = torch.randn(3, 1, 4, dtype=torch.float64), torch.randn(3, 1, 4, dtype=torch.float64)
    table = [3, 0]
    cache.write(1, torch.tensor([6, 7, 0]), k, v)  # positions 0, 1, 2 of table [3, 0]
    gk, gv = cache.gather(1, table, 3)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    assert cache.gather(0, table, 3)[0].abs().sum() == 0


def test_transfer_round_trip_gives_identical_logits():
    """Prefill in one cache, ship the KV chunk by chunk to another cache with other block ids."""
    _, model, cfg = tiny_llama(seed=4, dtype=torch.float32)
    src = ModelRunner(model, cfg, KVCache(cfg, 16, 4, torch.float32))
    dst = ModelRunner(model, cfg, KVCache(cfg, 16, 4, torch.float32))
    prompt = torch.randint(0, 128, (14,), generator=torch.Generator().manual_seed(0)).tolist()
    src_table, dst_table = [2, 9, 4, 11, 5], [15, 0, 7, 3, 8]
    src.prefill(prompt, src_table, chunk_size=6)
    for layers in [(0, 1), (1, 2)]:
        for start in range(0, 14, 5):
            n = min(5, 14 - start)
            kv = src.kv_cache.read_chunk(*layers, src_table, start, n)
            assert kv.shape == (1, 2, n, cfg.num_kv_heads, cfg.head_dim)
            dst.kv_cache.write_chunk(*layers, dst_table, start, kv)
    nxt = [5, 17, 99]
    a = src.forward([SeqChunk(nxt, 14, src_table)])[0]
    b = dst.forward([SeqChunk(nxt, 14, dst_table)])[0]
    assert torch.equal(a, b)


def test_write_chunk_validates():
    cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=4)
    cache = KVCache(cfg, num_blocks=4, block_size=2, dtype=torch.float32)
    good = torch.ones(2, 2, 3, 1, 4)
    cache.write_chunk(0, 2, [1, 2], 0, good)
    assert torch.equal(cache.read_chunk(0, 2, [1, 2], 0, 3), good)
    with pytest.raises(ValueError, match="shape"):
        cache.write_chunk(0, 2, [1, 2], 0, torch.ones(2, 2, 3, 1, 5))
    with pytest.raises(ValueError, match="shape"):
        cache.write_chunk(0, 1, [1, 2], 0, good)
    with pytest.raises(ValueError, match="dtype"):
        cache.write_chunk(0, 2, [1, 2], 0, good.double())
    with pytest.raises(ValueError, match="covers"):
        cache.write_chunk(0, 2, [1], 0, good)
    with pytest.raises(ValueError, match="out of range"):
        cache.write_chunk(0, 2, [1, 4], 0, good)
    with pytest.raises(ValueError, match="layer range"):
        cache.read_chunk(1, 3, [1, 2], 0, 3)
