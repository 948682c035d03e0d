"""specmesh model runtime: Llama-family model, paged KV cache, ragged forward, loading, frames."""

from __future__ import annotations

from engine.block_manager import BlockManager, KVCacheExhausted, slot_mapping
from engine.config import ModelConfig
from engine.dtypes import MODEL_DTYPES, TORCH_DTYPES, dtype_name, model_dtype, torch_dtype
from engine.frames import buffer_to_tensor, tensor_to_buffer
from engine.kv_cache import KVCache, num_blocks_for_memory
from engine.loader import (
    LoadedModel,
    build_model,
    cache_root,
    hf_reference_model,
    load_model,
    load_tokenizer,
    model_files,
    model_identity_fields,
)
from engine.model import AttentionMetadata, LlamaForCausalLM, rope_inv_freq
from engine.runner import ModelRunner, SeqChunk
from engine.tiny import hf_greedy, tiny_hf_config, tiny_llama

__all__ = [
    "MODEL_DTYPES",
    "TORCH_DTYPES",
    "AttentionMetadata",
    "BlockManager",
    "KVCache",
    "KVCacheExhausted",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "ModelRunner",
    "SeqChunk",
    "buffer_to_tensor",
    "build_model",
    "cache_root",
    "dtype_name",
    "hf_reference_model",
    "load_model",
    "load_tokenizer",
    "model_dtype",
    "model_files",
    "model_identity_fields",
    "num_blocks_for_memory",
    "rope_inv_freq",
    "slot_mapping",
    "tensor_to_buffer",
    "hf_greedy",
    "tiny_hf_config",
    "tiny_llama",
    "torch_dtype",
]
