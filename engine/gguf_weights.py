"""Keep a GGUF model's linear weights in their GGUF blocks for CPU float32 inference
(:mod:`kernels.gguf_matmul`): after the model is built from transformers' dequantized float32
weights, each :class:`engine.linear.RowInvariantLinear` whose GGUF tensor is Q4_1 or Q8_0 gets
that tensor's blocks, checked to expand to its float32 weight bit for bit (rows matched, since
transformers reorders the rows of q/k for its rotary layout). A layer whose blocks do not match
keeps its dense weight. The dense parameters stay (state dict, embedding lookups, fallbacks).

SmolLM2-135M, float32: the weights a one-token step reads go from 540 MB to about 100 MB
(docs/benchmarks.md, 'Compiled kernels').
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specmesh.engine.backend import CpuBackend, default_backend
from specmesh.engine.linear import RowInvariantLinear
from specmesh.kernels import gguf_matmul
from specmesh.kernels.gguf_matmul import BlockWeight

log = logging.getLogger(__name__)

#: The repacked, row-matched blocks kept in the model's weights cache dir (reading the GGUF's
#: metadata with gguf-py takes seconds; this file loads in a fraction of one).
BLOCKS_FILE = "gguf_blocks.safetensors"
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def hf_name(gguf_name: str) -> str | None:
    """The transformers parameter name of a GGUF Llama tensor name (None: not a linear)."""
    if gguf_name == "output.weight":
        return "lm_head.weight"
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    m = _LAYER.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
    return None


def read_block_weights(path: Path) -> dict[str, BlockWeight]:
    """The Q4_1 / Q8_0 linear tensors of the GGUF file ``path``, by transformers name."""
    from gguf import GGUFReader  # gguf only when a GGUF file is read (slow to import)

    out = {}
    for tensor in GGUFReader(str(path)).tensors:
        name, fmt = hf_name(tensor.name), tensor.tensor_type.name
        if name is not None and fmt in gguf_matmul.FORMATS:
            raw = torch.from_numpy(np.ascontiguousarray(tensor.data, dtype=np.uint8))
            out[name] = BlockWeight.from_gguf(fmt, raw)
    return out


def _matching(blocks: BlockWeight, weight: torch.Tensor) -> BlockWeight | None:
    """``blocks`` with its rows in ``weight``'s order, if they expand to ``weight`` bit for bit."""
    if tuple(weight.shape) != (blocks.out_features, blocks.in_features):
        return None
    dense = blocks.dequantize()
    if torch.equal(dense, weight):
        return blocks
    rows = {dense[i].numpy().tobytes(): i for i in range(dense.shape[0])}
    index = [rows.get(weight[i].numpy().tobytes(), -1) for i in range(weight.shape[0])]
    if -1 in index:
        return None
    picked = blocks.take_rows(torch.tensor(index))
    return picked if torch.equal(picked.dequantize(), weight) else None


def _load_cached(path: Path) -> dict[str, BlockWeight]:
    from safetensors import safe_open  # safetensors only for the blocks cache

    out = {}
    with safe_open(str(path), framework="pt") as f:
        for name, fmt in (f.metadata() or {}).items():
            minv = f.get_tensor(f"{name}.minv") if fmt == "Q4_1" else None
            out[name] = BlockWeight(fmt, f.get_tensor(f"{name}.scale"), minv,
                                    f.get_tensor(f"{name}.qs"))
    return out


def _save_cached(path: Path, blocks: dict[str, BlockWeight]) -> None:
    from safetensors.torch import save_file  # safetensors only for the blocks cache

    tensors = {}
    for name, b in blocks.items():
        tensors.update({f"{name}.scale": b.scale, f"{name}.qs": b.qs})
        if b.minv is not None:
            tensors[f"{name}.minv"] = b.minv
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={name: b.fmt for name, b in blocks.items()})
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _from_gguf(model: nn.Module, path: Path, tied: bool) -> dict[str, BlockWeight]:
    """Each RowInvariantLinear's blocks from the GGUF file, rows matched to its weight."""
    blocks = read_block_weights(path)
    if tied and "lm_head.weight" not in blocks and "model.embed_tokens.weight" in blocks:
        blocks["lm_head.weight"] = blocks["model.embed_tokens.weight"]
    out, refused = {}, []
    for name, module in model.named_modules():
        if isinstance(module, RowInvariantLinear) and f"{name}.weight" in blocks:
            match = _matching(blocks[f"{name}.weight"], module.weight)
            if match is None:
                refused.append(name)
            else:
                out[name] = match
    if refused:
        log.warning("GGUF blocks do not match the loaded weights of %s; they stay dense",
                    refused[:5])
    return out


def attach_block_weights(model: nn.Module, path: Path, tied: bool,
                         cache_dir: Path | None = None, backend: CpuBackend | None = None) -> int:
    """Give each float32 CPU :class:`RowInvariantLinear` of ``model`` its GGUF blocks from the
    file ``path`` (``tied``: the LM head is the token embedding). With ``cache_dir`` the
    matched blocks are kept there (:data:`BLOCKS_FILE`) and read back on later loads; every
    layer's blocks are checked against its weight either way. ``backend``: the CPU backend
    (default: the model's ``backend``, else the process's). Returns how many layers got them:
    0 when the backend's ``gguf_matmul`` is off, the kernel cannot be built, or the model is
    not float32 on CPU."""
    if backend is None:
        backend = getattr(model, "backend", None) or default_backend()
    first = next(model.parameters())
    if first.dtype != torch.float32 or first.device.type != "cpu" \
            or not backend.gguf_matmul.on or not gguf_matmul.available():
        return 0
    cached = None if cache_dir is None else cache_dir / BLOCKS_FILE
    modules = dict(model.named_modules())
    with torch.no_grad():
        blocks = None
        if cached is not None and cached.is_file():
            from safetensors import SafetensorError  # safetensors only for the blocks cache

            try:
                blocks = _load_cached(cached)
            except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # rebuild it
                log.warning("could not read %s (%s); reading the GGUF again", cached, e)
        if blocks is None:
            blocks = _from_gguf(model, path, tied)
            if cached is not None:
                try:
                    _save_cached(cached, blocks)
                except OSError as e:
                    log.warning("could not write %s: %s", cached, e)
        attached = 0
        for name, b in blocks.items():
            module = modules.get(name)
            if isinstance(module, RowInvariantLinear) and \
                    tuple(module.weight.shape) == (b.out_features, b.in_features) and \
                    torch.equal(b.dequantize(), module.weight):
                module.attach_blocks(b)
                attached += 1
    return attached


__all__ = ["attach_block_weights", "hf_name", "read_block_weights"]
