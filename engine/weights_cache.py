"""The dequantized-weights cache of GGUF models: a GGUF is dequantized once (by transformers)
and kept as a Hugging Face dir (config, generation config, tokenizer, ``model.safetensors``)
under :func:`cache_root`, one dir per (file name, size, mtime, dtype); a marker file written
last, before an atomic rename, says the dir is complete. :mod:`engine.loader` reads it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from specmesh.engine.dtypes import model_dtype

log = logging.getLogger(__name__)

_MARKER = "specmesh_cache.json"


def cache_root() -> Path:
    """``$SPECMESH_CACHE_DIR``, default ``~/.cache/specmesh``."""
    return Path(os.environ.get("SPECMESH_CACHE_DIR") or Path.home() / ".cache" / "specmesh")


def cache_dir(gguf: Path, dtype: str) -> Path:
    """The cache dir of ``gguf`` in ``dtype`` (it may not exist yet)."""
    st = gguf.stat()
    key = f"{gguf.name}|{st.st_size}|{st.st_mtime_ns}|{dtype}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / f"{gguf.name[: -len('.gguf')]}-{dtype}-{digest}"


def is_complete(cached: Path) -> bool:
    """Whether the cache dir ``cached`` was written completely (its marker file exists)."""
    return (cached / _MARKER).is_file()


def _write_cache(target: Path, hf_model: Any, tokenizer: Any, key: dict) -> None:
    """Write weights + config + tokenizer to a temp dir, then rename it to ``target`` atomically."""
    from safetensors.torch import save_file  # safetensors only when a cache is written

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        config = copy.deepcopy(hf_model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # weights are dequantized now
        config.save_pretrained(tmp)
        hf_model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        sd = hf_model.state_dict()
        if getattr(config, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        tensors = {k: v.detach().contiguous() for k, v in sd.items()}
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / _MARKER).write_text(json.dumps(key))
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first: keep theirs
            if not (target / _MARKER).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def ensure_cached(gguf: Path, dtype: str) -> tuple[Path, Any, Any]:
    """Cache dir for ``gguf`` in ``dtype``, creating it from the GGUF when missing.

    Returns (dir, hf_model, tokenizer); the last two are None when the cache already existed.
    """
    # transformers (slow to import) only when a GGUF is dequantized into the cache
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir(gguf, dtype)
    if is_complete(target):
        return target, None, None
    t0 = time.perf_counter()
    hf_model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=model_dtype(dtype)
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    key = {"file": gguf.name, "size": gguf.stat().st_size,
           "mtime_ns": gguf.stat().st_mtime_ns, "dtype": dtype}
    try:
        _write_cache(target, hf_model, tokenizer, key)
        log.info("dequantized %s in %.1fs, cached in %s",
                 gguf.name, time.perf_counter() - t0, target)
    except OSError as e:
        log.warning("could not write the weights cache %s: %s", target, e)
    return target, hf_model, tokenizer


__all__ = ["cache_dir", "cache_root", "ensure_cached", "is_complete"]
