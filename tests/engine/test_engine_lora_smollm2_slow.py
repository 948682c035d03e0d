"""A LoRA adapter on SmolLM2-135M-Instruct (float32, on its GGUF blocks) greedy-decodes exactly as
transformers + PEFT's merged adapter does, through prefill, one-token decode steps and a
5-token verify chunk, while a base row in the same batch stays the base model's (issue 37)."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine.kv_cache import KVCache
from specmesh.engine.loader import load_model, load_tokenizer
from specmesh.engine.lora import lora_bank
from specmesh.engine.lora_peft import LoraAdapter
from specmesh.engine.runner import ModelRunner, SeqChunk
from helpers.lora import make_tiny_adapter, merged
from helpers.models import hf_greedy, hf_reference_model

pytestmark = pytest.mark.slow

N = 10


def test_smollm2_adapter_greedy_equals_peft_merged(tmp_path):
    loaded = load_model(dtype="float32")
    hf = hf_reference_model(None, "float32")
    path = make_tiny_adapter(hf, tmp_path / "a", seed=0, rank=8, alpha=16, std=0.03,
                             targets=["q_proj", "v_proj", "o_proj", "down_proj"])
    slot = lora_bank(loaded.model).add(LoraAdapter.load("a", path))
    tok = load_tokenizer(None)
    enc = tok.apply_chat_template([{"role": "user", "content": "Name three primary colors."}],
                                  add_generation_prompt=True)
    ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    want = hf_greedy(merged(hf, path), ids, N)
    base_want = hf_greedy(hf, ids, N)
    assert want != base_want, "the adapter changed nothing: the test would prove nothing"

    runner = ModelRunner(loaded.model, loaded.config, KVCache(loaded.config, 32, 16,
                                                              torch.float32))
    n = len(ids)
    ta, tb = list(range(0, 16)), list(range(16, 32))
    firsts = runner.prefill_batch([ids, ids], [ta, tb], adapters=[slot, -1])
    got, base = [int(firsts[0][0].argmax())], [int(firsts[1][0].argmax())]
    while len(got) < N:  # adapter and base rows side by side in each decode step
        la, lb = runner.forward([SeqChunk([got[-1]], n + len(got) - 1, ta, adapter=slot),
                                 SeqChunk([base[-1]], n + len(base) - 1, tb)])
        got.append(int(la[0].argmax()))
        base.append(int(lb[0].argmax()))
    assert got == want
    assert base == base_want
    # a verify chunk over the reference's tokens predicts the same next tokens
    fresh = ModelRunner(loaded.model, loaded.config, KVCache(loaded.config, 16, 16,
                                                             torch.float32))
    fresh.prefill(ids, ta, adapter=slot)
    verify = fresh.forward([SeqChunk(want[:5], n, ta, adapter=slot)])[0]
    assert verify.argmax(-1).tolist() == want[1:6]
