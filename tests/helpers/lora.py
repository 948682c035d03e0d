"""Small PEFT LoRA adapters made in a test (random A and B) and transformers + PEFT's merged
reference, for the LoRA tests (engine/lora.py)."""

from __future__ import annotations

import copy

import torch

#: every linear layer of a decoder layer
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_tiny_adapter(hf_model, path, seed: int, targets=TARGETS, rank: int = 4,
                      alpha: float = 8.0, std: float = 0.2) -> str:
    """Save a PEFT LoRA adapter of ``hf_model`` with random A and B (B is zero at PEFT's
    init, which would change nothing) to ``path``; returns the path."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                     init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(copy.deepcopy(hf_model), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
                        * std)
    peft_model.save_pretrained(str(path))
    return str(path)


def merged(hf_model, path):
    """transformers + PEFT: the base with the adapter at ``path`` merged into its weights."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(hf_model), str(path)).merge_and_unload()
