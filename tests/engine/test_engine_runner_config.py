"""ModelRunner input validation and ModelConfig.from_hf."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine.config import ModelConfig
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.runner import ModelRunner, SeqChunk
from helpers.models import tiny_hf_config, tiny_llama


@pytest.fixture(scope="module")
def runner():
    _, model, cfg = tiny_llama(seed=0, dtype=torch.float32, max_position_embeddings=24)
    return ModelRunner(model, cfg, KVCache(cfg, 8, 4, torch.float32))


@pytest.mark.parametrize(
    "chunks, match",
    [
        ([], "at least one chunk"),
        ([SeqChunk([], 0, [0])], "no tokens"),
        ([SeqChunk([1, 2, 3], 2, [0])], "block table"),
        ([SeqChunk([1], 24, [0] * 7)], "max_position_embeddings"),
        ([SeqChunk([1], 0, [8])], "out of range"),
        ([SeqChunk([128], 0, [0])], "token id"),
        ([SeqChunk([1], -1, [0])], "start_pos"),
    ],
)
def test_invalid_inputs_raise(runner, chunks, match):
    with pytest.raises(ValueError, match=match):
        runner.forward(chunks)


def test_bad_modes_raise(runner):
    with pytest.raises(ValueError, match="logits"):
        runner.forward([SeqChunk([1], 0, [0])], logits="first")
    with pytest.raises(ValueError, match="chunk_size"):
        runner.prefill([1, 2], [0], chunk_size=0)
    with pytest.raises(ValueError, match="dtype"):
        ModelRunner(runner.model, runner.config, KVCache(runner.config, 2, 4, torch.float64))


def test_from_hf_llama_and_qwen2():
    cfg = ModelConfig.from_hf(tiny_hf_config(hidden_size=64, num_heads=4, num_kv_heads=2))
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.attention_bias) == (16, 2, False)
    assert cfg.rope_scaling is None
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    q = ModelConfig.from_hf(tiny_hf_config(qwen2=True, eos_token_id=[2, 3]))
    assert q.attention_bias and not q.o_proj_bias and q.eos_token_ids == (2, 3)
    l3 = ModelConfig.from_hf(tiny_hf_config(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}, rope_theta=5e5))
    assert l3.rope_type == "llama3" and l3.rope_theta == 5e5 and l3.rope_scaling["factor"] == 8.0
    hd = ModelConfig.from_hf(tiny_hf_config(head_dim=32))
    assert hd.head_dim == 32


def test_from_hf_rejects_unsupported():
    with pytest.raises(ValueError, match="rope"):
        ModelConfig.from_hf(tiny_hf_config(rope_scaling={"rope_type": "yarn", "factor": 2.0}))
