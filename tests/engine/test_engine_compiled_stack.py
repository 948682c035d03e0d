"""The decoder layers as one compiled call (engine/compiled_stack.py): on a model whose linear
layers are GGUF blocks, decode, verify (chains and token trees), batches and chunked prefill
give the same logits, hidden states and cache contents, bit for bit, as the layer-by-layer
path (the same model built with the CPU backend's ``compiled_stack`` off); anything the call
cannot run falls back to that path; bad slots are clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.backends import backend
from specmesh.engine import compiled_stack
from specmesh.engine.config import ModelConfig
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.linear import RowInvariantLinear
from specmesh.engine.model import LlamaForCausalLM
from specmesh.engine.runner import ModelRunner, SeqChunk
from specmesh.kernels import gguf_matmul, layer_ops
from specmesh.kernels.gguf_matmul import BlockWeight

CONFIG = ModelConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                     rope_theta=10000.0, tie_word_embeddings=False)
ON, OFF = backend(compiled_stack=True), backend(compiled_stack=False)


def _blocks(fmt: str, n: int, k: int, rng: np.random.Generator) -> BlockWeight:
    """Random GGUF blocks [n, k / 32] with small f16 scales (a model that stays finite)."""
    _, block_bytes, _ = gguf_matmul.FORMATS[fmt]
    raw = rng.integers(0, 256, size=(n, k // 32, block_bytes), dtype=np.uint8)
    scales = rng.uniform(0.005, 0.03, (n, k // 32, 2)) * rng.choice([-1, 1], (n, k // 32, 2))
    raw[..., :4 if fmt == "Q4_1" else 2] = scales.astype(np.float16)[
        ..., :2 if fmt == "Q4_1" else 1].view(np.uint8)
    return BlockWeight.from_gguf(fmt, torch.from_numpy(raw.reshape(n, -1)))


#: head_dim 64: the attention kernel's vector path (CONFIG's 16 takes its generic loops)
CONFIG_D64 = ModelConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_layers=3,
                         num_heads=2, num_kv_heads=1, head_dim=64, rms_norm_eps=1e-6,
                         rope_theta=10000.0, tie_word_embeddings=False)


def _model(fmt: str = "Q4_1", cpu_backend=ON,  # noqa: ANN001
           config: ModelConfig = CONFIG) -> LlamaForCausalLM:
    """A tiny float32 Llama whose linear layers (all but the LM head) compute on GGUF blocks,
    their dense weights the blocks' values, as engine/gguf_weights.py attaches them; the same
    weights for every ``cpu_backend`` (seeded)."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = LlamaForCausalLM(config, cpu_backend).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    with torch.no_grad():
        for name, lin in model.named_modules():
            if isinstance(lin, RowInvariantLinear) and name != "lm_head":
                blocks = _blocks(fmt if "down" not in name else "Q8_0", lin.out_features,
                                 lin.in_features, rng)
                lin.weight.copy_(blocks.dequantize())
                lin.attach_blocks(blocks)
    return model


@pytest.fixture(autouse=True)
def _kernels():
    if not (layer_ops.available() and gguf_matmul.available()):
        pytest.fail("the compiled kernels did not build")
    assert ON.compiled_stack.on, ON.compiled_stack.why


def _steps(model: LlamaForCausalLM, kv_dtype: str = "float32") -> tuple[list, torch.Tensor]:
    """Prefill two requests, then a decode batch, a verify chain, a token-tree verify and a
    chunked-prefill chunk with hidden layers; returns every output and the cache."""
    cache = KVCache(model.config, 16, 4, dtype=kv_dtype)
    runner = ModelRunner(model, model.config, cache)
    a, b = [0, 1, 2, 3, 4], [5, 6, 7, 8, 9]
    outs = [runner.forward([SeqChunk(list(range(3, 12)), 0, a),
                            SeqChunk(list(range(20, 26)), 0, b)], logits="last")]
    outs.append(runner.forward([SeqChunk([40], 9, a), SeqChunk([41], 6, b)]))  # decode
    outs.append(runner.forward([SeqChunk([42, 43, 44, 45, 46], 10, a)],  # verify, a chain
                               return_hidden=True))
    outs.append(runner.forward([SeqChunk([50, 51, 52, 53, 54], 7, b,  # a token tree
                                         parents=[-1, -1, 0, 1])], return_hidden=True))
    outs.append(runner.forward([SeqChunk(list(range(60, 66)), 12, b)],  # a prefill chunk
                               return_hidden=True, hidden_layers=(0, 2)))
    return outs, cache.data.clone()


def _flat(x) -> list[torch.Tensor]:  # noqa: ANN001
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in x for t in _flat(item)]


@pytest.mark.parametrize("fmt, kv_dtype, config", [
    ("Q4_1", "float32", CONFIG), ("Q8_0", "float32", CONFIG),
    # a 16-bit KV cache (--kv-cache-dtype): K/V rounded as KVCache.write rounds them, read by
    # the kernel's generic loops (head_dim 16) and its vector path (64)
    ("Q4_1", "bfloat16", CONFIG), ("Q4_1", "float16", CONFIG),
    ("Q8_0", "bfloat16", CONFIG_D64), ("Q8_0", "float16", CONFIG_D64)])
def test_the_compiled_layers_equal_the_layer_by_layer_path_bit_for_bit(fmt, kv_dtype, config,
                                                                       monkeypatch):
    runs = []
    real = compiled_stack.CompiledStack.run
    ran = []

    def counted(self, *a, **k):
        out = real(self, *a, **k)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(compiled_stack.CompiledStack, "run", counted)
    for compiled in (True, False):
        ran.clear()
        runs.append(_steps(_model(fmt, ON if compiled else OFF, config), kv_dtype))
        # the whole-prompt prefill keeps SDPA; every later forward ran compiled (or not at all)
        assert ran == ([False, True, True, True, True] if compiled else [False] * 5)
    (outs, cache), (outs_ref, cache_ref) = runs
    got, want = _flat(outs), _flat(outs_ref)
    assert len(got) == len(want) == 10
    for x, y in zip(got, want):
        assert x.shape == y.shape and torch.equal(x, y)
    assert torch.equal(cache, cache_ref)  # the same K/V in the same slots
    assert cache.dtype == getattr(torch, kv_dtype)
    assert torch.isfinite(got[-1]).all() and got[-1].abs().max() > 0


def test_anything_it_cannot_run_falls_back_to_the_layer_by_layer_path(monkeypatch):
    model = _model()
    stack = compiled_stack.CompiledStack(model)
    cache = KVCache(CONFIG, 8, 4, dtype="float32")
    runner = ModelRunner(model, CONFIG, cache)
    runner.forward([SeqChunk([1, 2, 3], 0, [0])])

    def decode_runs_compiled() -> bool:
        model._compiled = stack
        seen = []
        real = stack.run
        monkeypatch.setattr(stack, "run", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
        runner.forward([SeqChunk([4], 3, [0])])
        monkeypatch.undo()
        return seen[-1] is not None

    assert decode_runs_compiled()
    with torch.no_grad():  # a changed weight drops its blocks: that layer runs dense
        model.model.layers[1].mlp.down_proj.weight.mul_(1.0)
    assert not decode_runs_compiled()
    model = _model()
    stack = compiled_stack.CompiledStack(model)
    runner = ModelRunner(model, CONFIG, cache)
    assert decode_runs_compiled()
    model.model.layers[0].self_attn.q_proj.bias = torch.nn.Parameter(torch.zeros(64))
    assert not decode_runs_compiled()  # a bias: the compiled call has none


def test_a_slot_outside_the_cache_is_a_clear_error_and_writes_nothing():
    model = _model()
    cache = KVCache(CONFIG, 4, 4, dtype="float32")
    runner = ModelRunner(model, CONFIG, cache)
    runner.forward([SeqChunk([1, 2, 3], 0, [0])])
    stack = compiled_stack.CompiledStack(model)
    h = torch.randn(1, CONFIG.hidden_size)
    cos, sin = model.rope(torch.tensor([3]), torch.float32)
    from specmesh.engine.model import AttentionMetadata

    meta = AttentionMetadata.build([1], [3], [[0]], 4)
    meta.prepare(torch.device("cpu"))
    with torch.inference_mode():
        assert stack.run(h.clone(), cos, sin, meta, cache) is not None  # slot 3 is fine
        before = cache.data.clone()
        meta.slot_mapping = torch.tensor([16])  # one past the last slot
        with pytest.raises(IndexError, match=r"slots outside \[0, 16\)"):
            stack.run(h, cos, sin, meta, cache)
    assert torch.equal(cache.data, before)


@pytest.mark.parametrize("off", ["compiled_stack", "layer_ops", "gguf_matmul",
                                 "cpu_attention"])
def test_a_backend_without_it_does_not_run_it(off):
    """Off by override, or a part it needs off (decided by engine/backend.py), the model runs
    layer by layer; the same model with the stack on runs it."""
    from specmesh.engine.model import AttentionMetadata

    assert not backend(**{off: False}).compiled_stack.on
    for cpu_backend, runs in ((backend(**{off: False}), False), (ON, True)):
        model = _model(cpu_backend=cpu_backend)
        cache = KVCache(CONFIG, 4, 4, dtype="float32")
        ModelRunner(model, CONFIG, cache).forward([SeqChunk([1, 2, 3], 0, [0])])
        meta = AttentionMetadata.build([1], [3], [[0]], 4)
        meta.prepare(torch.device("cpu"))
        cos, sin = model.rope(torch.tensor([3]), torch.float32)
        with torch.inference_mode():
            out = compiled_stack.CompiledStack(model).run(torch.randn(1, 64), cos, sin, meta,
                                                          cache)
        assert (out is not None) == runs


def test_the_compiled_call_follows_a_new_cache_and_replaced_norm_weights():
    """Its pointers are cached between forwards: a new KV cache, a norm weight replaced by
    another tensor, or a weight whose storage was swapped must rebuild them (else it reads
    freed or stale memory); each forward then still equals the layer-by-layer path (the same
    model, changed the same way, with ``compiled_stack`` off)."""
    models = {True: _model(), False: _model(cpu_backend=OFF)}

    def decode_logits(compiled: bool, cache: KVCache) -> torch.Tensor:
        runner = ModelRunner(models[compiled], CONFIG, cache)
        runner.forward([SeqChunk([1, 2, 3], 0, [0])])
        return runner.forward([SeqChunk([4], 3, [0])])[0]

    def same_both_ways() -> None:
        got = decode_logits(True, KVCache(CONFIG, 8, 4, dtype="float32"))
        assert torch.equal(got, decode_logits(False, KVCache(CONFIG, 8, 4, dtype="float32")))

    same_both_ways()
    for model in models.values():
        norm = model.model.layers[1].post_attention_layernorm
        norm.weight = torch.nn.Parameter(norm.weight.detach() * 1.5)  # another tensor
    same_both_ways()
    for model in models.values():
        with torch.no_grad():  # the same Parameter on new storage
            model.model.layers[2].input_layernorm.weight.data = \
                model.model.layers[2].input_layernorm.weight.detach() * 0.5
    same_both_ways()
