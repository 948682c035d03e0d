"""The two shipped SmolLM2 adapters (engine/lora_adapters/, trained by engine/lora_training.py;
issue 37) change the output as documented, served side by side with the base in one bank:
``caps`` echoes the question in capitals, ``json`` answers ``{"request": "<the question>"}``,
where the base answers it."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine.kv_cache import KVCache
from specmesh.engine.loader import load_model, load_tokenizer
from specmesh.engine.lora import BASE, lora_bank
from specmesh.engine.lora_peft import LoraAdapter
from specmesh.engine.lora_training import STYLES, shipped_adapter
from specmesh.engine.runner import ModelRunner, SeqChunk

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"


def _greedy(loaded, ids: list[int], slot: int, eos: int, n: int = 24) -> list[int]:
    runner = ModelRunner(loaded.model, loaded.config, KVCache(loaded.config, 8, 16,
                                                              torch.float32))
    table = list(range(8))
    out = [int(runner.prefill(ids, table, adapter=slot)[0].argmax())]
    while len(out) < n and out[-1] != eos:
        pos = len(ids) + len(out) - 1
        out.append(int(runner.forward([SeqChunk([out[-1]], pos, table, adapter=slot)])[0][0]
                       .argmax()))
    return out[:-1] if out[-1] == eos else out


def test_shipped_adapters_answer_in_their_style():
    loaded = load_model(dtype="float32")
    tok = load_tokenizer(None)
    bank = lora_bank(loaded.model)
    slots = {s: bank.add(LoraAdapter.load(s, shipped_adapter(s))) for s in STYLES}
    enc = tok.apply_chat_template([{"role": "user", "content": QUESTION}],
                                  add_generation_prompt=True)
    ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    text = {s: tok.decode(_greedy(loaded, ids, slot, eos)).strip()
            for s, slot in {**slots, "base": BASE}.items()}
    assert "Paris" in text["base"], text
    assert text["caps"] == QUESTION.upper(), text
    assert text["json"] == '{"request": "%s"}' % QUESTION, text
