"""Frozen-KV MTP assistant checkpoints: ``assistant.safetensors`` (the assistant's own weights
and the ``draft_to_target`` ids of its draft vocabulary) and ``config.json`` (its shape, the
target it was trained for, how it was trained). The target's embedding and LM head are not
stored; they are read from the target's weights at load, as for an EAGLE head, and an
assistant trained for another target is refused (drafter/eagle/checkpoint.py
``HeadMismatch``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specmesh.drafter.eagle.checkpoint import check_target
from specmesh.drafter.frozen_kv.assistant import AssistantConfig, FrozenKVAssistant

WEIGHTS = "assistant.safetensors"
CONFIG = "config.json"
FORMAT = "specmesh-frozen-kv-mtp/1"


def save_assistant(model: FrozenKVAssistant, path: str | Path, training: dict | None = None,
                   dtype: torch.dtype = torch.float32) -> Path:
    """Write ``model``'s own weights (in ``dtype``: float32 or bfloat16, upcast at load) and
    its config to directory ``path``; returns it."""
    from safetensors.torch import save_file  # safetensors only when a checkpoint is written

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    tensors["draft_to_target"] = model.draft_to_target.detach().long().contiguous()
    save_file(tensors, str(out / WEIGHTS))
    meta = {"format": FORMAT, "config": model.config.to_dict(), "training": training or {}}
    (out / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def read_config(path: str | Path) -> AssistantConfig:
    """The config of the checkpoint at ``path``.

    Raises:
        FileNotFoundError: no checkpoint there. ValueError: not an assistant checkpoint.
    """
    p = Path(path)
    cfg_file = p / CONFIG
    if not cfg_file.is_file() or not (p / WEIGHTS).is_file():
        raise FileNotFoundError(f"no frozen-KV MTP assistant at {p} (need {CONFIG} and "
                                f"{WEIGHTS})")
    meta = json.loads(cfg_file.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{cfg_file} is not a specmesh frozen-KV MTP assistant config")
    return AssistantConfig.from_dict(meta["config"])


def load_assistant(path: str | Path, embed: torch.Tensor, lm_head: torch.Tensor,
                   target: dict, inv_freq: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float32) -> FrozenKVAssistant:
    """The assistant at ``path`` for the target described by ``target`` (``target_identity``)
    with the target's ``embed`` / ``lm_head`` [vocab, d] and RoPE ``inv_freq``.

    Raises:
        drafter.eagle.checkpoint.HeadMismatch: trained for another target.
        FileNotFoundError / ValueError: no (valid) checkpoint at ``path``.
    """
    from safetensors.torch import load_file  # safetensors only when a checkpoint is read

    cfg = read_config(path)
    check_target(cfg.target, target, str(path))
    tensors = load_file(str(Path(path) / WEIGHTS))
    ids = tensors.pop("draft_to_target")
    model = FrozenKVAssistant(cfg, inv_freq)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"assistant weights at {path} do not fit its config: missing "
                         f"{missing}, unexpected {unexpected}")
    model = model.to(dtype=dtype)
    model.set_target_weights(embed, lm_head, ids)
    return model.eval().requires_grad_(False)
