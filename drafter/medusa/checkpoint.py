"""Medusa head checkpoints: ``medusa.safetensors`` (the K residual blocks and the
``draft_to_target`` ids of the draft vocabulary) and ``config.json`` (format
``specmesh-medusa-heads/1``: :class:`~drafter.medusa.heads.MedusaConfig`, with the static tree
and the held-out numbers, plus how the heads were trained). The target's LM head is not
stored: :func:`load_heads` reads its rows from the target's weights, and heads trained for
another target are refused (drafter/eagle/checkpoint.py ``check_target``: name, vocabulary,
hidden size, layers and an embedding fingerprint)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specmesh.drafter.eagle.checkpoint import check_target
from specmesh.drafter.medusa.heads import MedusaConfig, MedusaHeads
from specmesh.drafter.medusa.tree import check_tree

WEIGHTS = "medusa.safetensors"
CONFIG = "config.json"
FORMAT = "specmesh-medusa-heads/1"


def save_heads(heads: MedusaHeads, path: str | Path, training: dict | None = None,
               dtype: torch.dtype = torch.float32) -> Path:
    """Write ``heads`` (weights in ``dtype``: float32 or bfloat16, :func:`load_heads`
    upcasts) and their config to directory ``path``; returns it."""
    from safetensors.torch import save_file  # safetensors only when heads are written

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in heads.state_dict().items()}
    tensors["draft_to_target"] = heads.draft_to_target.detach().long().contiguous()
    save_file(tensors, str(out / WEIGHTS))
    meta = {"format": FORMAT, "config": heads.config.to_dict(), "training": training or {}}
    (out / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def read_config(path: str | Path) -> MedusaConfig:
    """The config of the checkpoint at ``path``.

    Raises:
        FileNotFoundError: no checkpoint there. ValueError: not a Medusa checkpoint, or a tree
            that breaks :func:`~drafter.medusa.tree.check_tree`.
    """
    p = Path(path)
    cfg_file = p / CONFIG
    if not cfg_file.is_file() or not (p / WEIGHTS).is_file():
        raise FileNotFoundError(f"no Medusa checkpoint at {p} (need {CONFIG} and {WEIGHTS})")
    meta = json.loads(cfg_file.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{cfg_file} is not a specmesh Medusa heads config ({FORMAT})")
    cfg = MedusaConfig.from_dict(meta["config"])
    check_tree(cfg.tree, cfg.num_heads)
    return cfg


def load_heads(path: str | Path, lm_head: torch.Tensor, target: dict,
               dtype: torch.dtype = torch.float32) -> MedusaHeads:
    """The heads at ``path`` for the target ``target`` (drafter/eagle/checkpoint.py
    ``target_identity``) with the target's LM head ``lm_head`` [vocab, d], in ``dtype``.

    Raises:
        drafter.eagle.checkpoint.HeadMismatch: heads trained for another target.
        FileNotFoundError / ValueError: no (valid) checkpoint at ``path``.
    """
    from safetensors.torch import load_file  # safetensors only when heads are read

    cfg = read_config(path)
    check_target(cfg.target, target, str(path))
    tensors = load_file(str(Path(path) / WEIGHTS))
    ids = tensors.pop("draft_to_target")
    heads = MedusaHeads(cfg)
    missing, unexpected = heads.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"Medusa weights at {path} do not fit its config: missing {missing}, "
                         f"unexpected {unexpected}")
    heads = heads.to(dtype=dtype)
    heads.set_target_weights(lm_head, ids)
    return heads.eval().requires_grad_(False)
