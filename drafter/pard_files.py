"""A trained PARD draft model on disk (``specmesh train-drafter --method pard``) and its build
for serving.

A checkpoint directory holds ``pard.safetensors``: the draft's decoder layers and final norm
(transformers names, ``model.layers.*``, ``model.norm.weight``) and ``mask_embedding`` [d],
the learned input vector of the mask token; and ``config.json``: ``format``, ``num_layers``,
``mask_token_id`` (the vocabulary id that stands for the mask in the KV's token list: one the
training data never holds), ``block`` (K, the drafts per forward it was trained for), the
target it was trained for (``drafter.eagle.checkpoint.target_identity``: a checkpoint loaded
against another target is refused) and how it was trained. The embedding and LM head are the
target's, read from its weights at load time (not stored: the shipped SmolLM2 draft is 2
layers, 14 MiB in bfloat16).

The engine model built from it (:func:`build_pard_model`) is the target's architecture with
``num_layers`` layers whose embedding row ``mask_token_id`` is ``mask_embedding`` (a copy of
the target's embedding; with tied embeddings the LM head shares the copy, so drafts must never
be the mask id: the proposer masks that logit).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specmesh.drafter.eagle.checkpoint import check_target, target_embeddings, target_identity
from specmesh.engine.config import ModelConfig

FORMAT = "specmesh-pard/1"
CONFIG = "config.json"
WEIGHTS = "pard.safetensors"
#: where the shipped draft of a target lives: drafter/heads/<target name, lower case>/pard/
SHIPPED = Path(__file__).resolve().parent / "heads"


def shipped_pard(target_name: str) -> Path | None:
    """The PARD draft shipped for the target called ``target_name``, or None."""
    p = SHIPPED / target_name.lower() / "pard"
    return p if (p / CONFIG).is_file() else None


def save_pard(state: dict[str, torch.Tensor], mask_embedding: torch.Tensor, path: str | Path,
              meta: dict, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``state`` (the draft's layer and final-norm weights, transformers names) and
    ``mask_embedding`` [d] in ``dtype`` to ``path``/pard.safetensors and ``meta`` (num_layers,
    mask_token_id, block, target, training) to config.json."""
    from safetensors.torch import save_file  # safetensors only when a checkpoint is written

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in state.items()
               if k.startswith("model.layers.") or k == "model.norm.weight"}
    tensors["mask_embedding"] = mask_embedding.detach().to(dtype).reshape(-1).contiguous()
    save_file(tensors, str(out / WEIGHTS))
    (out / CONFIG).write_text(json.dumps({"format": FORMAT, **meta}, indent=2) + "\n")
    return out


def read_pard_config(path: str | Path) -> dict:
    """The config.json of the PARD checkpoint at ``path``.

    Raises:
        FileNotFoundError: no config.json there. ValueError: not a PARD checkpoint.
    """
    f = Path(path) / CONFIG
    if not f.is_file():
        raise FileNotFoundError(f"no PARD checkpoint at {path} (no {CONFIG})")
    meta = json.loads(f.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{f} is not a PARD checkpoint (format {meta.get('format')!r}, "
                         f"expected {FORMAT!r})")
    for key in ("num_layers", "mask_token_id", "block", "target"):
        if key not in meta:
            raise ValueError(f"{f} has no {key!r}")
    return meta


def draft_model_config(target_files: str | Path, num_layers: int) -> ModelConfig:
    """The engine config of a ``num_layers``-layer draft of the target whose Hugging Face dir
    is ``target_files`` (config files only)."""
    from transformers import AutoConfig  # transformers: slow to import, only to load

    from specmesh.drafter.draft_model_training import draft_hf_config

    return ModelConfig.from_hf(draft_hf_config(AutoConfig.from_pretrained(target_files),
                                               num_layers))


def build_pard_model(path: str | Path, target_files: str | Path, target_name: str,
                     dtype: torch.dtype = torch.float32, device: Any = "cpu",
                     backend: Any = None) -> tuple[torch.nn.Module, ModelConfig, dict]:
    """The engine model (``engine.model.LlamaForCausalLM``) of the PARD checkpoint at ``path``
    for the target whose Hugging Face dir is ``target_files`` (its embedding and LM head are
    read from there), with its config and the checkpoint's config.json.

    Raises:
        FileNotFoundError, ValueError: no (valid) checkpoint at ``path``, weights that do not
            fit. drafter.eagle.checkpoint.HeadMismatch: trained for another target.
    """
    from safetensors.torch import load_file  # safetensors only when a checkpoint is read

    from specmesh.engine.loader import build_model  # the engine model: compiled kernels

    meta = read_pard_config(path)
    config = draft_model_config(target_files, int(meta["num_layers"]))
    embed, lm_head = target_embeddings(target_files)
    target_cfg = ModelConfig.from_hf(_hf_config(target_files))
    check_target(meta["target"], target_identity(target_name, target_cfg, embed), str(path))
    tensors = load_file(str(Path(path) / WEIGHTS))
    mask_vec = tensors.pop("mask_embedding").float()
    embed = embed.float().clone()
    mask_id = int(meta["mask_token_id"])
    if not 0 <= mask_id < embed.shape[0] or mask_vec.numel() != embed.shape[1]:
        raise ValueError(f"PARD checkpoint {path}: mask token {mask_id} / embedding of "
                         f"{mask_vec.numel()} values do not fit the target's "
                         f"{tuple(embed.shape)} embedding")
    embed[mask_id] = mask_vec
    state = {k: v.float() for k, v in tensors.items()}
    state["model.embed_tokens.weight"] = embed
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = lm_head.float()
    model = build_model(config, state, dtype, device, backend)
    return model, config, meta


def _hf_config(files: str | Path) -> Any:
    from transformers import AutoConfig  # transformers: slow to import, only to load

    return AutoConfig.from_pretrained(files)


def target_name_and_files(model: str | None) -> tuple[str, Path]:
    """The served name and Hugging Face dir (a GGUF's weights cache) of the target
    ``model``."""
    from specmesh.engine.loader import model_files, model_name  # engine: config files only

    return model_name(model), model_files(model)
