"""An untrained EAGLE head for a test target, saved as a checkpoint (``--drafter eagle:PATH``):
its drafts are mostly wrong, which is what exactness tests want."""

from __future__ import annotations

from pathlib import Path


def save_random_head(model_dir: str, path: str | Path, seed: int = 0) -> str:
    """Write a randomly initialised head of ``model_dir``'s layer shape, naming that target,
    to ``path``; returns the checkpoint directory."""
    import torch
    from transformers import AutoConfig

    from drafter.eagle.checkpoint import save_head, target_embeddings, target_identity
    from drafter.eagle.head import EagleHead, EagleHeadConfig
    from engine.config import ModelConfig
    from engine.loader import model_identity

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    embed, _ = target_embeddings(model_dir)
    name = model_identity(model_dir, "float32", 16)["name"]
    torch.manual_seed(seed)
    head = EagleHead(EagleHeadConfig.for_target(config,
                                                target=target_identity(name, config, embed)))
    return str(save_head(head, path))
