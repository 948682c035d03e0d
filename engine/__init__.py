"""specmesh model runtime: Llama-family model, paged KV cache, ragged forward, loading, frames.

The names below load on first use (PEP 562), so that importing a pure-Python submodule such as
``engine.block_manager`` (the verifier's scheduler needs it) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> submodule that defines it
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("BlockManager", "KVCacheExhausted", "slot_mapping"), "block_manager"),
    "ModelConfig": "config",
    **dict.fromkeys(("MODEL_DTYPES", "TORCH_DTYPES", "dtype_name", "model_dtype", "torch_dtype"),
                    "dtypes"),
    **dict.fromkeys(("buffer_to_tensor", "tensor_to_buffer"), "frames"),
    **dict.fromkeys(("KVCache", "num_blocks_for_memory"), "kv_cache"),
    **dict.fromkeys(("LoadedModel", "build_model", "load_model", "load_tokenizer",
                     "model_files", "model_identity_fields"), "loader"),
    "cache_root": "weights_cache",
    **dict.fromkeys(("AttentionMetadata", "LlamaForCausalLM", "rope_inv_freq"), "model"),
    **dict.fromkeys(("ModelRunner", "SeqChunk"), "runner"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import the submodule that defines ``name`` on first access.

    Raises:
        AttributeError: ``name`` is not exported by engine.
    """
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"engine.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
