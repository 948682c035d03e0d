"""The compiled float32 layer ops (kernels/layer_ops.py): RoPE equals the torch expression bit
for bit, RMSNorm with its residual add matches a float64 reference, every row is the same bits
whatever the other rows, the row count and the threads, and the model's forward on them equals
its forward on the torch ops up to rounding."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine.config import ModelConfig
from specmesh.engine.model import LlamaForCausalLM, _rotate_half
from specmesh.engine.runner import ModelRunner, SeqChunk
from specmesh.engine.kv_cache import KVCache
from specmesh.kernels import layer_ops
from helpers.backends import backend
from helpers.kernels import loads_with_a_failing_compiler


@pytest.fixture(autouse=True)
def _kernel():
    if not layer_ops.available():
        pytest.fail(f"the layer-ops kernel did not build: {layer_ops.KERNEL.failed}")


@pytest.mark.parametrize("t,heads,d", [(1, 1, 2), (3, 9, 64), (17, 3, 8), (70, 2, 34)])
def test_rope_is_the_torch_expression_bit_for_bit(t, heads, d):
    torch.manual_seed(t)
    fused = torch.randn(t, (heads + 5) * d) * 10  # q as a column slice of a fused product
    x = fused[:, d:(heads + 1) * d].reshape(t, heads, d)
    angles = torch.rand(t, 1, d) * 400
    cos, sin = angles.cos(), angles.sin()
    want = x * cos + _rotate_half(x) * sin
    got = layer_ops.rope(x, cos, sin)
    assert got.is_contiguous() and got.shape == (t, heads, d)
    assert torch.equal(got, want)


@pytest.mark.parametrize("hidden", [1, 7, 13, 576, 1003])
def test_rms_norm_and_residual_add_match_the_reference(hidden):
    torch.manual_seed(hidden)
    m = 9
    x = torch.randn(m, hidden) * torch.rand(m, 1) * 30
    residual = torch.randn(m, 2 * hidden)[:, ::2]  # a strided input is taken too
    weight = torch.randn(hidden)
    h, y = layer_ops.add_rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(h, x + residual)  # the add is one IEEE add, as torch's
    h64 = h.double()
    want = weight.double() * h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-6)
    h_alone, y_alone = layer_ops.add_rms_norm(h, weight, 1e-5)
    assert h_alone is h and torch.equal(y_alone, y)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(h, (hidden,), weight, 1e-5),
                               rtol=1e-5, atol=1e-6)


def test_rows_do_not_depend_on_the_batch_or_the_threads():
    torch.manual_seed(0)
    x, residual = torch.randn(2, 70, 576).unbind(0)
    weight = torch.randn(576)
    q = torch.randn(70, 9, 64)
    angles = torch.rand(70, 1, 64) * 100
    cos, sin = angles.cos(), angles.sin()
    threads = torch.get_num_threads()
    try:
        whole = {}
        for n in (1, 2):
            torch.set_num_threads(n)
            whole[n] = (layer_ops.add_rms_norm(x, weight, 1e-6, residual)[1],
                        layer_ops.rope(q, cos, sin))
        assert all(torch.equal(a, b) for a, b in zip(whole[1], whole[2]))
        for m in (1, 2, 5, 63, 64, 65):
            for start in (0, 70 - m):
                rows = slice(start, start + m)
                y = layer_ops.add_rms_norm(x[rows], weight, 1e-6, residual[rows])[1]
                assert torch.equal(y, whole[2][0][rows])
                assert torch.equal(layer_ops.rope(q[rows], cos[rows], sin[rows]), whole[2][1][rows])
    finally:
        torch.set_num_threads(threads)


def _tiny_model(on: bool = True) -> tuple[LlamaForCausalLM, ModelConfig]:
    """A tiny float32 Llama (the same weights every call) whose CPU backend has the layer ops
    ``on`` or off."""
    config = ModelConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=3,
                         num_heads=6, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                         rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, backend(layer_ops=on)).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model, config


def test_the_forward_on_the_ops_equals_the_torch_ops_forward(monkeypatch):
    model, config = _tiny_model()
    calls = {"rms": 0, "rope": 0, "silu": 0}
    real_rms, real_rope = layer_ops.add_rms_norm, layer_ops.rope

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    def forward(model: LlamaForCausalLM) -> tuple[list[torch.Tensor], ...]:
        cache = KVCache(config, 8, 4, dtype="float32")
        runner = ModelRunner(model, config, cache)
        runner.forward([SeqChunk(list(range(1, 10)), 0, [0, 1, 2])], logits="last")
        chunks = [SeqChunk([5, 6, 7], 9, [0, 1, 2]), SeqChunk([8], 0, [3])]
        logits, hidden = runner.forward(chunks, logits="all", return_hidden=True)
        captured = runner.forward(chunks, logits="all", return_hidden=True,
                                  hidden_layers=(0, 2))[1]  # the same K/V written again
        return logits, hidden, captured

    monkeypatch.setattr(layer_ops, "add_rms_norm", count("rms", real_rms))
    monkeypatch.setattr(layer_ops, "rope", count("rope", real_rope))
    monkeypatch.setattr(layer_ops, "silu_mul", count("silu", layer_ops.silu_mul))
    logits, hidden, captured = forward(model)
    forwards = 3
    assert calls["rms"] == forwards * (2 * config.num_layers + 1)
    assert calls["rope"] == forwards * 2 * config.num_layers
    ops = dict(calls)  # silu_mul too where the fused gate/up product runs (prepacked)
    off, _ = _tiny_model(on=False)  # the same weights, the backend's layer_ops off
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), off.parameters()))
    logits_torch, hidden_torch, captured_torch = forward(off)
    assert calls == ops  # none called again
    for a, b in zip(logits, logits_torch):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    torch.testing.assert_close(hidden, hidden_torch, rtol=1e-5, atol=1e-5)
    assert captured[0].shape == (3, 2 * config.hidden_size)
    torch.testing.assert_close(captured, captured_torch, rtol=1e-5, atol=1e-5)


def test_autograd_and_other_dtypes_keep_the_torch_ops():
    w = torch.ones(8, requires_grad=True)
    assert layer_ops.applies(torch.randn(2, 8), torch.randn(8))
    assert not layer_ops.applies(torch.randn(2, 8), w)  # grad enabled, a parameter needs it
    with torch.no_grad():
        assert layer_ops.applies(torch.randn(2, 8), w)
    assert not layer_ops.applies(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(8))
    assert not layer_ops.applies(torch.randn(2, 8, dtype=torch.float64), torch.randn(8))


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match=r"x must be \[M, 8\]"):
        layer_ops.add_rms_norm(torch.randn(2, 7), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="residual has 3 rows"):
        layer_ops.add_rms_norm(torch.randn(2, 8), torch.randn(8), 1e-6, torch.randn(3, 8))
    with pytest.raises(ValueError, match="float32 CPU"):
        layer_ops.add_rms_norm(torch.randn(2, 8).bfloat16(), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="even D"):
        layer_ops.rope(torch.randn(2, 3, 5), torch.randn(2, 1, 5), torch.randn(2, 1, 5))
    with pytest.raises(ValueError, match=r"cos / sin must hold \[T=2, D=4\]"):
        layer_ops.rope(torch.randn(2, 3, 4), torch.randn(3, 1, 4), torch.randn(3, 1, 4))


def test_unavailable_the_ops_say_so_and_the_model_keeps_torch(monkeypatch):
    monkeypatch.setattr(layer_ops.KERNEL, "lib", None)  # as in a process that could not build
    monkeypatch.setattr(layer_ops.KERNEL, "failed", "no C++ compiler")
    assert not layer_ops.available() and not layer_ops.applies(torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="not available: no C"):
        layer_ops.rope(torch.randn(2, 3, 4), torch.randn(2, 1, 4), torch.randn(2, 1, 4))
    model, config = _tiny_model()  # its backend has layer_ops on: the ops' own check decides
    runner = ModelRunner(model, config, KVCache(config, 4, 4, dtype="float32"))
    assert runner.forward([SeqChunk([1, 2, 3], 0, [0])], logits="last")[0].shape == (1, 97)


def test_build_failure_falls_back_with_a_warning(monkeypatch, tmp_path, caplog):
    assert not loads_with_a_failing_compiler(layer_ops.KERNEL, monkeypatch, tmp_path, caplog)
    assert "keeping the torch ops" in caplog.text
    assert list(tmp_path.iterdir()) == []
