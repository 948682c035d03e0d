"""The EAGLE head on Q8_0 blocks (drafter/eagle/quantize.py): llama.cpp's Q8_0 rounding, the
head computing on blocks that hold exactly its (rounded) weights, row invariance of its
products, the backend's ``eagle_q8_0`` choice, and drafting through the in-process workers with the rounded head."""

import pytest
import torch

from helpers.backends import backend
from specmesh.drafter.eagle.quantize import quantize_head
from specmesh.drafter.proposers.eagle import load_eagle_head
from specmesh.engine.linear import RowInvariantLinear
from specmesh.engine.loader import load_model
from specmesh.kernels import gguf_matmul
from specmesh.kernels.gguf_matmul import BlockWeight
from tests.helpers.eagle_heads import assert_eagle_equals_plain_decode

# a string: evaluated when a test that needs it runs, so collecting builds no kernel
needs_kernel = pytest.mark.skipif("not gguf_matmul.available()",
                                  reason="the GGUF matmul kernel cannot be built here")


def load_head(tiny_model_dir, tiny_eagle_head, q8_0: bool):  # noqa: ANN001, ANN201
    """The tiny test head loaded with the CPU backend's ``eagle_q8_0`` on or off."""
    return load_eagle_head(tiny_eagle_head[0], tiny_model_dir,
                           backend=backend(eagle_q8_0=q8_0))


def test_q8_0_rounding_gives_back_the_blocks_a_q8_0_weight_came_from():
    g = torch.Generator().manual_seed(0)
    n, kb = 24, 5
    q = torch.randint(-127, 128, (n, kb, 32), generator=g, dtype=torch.int8)
    q[..., 7] = torch.where(torch.rand(n, kb, generator=g) < 0.5, 127, -127).to(torch.int8)
    scale = (torch.rand(n, kb, generator=g) * 0.02 + 1e-4).half().float()
    original = BlockWeight("Q8_0", scale, None, q)
    again = BlockWeight.quantize_q8_0(original.dequantize())
    assert torch.equal(again.qs, original.qs) and torch.equal(again.scale, original.scale)


def test_q8_0_rounding_moves_each_weight_by_at_most_half_a_step():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 96, generator=g) * torch.logspace(-3, 1, 40)[:, None]
    w[3, 32:64] = 0.0  # an all-zero block stays zero
    b = BlockWeight.quantize_q8_0(w)
    err = (b.dequantize() - w).abs().reshape(40, 3, 32)
    assert bool((err <= b.scale[..., None] / 2 * (1 + 1e-3) + 1e-12).all())
    assert bool((b.dequantize()[3, 32:64] == 0).all())
    assert int(b.qs.abs().max()) <= 127


@pytest.mark.parametrize("bad", [torch.zeros(4, 33), torch.zeros(4, 32, dtype=torch.float64),
                                 torch.zeros(32)])
def test_q8_0_rounding_refuses_what_it_cannot_hold(bad):
    with pytest.raises(ValueError, match="Q8_0"):
        BlockWeight.quantize_q8_0(bad)


@needs_kernel
def test_a_loaded_head_computes_on_blocks_that_hold_its_rounded_weights(
        tiny_model_dir, tiny_eagle_head):
    plain = load_head(tiny_model_dir, tiny_eagle_head, q8_0=False)
    head = load_head(tiny_model_dir, tiny_eagle_head, q8_0=True)
    x = torch.randn(5, head.config.hidden_size)
    linears = {n: m for n, m in head.named_modules() if isinstance(m, RowInvariantLinear)}
    plain_linears = dict(plain.named_modules())
    assert any(m.in_features % 32 == 0 for m in linears.values())
    for name, m in linears.items():
        blocks = m.blocks_for(torch.randn(3, m.in_features))
        if m.in_features % 32:  # no whole blocks: it keeps its float32 weight
            assert blocks is None and torch.equal(m.weight, plain_linears[name].weight)
            continue
        assert blocks is not None, name
        assert torch.equal(m.weight, blocks.dequantize()), name  # the blocks hold the weight
        step = blocks.scale.repeat_interleave(32, dim=1)
        assert bool(((m.weight - plain_linears[name].weight).abs() <= step / 2 * 1.001).all())
        assert not torch.equal(m.weight, plain_linears[name].weight)  # really rounded
    lm_blocks = head.lm_head_blocks[0]
    assert torch.equal(head.lm_head, lm_blocks.dequantize())
    with torch.inference_mode():
        logits = head.logits(x)
        assert torch.equal(logits, gguf_matmul.gguf_matmul(x, lm_blocks))  # on the blocks
        torch.testing.assert_close(logits, x @ head.lm_head.T, rtol=1e-4, atol=1e-4)
        for i in range(x.shape[0]):  # row-invariant: a row alone is the row in the batch
            assert torch.equal(head.logits(x[i:i + 1])[0], logits[i])


@needs_kernel
def test_quantize_head_leaves_the_head_alone_when_switched_off_or_not_float32(
        tiny_model_dir, tiny_eagle_head):
    head = load_head(tiny_model_dir, tiny_eagle_head, q8_0=False)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    assert quantize_head(head) == 0  # the head's own backend: eagle_q8_0 off
    assert head.fc._blocks is None and head.lm_head_blocks is None
    assert not backend(gguf_matmul=False).eagle_q8_0.on  # no kernel, no Q8_0 head
    assert quantize_head(head, backend(gguf_matmul=False)) == 0
    assert quantize_head(head.to(torch.float64), backend(eagle_q8_0=True)) == 0
    assert all(torch.equal(v.double(), head.state_dict()[k]) for k, v in before.items())


@needs_kernel
def test_float32_greedy_output_with_the_rounded_head_equals_plain_decode_with_drafts_accepted(
        tiny_model_dir, tiny_eagle_head):
    lm = load_model(tiny_model_dir, "float32")
    head = load_head(tiny_model_dir, tiny_eagle_head, q8_0=True)
    assert head.fc._blocks is not None and head.lm_head_blocks is not None
    assert_eagle_equals_plain_decode(lm, head, tiny_eagle_head[1])
