"""A trained draft model on disk (``specmesh train-drafter --method draft-model``): a Hugging
Face dir (config.json, model.safetensors, the target's tokenizer and generation config) plus
``specmesh_draft.json`` naming the target and the training command; and the engine's build of
the draft for evaluation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from specmesh.engine.config import ModelConfig

META = "specmesh_draft.json"
FORMAT = "specmesh-draft-model/1"


def engine_model(draft: Any, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The draft as engine's LlamaForCausalLM (same weights) for :func:`acceptance`."""
    from specmesh.engine.loader import build_model  # the engine model: triton kernels

    config = ModelConfig.from_hf(draft.config)
    return build_model(config, {k: v.detach() for k, v in draft.state_dict().items()}, dtype)


def save_draft_model(draft: Any, tokenizer: Any, path: str | Path, meta: dict,
                     target_path: str | None = None) -> Path:
    """Write the draft as a Hugging Face dir (config.json, model.safetensors in float32),
    the target's tokenizer files (and generation_config.json when ``target_path`` has one),
    and ``specmesh_draft.json`` holding ``meta``."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    draft.float().save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    gen = Path(target_path) / "generation_config.json" if target_path else None
    if gen is not None and gen.is_file():
        shutil.copyfile(gen, out / "generation_config.json")
    (out / META).write_text(json.dumps({"format": FORMAT, **meta}, indent=2) + "\n")
    return out


def read_draft_meta(path: str | Path) -> dict:
    """The ``specmesh_draft.json`` of a draft model written by :func:`save_draft_model`.

    Raises:
        FileNotFoundError: none there. ValueError: not a specmesh draft-model record.
    """
    f = Path(path) / META
    if not f.is_file():
        raise FileNotFoundError(f"no {META} in {path}")
    meta = json.loads(f.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{f} is not a specmesh draft-model record")
    return meta
