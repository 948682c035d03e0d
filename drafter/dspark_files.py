"""A trained DSpark draft on disk (``specmesh train-drafter --method dspark``) and its build for
serving.

A checkpoint directory holds:

- ``backbone/``: the parallel block draft, a PARD checkpoint (drafter/pard_files.py: the
  draft's layers, final norm and mask vector; the embedding and LM head are the target's,
  read at load time), so the block forward is PARD's; or, when ``config.json`` names one in
  ``backbone`` (a path relative to the checkpoint), that PARD checkpoint: a draft whose heads
  were trained on a frozen backbone that ships anyway (the SmolLM2 one reads ``../pard``)
  need not carry a second copy of it;
- ``markov.safetensors``: the Markov and confidence heads (drafter/dspark_markov.py,
  ``MarkovHead``'s parameter names);
- ``config.json``: ``format``, ``markov`` (the head's shape), ``markov_rank``, ``block``,
  ``mask_token_id``, ``num_layers`` (copied from the backbone's), the target it was trained
  for (a checkpoint loaded against another target is refused by the backbone's check) and how
  it was trained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specmesh.drafter.dspark_markov import MarkovHead, check_markov
from specmesh.drafter.pard_files import build_pard_model, read_pard_config, save_pard

FORMAT = "specmesh-dspark/1"
CONFIG = "config.json"
HEADS = "markov.safetensors"
BACKBONE = "backbone"
#: where the shipped draft of a target lives: drafter/heads/<target name, lower case>/dspark/
SHIPPED = Path(__file__).resolve().parent / "heads"


def shipped_dspark(target_name: str) -> Path | None:
    """The DSpark draft shipped for the target called ``target_name``, or None."""
    p = SHIPPED / target_name.lower() / "dspark"
    return p if (p / CONFIG).is_file() else None


def save_dspark(backbone_state: dict[str, torch.Tensor], mask_embedding: torch.Tensor,
                head: MarkovHead, path: str | Path, meta: dict,
                dtype: torch.dtype = torch.float32) -> Path:
    """Write the backbone (``backbone_state``: transformers names; ``mask_embedding`` [d]) as a
    PARD checkpoint under ``path``/backbone, ``head``'s parameters to ``path``/markov.safetensors
    (both in ``dtype``) and ``meta`` (num_layers, mask_token_id, block, target, training; the
    head's shape is added) to ``path``/config.json."""
    from safetensors.torch import save_file  # safetensors only when a checkpoint is written

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_pard(backbone_state, mask_embedding, out / BACKBONE, meta, dtype=dtype)
    save_file({k: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items()},
              str(out / HEADS))
    full = {"format": FORMAT, **meta, "markov": head.kind, "markov_rank": head.rank}
    (out / CONFIG).write_text(json.dumps(full, indent=2) + "\n")
    return out


def read_dspark_config(path: str | Path) -> dict:
    """The config.json of the DSpark checkpoint at ``path``.

    Raises:
        FileNotFoundError: no config.json there. ValueError: not a DSpark checkpoint, or one
            with a missing key or a bad Markov shape / rank.
    """
    f = Path(path) / CONFIG
    if not f.is_file():
        raise FileNotFoundError(f"no DSpark checkpoint at {path} (no {CONFIG})")
    meta = json.loads(f.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{f} is not a DSpark checkpoint (format {meta.get('format')!r}, "
                         f"expected {FORMAT!r})")
    for key in ("markov", "markov_rank", "block", "mask_token_id", "target"):
        if key not in meta:
            raise ValueError(f"{f} has no {key!r}")
    check_markov(meta["markov"], meta["markov_rank"])
    return meta


def load_markov_head(path: str | Path, meta: dict, hidden_size: int, vocab_size: int,
                     device: Any = "cpu") -> MarkovHead:
    """The float32 Markov head of the checkpoint at ``path`` (``meta``: its config.json).

    Raises:
        ValueError: weights that do not fit ``hidden_size`` / ``vocab_size``.
    """
    from safetensors.torch import load_file  # safetensors only when a checkpoint is read

    head = MarkovHead(meta["markov"], hidden_size, int(meta["markov_rank"]), vocab_size)
    tensors = {k: v.float() for k, v in load_file(str(Path(path) / HEADS)).items()}
    try:
        head.load_state_dict(tensors)
    except RuntimeError as err:
        raise ValueError(f"DSpark checkpoint {path}: the Markov head does not fit a draft of "
                         f"hidden size {hidden_size} and vocabulary {vocab_size}: {err}") from None
    return head.to(device).eval()


def backbone_dir(path: str | Path, meta: dict) -> Path:
    """The PARD checkpoint a DSpark checkpoint at ``path`` (its config.json ``meta``) drafts
    with: ``meta["backbone"]`` relative to ``path`` when given, else ``path``/backbone."""
    return (Path(path) / meta.get("backbone", BACKBONE)).resolve()


def build_dspark(path: str | Path, target_files: str | Path, target_name: str,
                 dtype: torch.dtype = torch.float32, device: Any = "cpu",
                 backend: Any = None) -> tuple[torch.nn.Module, Any, MarkovHead, dict]:
    """The backbone engine model, its config, the Markov head and the config.json of the
    DSpark checkpoint at ``path`` for the target whose Hugging Face dir is ``target_files``.

    Raises:
        FileNotFoundError, ValueError: no (valid) checkpoint. drafter.eagle.checkpoint
            .HeadMismatch: trained for another target.
    """
    meta = read_dspark_config(path)
    backbone = backbone_dir(path, meta)
    read_pard_config(backbone)
    model, config, _ = build_pard_model(backbone, target_files, target_name, dtype, device,
                                        backend)
    head = load_markov_head(path, meta, config.hidden_size, config.vocab_size, device)
    return model, config, head, meta


__all__ = ["BACKBONE", "FORMAT", "HEADS", "backbone_dir", "build_dspark", "load_markov_head",
           "read_dspark_config", "save_dspark", "shipped_dspark"]
