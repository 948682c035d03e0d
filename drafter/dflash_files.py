"""A trained DFlash draft on disk (``specmesh train-drafter --method dflash``) and its load for
serving.

A checkpoint directory holds ``dflash.safetensors``: the draft's own weights (``fc``,
``hidden_norm``, ``layers.*``, ``norm``, ``mask_embedding``; drafter/dflash_model.py; with a
draft vocabulary also ``draft_to_target``, int64), and
``config.json``: ``format``, ``config`` (:class:`DFlashConfig`: the shape, the target layers
its context rows carry, the block, the target it was trained for) and how it was trained. The
target's embedding and LM head are not stored: they are read from the target's weights at
load time, and a checkpoint loaded against another target is refused
(``drafter.eagle.checkpoint.HeadMismatch``). :func:`quantize_draft` puts a loaded float32 CPU
draft's products on Q8_0 blocks for serving.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specmesh.drafter.dflash_config import DFlashConfig
from specmesh.drafter.dflash_model import DFlashDraft
from specmesh.drafter.eagle.checkpoint import check_target, target_embeddings, target_identity
from specmesh.drafter.eagle.quantize import quantize_linears, quantize_rows
from specmesh.engine.backend import CpuBackend
from specmesh.engine.config import ModelConfig

FORMAT = "specmesh-dflash/1"
CONFIG = "config.json"
WEIGHTS = "dflash.safetensors"
#: where the shipped draft of a target lives: drafter/heads/<target name, lower case>/dflash/
SHIPPED = Path(__file__).resolve().parent / "heads"


def shipped_dflash(target_name: str) -> Path | None:
    """The DFlash draft shipped for the target called ``target_name``, or None."""
    p = SHIPPED / target_name.lower() / "dflash"
    return p if (p / CONFIG).is_file() else None


def save_dflash(draft: DFlashDraft, path: str | Path, training: dict | None = None,
                dtype: torch.dtype = torch.float32) -> Path:
    """Write ``draft``'s own weights in ``dtype`` (float32 or bfloat16; :func:`load_dflash`
    upcasts) and its config to directory ``path``."""
    from safetensors.torch import save_file  # safetensors only when a checkpoint is written

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype if v.is_floating_point() else v.dtype).contiguous()
               for k, v in draft.state_dict().items()}
    save_file(tensors, str(out / WEIGHTS))
    meta = {"format": FORMAT, "config": draft.config.to_dict(), "training": training or {}}
    (out / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def read_dflash_config(path: str | Path) -> DFlashConfig:
    """The config of the checkpoint at ``path``.

    Raises:
        FileNotFoundError: no checkpoint there. ValueError: not a DFlash checkpoint.
    """
    p = Path(path)
    f = p / CONFIG
    if not f.is_file() or not (p / WEIGHTS).is_file():
        raise FileNotFoundError(f"no DFlash checkpoint at {p} (need {CONFIG} and {WEIGHTS})")
    meta = json.loads(f.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{f} is not a DFlash checkpoint (format {meta.get('format')!r}, "
                         f"expected {FORMAT!r})")
    return DFlashConfig.from_dict(meta["config"])


def load_dflash(path: str | Path, target_files: str | Path, target_name: str,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                backend: CpuBackend | None = None) -> DFlashDraft:
    """The DFlash draft at ``path`` for the target whose Hugging Face dir is
    ``target_files`` (only its embedding and LM head are read), in ``dtype`` on ``device``,
    computing with ``backend`` (engine/backend.py; None: the process's default).

    Raises:
        FileNotFoundError, ValueError: no (valid) checkpoint at ``path``, weights that do not
            fit its config. drafter.eagle.checkpoint.HeadMismatch: trained for another target.
    """
    from safetensors.torch import load_file  # safetensors only when a checkpoint is read
    from transformers import AutoConfig  # transformers: slow to import, only to load

    cfg = read_dflash_config(path)
    embed, lm_head = target_embeddings(target_files)
    target_cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(target_files))
    check_target(cfg.target, target_identity(target_name, target_cfg, embed), str(path))
    draft = DFlashDraft(cfg, backend)
    tensors = {k: v.float() if v.is_floating_point() else v
               for k, v in load_file(str(Path(path) / WEIGHTS)).items()}
    ids = tensors.pop("draft_to_target", None)
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if k != "draft_to_target"]
    if missing or unexpected or (ids is None) != (cfg.draft_vocab_size == 0):
        raise ValueError(f"DFlash weights at {path} do not fit its config: missing {missing}, "
                         f"unexpected {unexpected}, draft vocabulary "
                         f"{'absent' if ids is None else tuple(ids.shape)} for draft_vocab_size "
                         f"{cfg.draft_vocab_size}")
    if ids is not None:
        draft.set_draft_vocabulary(ids)
    draft = draft.to(device=device, dtype=dtype)
    draft.set_target_weights(embed.to(device), lm_head.to(device))
    return draft.eval().requires_grad_(False)


def quantize_draft(draft: DFlashDraft, backend: CpuBackend) -> int:
    """Round a float32 CPU draft's products (its linear layers and its rows of the target's
    LM head) to Q8_0 blocks and compute on them, as the EAGLE head does
    (drafter/eagle/quantize.py: a draft forward reads a quarter of the bytes; drafts are
    proposals, the verifier stays exact). Returns how many products run on blocks (0: the
    backend's ``eagle_q8_0`` off, the kernel unavailable, or not a float32 CPU draft)."""
    n = quantize_linears(draft, backend)
    draft.lm_head_blocks = quantize_rows(draft.lm_head, backend)
    return n + (draft.lm_head_blocks is not None)
