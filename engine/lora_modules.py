"""The ``--lora-modules`` option (vLLM's flag) and what a role announces of its LoRA adapters,
without torch: the CLI, the cluster config and the gateway read them (engine/lora.py loads the
adapters themselves)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

#: The weights file PEFT saves (``save_pretrained(safe_serialization=True)``, its default).
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def parse_lora_modules(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``--lora-modules`` items (vLLM's flag) -> {name: path}: ``name=path`` or vLLM's JSON
    form ``{"name": ..., "path": ...}``.

    Raises:
        ValueError: an item of neither form, an empty name or path, or a name given twice.
    """
    out: dict[str, str] = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                obj = json.loads(item)
                name, path = str(obj["name"]), str(obj["path"])
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"--lora-modules {item!r}: not a JSON object with name and "
                                 f"path ({err})") from None
        else:
            name, sep, path = item.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules {item!r}: expected NAME=PATH")
        name, path = name.strip(), path.strip()
        if not name or not path:
            raise ValueError(f"--lora-modules {item!r}: empty name or path")
        if name in out:
            raise ValueError(f"--lora-modules: adapter name {name!r} given twice")
        out[name] = path
    return out


def file_digest(path: str | Path) -> str:
    """A short content digest of an adapter's weights file (sha256, 12 hex digits)."""
    h = hashlib.sha256()
    with open(Path(path) / WEIGHTS_FILE, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:12]


def adapter_set_identity(modules: dict[str, str]) -> str:
    """What a role announces of its adapters (``ModelIdentity.lora_adapters``): ``name@digest``
    of each adapter's weights file, sorted by name, comma-separated ("" for none), so that two
    roles serving one name from different files disagree.

    Raises:
        FileNotFoundError: an adapter directory without its weights file.
    """
    return ",".join(f"{name}@{file_digest(path)}" for name, path in sorted(modules.items()))


__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "adapter_set_identity", "file_digest",
           "parse_lora_modules"]
