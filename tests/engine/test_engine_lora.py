"""Per-row LoRA adapters (engine/lora.py) on the tiny random Llama: PEFT directories load, a
mixed batch of base and adapter rows computes each row as alone (prefill chunks, decode steps,
ragged verify widths), and greedy output equals transformers + PEFT's merged adapter."""

from __future__ import annotations

import json

import pytest
import torch

from specmesh.engine.kv_cache import KVCache
from specmesh.engine.lora import lora_bank
from specmesh.engine.lora_peft import LoraAdapter
from specmesh.engine.runner import ModelRunner, SeqChunk
from helpers.lora import make_tiny_adapter, merged
from helpers.models import hf_greedy, tiny_llama

BLOCK = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf, ours, config = tiny_llama(seed=5, dtype=torch.float32)
    root = tmp_path_factory.mktemp("lora")
    a = make_tiny_adapter(hf, root / "a", seed=1)
    b = make_tiny_adapter(hf, root / "b", seed=2, targets=["q_proj", "v_proj", "lm_head"])
    bank = lora_bank(ours)
    slots = {"a": bank.add(LoraAdapter.load("a", a)), "b": bank.add(LoraAdapter.load("b", b))}
    return hf, ours, config, {"a": a, "b": b}, slots


def _greedy(runner: ModelRunner, prompt: list[int], n: int, slot: int, table: list[int]):
    """Prefill then one-token decode steps with adapter ``slot``."""
    out = [int(runner.prefill(prompt, table, chunk_size=3, adapter=slot)[0].argmax())]
    while len(out) < n:
        pos = len(prompt) + len(out) - 1
        logits = runner.forward([SeqChunk([out[-1]], pos, table, adapter=slot)])[0]
        out.append(int(logits[0].argmax()))
    return out


def test_adapter_greedy_equals_peft_merged(setup):
    hf, ours, config, paths, slots = setup
    prompt = [3, 17, 42, 9, 100, 5, 77]
    runner = ModelRunner(ours, config, KVCache(config, 64, BLOCK, torch.float32))
    base = _greedy(runner, prompt, 12, -1, list(range(0, 8)))
    assert base == hf_greedy(hf, prompt, 12)
    for name, path in paths.items():
        ref = hf_greedy(merged(hf, path), prompt, 12)
        got = _greedy(runner, prompt, 12, slots[name], list(range(8, 16)))
        assert got == ref, name
        assert got != base, f"adapter {name} changed nothing: the test would prove nothing"


def test_mixed_batch_rows_equal_each_alone(setup):
    """One forward with a base prompt, an adapter-a prompt and an adapter-b prompt, then a
    ragged verify step (widths 3, 1, 4): every row equals the same row run alone, bit for bit."""
    _, ours, config, _, slots = setup
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25]]
    adapters = [-1, slots["a"], slots["b"]]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    mixed = ModelRunner(ours, config, KVCache(config, 32, BLOCK, torch.float32))
    first = mixed.prefill_batch(prompts, tables, adapters=adapters)
    drafts = [[40, 41, 42], [50], [60, 61, 62, 63]]
    verify = mixed.forward([SeqChunk(d, len(p), t, adapter=a)
                            for d, p, t, a in zip(drafts, prompts, tables, adapters)])
    for i in range(3):
        alone = ModelRunner(ours, config, KVCache(config, 32, BLOCK, torch.float32))
        want = alone.prefill(prompts[i], tables[0], adapter=adapters[i])
        assert torch.equal(first[i], want), i
        steps = [alone.forward([SeqChunk([tok], len(prompts[i]) + j, tables[0],
                                         adapter=adapters[i])])[0]
                 for j, tok in enumerate(drafts[i])]
        assert torch.equal(verify[i], torch.cat(steps)), i
    base_only = ModelRunner(ours, config, KVCache(config, 32, BLOCK, torch.float32))
    plain = base_only.prefill(prompts[0], tables[0])
    assert torch.equal(first[0], plain)  # no adapter path touched the base rows
    assert not torch.equal(first[1], base_only.prefill(prompts[1], tables[1]))


def test_bad_adapters_are_refused(setup, tmp_path):
    hf, ours, config, paths, slots = setup
    runner = ModelRunner(ours, config, KVCache(config, 8, BLOCK, torch.float32))
    with pytest.raises(ValueError, match="no LoRA adapter in slot 7"):
        runner.forward([SeqChunk([1, 2], 0, [0], adapter=7)])
    with pytest.raises(ValueError, match="already loaded"):
        lora_bank(ours).add(LoraAdapter.load("a", paths["a"]))
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        LoraAdapter.load("x", tmp_path)
    emb = make_tiny_adapter(hf, tmp_path / "emb", seed=3, targets=["embed_tokens"])
    with pytest.raises(ValueError, match="embeddings"):
        LoraAdapter.load("emb", emb)
    other, _, _ = tiny_llama(seed=5, dtype=torch.float32, hidden_size=32)
    wrong = make_tiny_adapter(other, tmp_path / "wrong", seed=3)
    with pytest.raises(ValueError, match="another base model"):
        lora_bank(ours).add(LoraAdapter.load("wrong", wrong))
    assert set(lora_bank(ours).names) == {"a", "b"}
    cfg = json.loads((tmp_path / "wrong" / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (tmp_path / "wrong" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="DoRA"):
        LoraAdapter.load("dora", tmp_path / "wrong")


def test_remove_frees_the_slot(setup):
    hf, ours, config, paths, slots = setup
    bank = lora_bank(ours)
    slot = bank.add(LoraAdapter.load("c", paths["a"]))
    assert slot == 2 and bank.slot("c") == 2
    assert bank.remove("c") == 2 and "c" not in bank.names
    with pytest.raises(KeyError):
        bank.remove("c")
    assert bank.add(LoraAdapter.load("c", paths["a"])) == 2
    bank.remove("c")
