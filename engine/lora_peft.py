"""Reading a PEFT LoRA adapter directory (``adapter_config.json`` read with ``peft.LoraConfig``,
weights in ``adapter_model.safetensors`` read with ``safetensors``) into per-module
``lora_A`` [r, in] / ``lora_B`` [out, r] pairs and the scale ``lora_alpha / r`` (``/ sqrt(r)``
with rsLoRA), as PEFT's ``LoraLayer`` uses them. Serving them per row is engine/lora.py.

Refused (ValueError) rather than served differently from PEFT: an adapter on the embeddings
(``embed_tokens``), DoRA, biases, ``modules_to_save``, per-module rank / alpha patterns, and
``lora_A`` / ``lora_B`` tensors that do not pair up at the configured rank.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from specmesh.engine.lora_modules import CONFIG_FILE, WEIGHTS_FILE

#: the prefix PEFT gives every tensor name of a model it wraps
_PREFIX = "base_model.model."
#: the LM head's module name
HEAD = "lm_head"


@dataclass
class LoraAdapter:
    """A PEFT LoRA adapter loaded for a model: ``weights`` per module name of the model
    (``model.layers.0.self_attn.q_proj``, ``lm_head``), float32 on the CPU until attached."""

    name: str
    path: str
    rank: int
    alpha: float
    scale: float
    target_modules: tuple[str, ...]
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    base_model_name: str | None = None
    #: base weights PEFT saved next to the pairs (an adapted lm_head / embedding): they must
    #: equal the model's, which is checked when attached
    base_weights: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def targets_lm_head(self) -> bool:
        """Whether the adapter changes ``lm_head`` (drafters that borrow the target's head read
        the base one: acceptance may drop, outputs do not change)."""
        return HEAD in self.weights

    def fingerprint(self) -> dict:
        """What two roles compare to agree they serve the same adapter: name, rank, scale,
        targets and a digest of the weights (JSON-able)."""
        digest = 0.0
        for key in sorted(self.weights):
            a, b = self.weights[key]
            digest += float(a.double().abs().sum()) + float(b.double().abs().sum())
        return {"name": self.name, "rank": self.rank, "scale": self.scale,
                "modules": len(self.weights), "digest": round(digest, 6)}

    @classmethod
    def load(cls, name: str, path: str | Path) -> "LoraAdapter":
        """Read a PEFT LoRA directory.

        Raises:
            FileNotFoundError: no ``adapter_config.json`` or ``adapter_model.safetensors``.
            ValueError: not a LoRA adapter, or one that uses what is not served (module
                docstring), or weights that do not pair up.
        """
        # peft is heavy (it imports transformers); only a process that loads adapters needs it
        from peft import LoraConfig

        root = Path(path)
        if not (root / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {root}")
        if not (root / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {root} "
                                    "(save it with safe_serialization=True)")
        peft_type = json.loads((root / CONFIG_FILE).read_text()).get("peft_type")
        if peft_type != "LORA":
            raise ValueError(f"adapter {name!r} at {root}: peft_type {peft_type!r}, not LORA")
        cfg = LoraConfig.from_pretrained(str(root))
        unsupported = [what for what, bad in (
            ("DoRA (use_dora)", cfg.use_dora), ("biases (bias != 'none')", cfg.bias != "none"),
            ("modules_to_save", bool(cfg.modules_to_save)),
            ("rank_pattern / alpha_pattern", bool(cfg.rank_pattern or cfg.alpha_pattern)),
        ) if bad]
        if unsupported:
            raise ValueError(f"adapter {name!r}: {', '.join(unsupported)} not supported")
        scale = cfg.lora_alpha / (math.sqrt(cfg.r) if cfg.use_rslora else cfg.r)
        tensors = load_file(str(root / WEIGHTS_FILE))
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        base_weights: dict[str, torch.Tensor] = {}
        for key, t in tensors.items():
            if key.endswith(".base_layer.weight"):  # PEFT saves an adapted lm_head's weight
                base_weights[key.removeprefix(_PREFIX).removesuffix(".base_layer.weight")] = t
                continue
            if "lora_embedding" in key or ".embed_tokens." in key:
                raise ValueError(f"adapter {name!r}: LoRA on the embeddings ({key}) is not "
                                 "supported")
            for part in ("lora_A", "lora_B"):
                marker = f".{part}."
                if marker in key:
                    module = key.split(marker)[0].removeprefix(_PREFIX)
                    pairs.setdefault(module, {})[part] = t.float()
                    break
            else:
                raise ValueError(f"adapter {name!r}: unexpected tensor {key}")
        weights = {}
        for module, pair in pairs.items():
            if set(pair) != {"lora_A", "lora_B"} or pair["lora_A"].shape[0] != cfg.r \
                    or pair["lora_B"].shape[1] != cfg.r:
                raise ValueError(f"adapter {name!r}: {module} lacks a lora_A [r, in] / lora_B "
                                 f"[out, r] pair of rank {cfg.r}")
            weights[module] = (pair["lora_A"], pair["lora_B"])
        if not weights:
            raise ValueError(f"adapter {name!r} at {root} has no LoRA weights")
        targets = cfg.target_modules
        targets = tuple(sorted(targets)) if isinstance(targets, (set, list, tuple)) \
            else (str(targets),)
        return cls(name, str(root), cfg.r, float(cfg.lora_alpha), scale, targets, weights,
                   cfg.base_model_name_or_path, base_weights)
