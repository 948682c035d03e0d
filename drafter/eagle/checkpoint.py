"""EAGLE head checkpoints: safetensors weights + a JSON config naming the target.

A checkpoint directory holds ``head.safetensors`` (the head's trainable weights and the
``draft_to_target`` ids of its draft vocabulary) and ``config.json`` (the head's shape, the
target it was trained for, how it was trained). The target's embedding and LM head are not
stored: :func:`load_head` reads only those two tensors from the target's weights. A head is
refused against another target: the target's name, vocabulary, hidden size, layer count and a
fingerprint of its embedding must all match.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from specmesh.drafter.eagle.head import EagleHead, EagleHeadConfig
from specmesh.engine.backend import CpuBackend

WEIGHTS = "head.safetensors"
CONFIG = "config.json"
_FINGERPRINT_ROWS = 512


class HeadMismatch(ValueError):
    """A head checkpoint that was trained for another target."""


def target_fingerprint(embed: torch.Tensor) -> list[float]:
    """Two statistics of the target's embedding [vocab, d] that survive dtype round-trips
    (float32 / bfloat16 loads of the same weights agree to ~1e-3 relative)."""
    rows = embed[:_FINGERPRINT_ROWS].double()
    return [float(rows.sum()), float(rows.abs().mean())]


def target_identity(name: str, config, embed: torch.Tensor) -> dict:  # noqa: ANN001
    """What a head records of its target (``config``: engine.config.ModelConfig)."""
    return {"name": name, "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "num_layers": config.num_layers, "fingerprint": target_fingerprint(embed)}


def check_target(expected: dict, actual: dict, where: str) -> None:
    """Raise :class:`HeadMismatch` naming the first field in which ``actual`` (the target being
    served) differs from ``expected`` (what the head at ``where`` was trained for)."""
    for key in ("vocab_size", "hidden_size", "num_layers"):
        if expected.get(key) != actual.get(key):
            raise HeadMismatch(f"draft head {where} was trained for {expected.get('name')!r} "
                               f"({key}={expected.get(key)}), not for {actual.get('name')!r} "
                               f"({key}={actual.get(key)})")
    fe, fa = expected.get("fingerprint"), actual.get("fingerprint")
    if not fe or not fa or any(not math.isclose(a, b, rel_tol=2e-2, abs_tol=1e-3)
                               for a, b in zip(fe, fa)):
        raise HeadMismatch(f"draft head {where} was trained for {expected.get('name')!r}; the "
                           f"target {actual.get('name')!r} has other embedding weights "
                           f"(fingerprint {fa} vs {fe})")


def round_weights(head: EagleHead, dtype: torch.dtype) -> None:
    """Round the head's stored weights (its state dict) to ``dtype`` and back, in place: the
    head then computes exactly what a checkpoint saved in ``dtype`` loads as."""
    with torch.no_grad():
        for t in head.state_dict().values():
            if t.is_floating_point():
                t.copy_(t.to(dtype))


def save_head(head: EagleHead, path: str | Path, training: dict | None = None,
              dtype: torch.dtype = torch.float32) -> Path:
    """Write ``head`` (weights in ``dtype``, float32 or bfloat16: :func:`load_head` upcasts)
    and its config to directory ``path``."""
    from safetensors.torch import save_file  # safetensors only when a head is written

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items()}
    tensors["draft_to_target"] = head.draft_to_target.detach().long().contiguous()
    save_file(tensors, str(out / WEIGHTS))
    meta = {"format": "specmesh-eagle-head/1", "config": head.config.to_dict(),
            "training": training or {}}
    (out / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def read_head_config(path: str | Path) -> EagleHeadConfig:
    """The config of the checkpoint at ``path``.

    Raises:
        FileNotFoundError: no checkpoint there. ValueError: not a head checkpoint.
    """
    p = Path(path)
    cfg_file = p / CONFIG
    if not cfg_file.is_file() or not (p / WEIGHTS).is_file():
        raise FileNotFoundError(f"no EAGLE head checkpoint at {p} (need {CONFIG} and {WEIGHTS})")
    meta = json.loads(cfg_file.read_text())
    if meta.get("format") != "specmesh-eagle-head/1":
        raise ValueError(f"{cfg_file} is not a specmesh EAGLE head config")
    return EagleHeadConfig.from_dict(meta["config"])


def target_embeddings(model_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Only the embedding and LM head [vocab, d] of the Hugging Face model at ``model_dir``
    (tied embeddings: the same tensor twice), read from its safetensors without loading the
    rest of the model.

    Raises:
        FileNotFoundError: no safetensors weights there. KeyError: no embedding in them.
    """
    from safetensors import safe_open  # safetensors only when embeddings are read

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    found: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in ("model.embed_tokens.weight", "lm_head.weight"):
                if key in st.keys():
                    found[key] = st.get_tensor(key)
    if "model.embed_tokens.weight" not in found:
        raise KeyError(f"no model.embed_tokens.weight in {model_dir}")
    embed = found["model.embed_tokens.weight"]
    return embed, found.get("lm_head.weight", embed)


def load_head(path: str | Path, embed: torch.Tensor, lm_head: torch.Tensor, target: dict,
              dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
              backend: CpuBackend | None = None) -> EagleHead:
    """Load the head at ``path`` for the target described by ``target`` (see
    :func:`target_identity`), with the target's ``embed`` / ``lm_head`` [vocab, d], computing
    with ``backend`` (the CPU backend, engine/backend.py; None: the process's default).

    Raises:
        HeadMismatch: the head was trained for another target.
        FileNotFoundError / ValueError: no (valid) checkpoint at ``path``.
    """
    from safetensors.torch import load_file  # safetensors only when a head is read

    cfg = read_head_config(path)
    check_target(cfg.target, target, str(path))
    tensors = load_file(str(Path(path) / WEIGHTS))
    ids = tensors.pop("draft_to_target")
    head = EagleHead(cfg, backend)
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"head weights at {path} do not fit its config: missing {missing}, "
                         f"unexpected {unexpected}")
    head = head.to(device=device, dtype=dtype)
    head.set_target_weights(embed.to(device), lm_head.to(device), ids.to(device))
    return head.eval().requires_grad_(False)
