"""A drafting head on Q8_0 blocks: the EAGLE head's products on 8-bit weights on CPU.

Why: a draft is one head entry (the fusion layer, one decoder layer) and one LM-head product
over the draft vocabulary, about 9 M float32 weights, 37 MB read per draft from memory. The
target's float32 forward reads its layers from their GGUF blocks (kernels/gguf_matmul.py), so
a float32 head cost a large share of a target step per draft (docs/benchmarks.md, 'Drafting'):
the drafter's time per verify step then ate what its accepted drafts saved. Rounded to Q8_0
(llama.cpp's 8-bit format, a scale per 32 weights) the head reads about a quarter of those
bytes, through the same compiled kernel.

What changes: the head's linear weights become their Q8_0 rounding (each weight moves by at
most half a quantization step; the module's parameters hold the rounded values, so every path
of the head computes with the same weights), and the LM head rows, the target's embedding,
which SmolLM2's GGUF file holds as Q8_0 already, come back bit for bit. Drafts are proposals:
the verifier's exactness does not depend on them. Acceptance measured on the held-out chat
prompts is in drafter/heads/smollm2-135m-instruct/README.md.

Applies to a float32 head on CPU when the GGUF matmul kernel is available and the CPU backend
(engine/backend.py) has ``eagle_q8_0`` on; off, the head keeps float32.
"""

from __future__ import annotations

import torch

from specmesh.drafter.eagle.head import EagleHead
from specmesh.engine.backend import CpuBackend
from specmesh.engine.linear import RowInvariantLinear
from specmesh.kernels import gguf_matmul
from specmesh.kernels.gguf_matmul import BlockWeight


def quantize_linears(module: torch.nn.Module, backend: CpuBackend) -> int:
    """Round every :class:`RowInvariantLinear` of ``module`` (whose input width is a whole
    number of Q8_0 blocks) to Q8_0 in place and compute it on its blocks. Returns how many;
    0 where ``backend`` has ``eagle_q8_0`` off, the kernel is unavailable or the weights are
    not float32 on CPU."""
    if not backend.eagle_q8_0.on or not gguf_matmul.available():
        return 0
    n = 0
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, RowInvariantLinear) and m.in_features % gguf_matmul.BLOCK == 0 \
                    and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu":
                blocks = BlockWeight.quantize_q8_0(m.weight)
                m.weight.copy_(blocks.dequantize())
                m.attach_blocks(blocks)
                n += 1
    return n


def quantize_rows(weight: torch.Tensor, backend: CpuBackend
                  ) -> tuple[BlockWeight, tuple[int, int]] | None:
    """Round a frozen [rows, d] float32 CPU product weight (an LM head) to Q8_0 in place:
    ``(blocks, (data_ptr, _version))``, the key that says the blocks still expand to it; None
    (the weight untouched) where ``backend`` has ``eagle_q8_0`` off, the kernel is
    unavailable, ``d`` is not a whole number of blocks or the weight is not float32 on CPU."""
    if not backend.eagle_q8_0.on or not gguf_matmul.available() \
            or weight.dtype != torch.float32 or weight.device.type != "cpu" \
            or weight.shape[1] % gguf_matmul.BLOCK:
        return None
    with torch.no_grad():
        blocks = BlockWeight.quantize_q8_0(weight)
        weight.copy_(blocks.dequantize())
    return blocks, (weight.data_ptr(), weight._version)


def quantize_head(head: EagleHead, backend: CpuBackend | None = None) -> int:
    """Round ``head``'s linear layers and LM head to Q8_0 in place and compute them on their
    blocks (inference only: the blocks drop out as soon as a weight changes). ``backend``: the
    CPU backend that decides (default: the head's own). Returns how many products run on
    blocks (0: not a float32 CPU head, the kernel is unavailable, or ``eagle_q8_0`` is off)."""
    backend = backend if backend is not None else head.backend
    n = quantize_linears(head, backend)
    head.lm_head_blocks = quantize_rows(head.lm_head, backend)
    return n + (head.lm_head_blocks is not None)


__all__ = ["quantize_head", "quantize_linears", "quantize_rows"]
