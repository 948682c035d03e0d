"""Tiny random Llama / Qwen2 models (transformers' and ours, same weights) and the Hugging Face
references (model and greedy ``generate``) the exactness tests compare against."""

from __future__ import annotations

from typing import Any

import torch

from specmesh.engine.config import ModelConfig
from specmesh.engine.model import LlamaForCausalLM


def tiny_hf_config(
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    qwen2: bool = False,
    **overrides: Any,
) -> Any:
    """A transformers ``LlamaConfig`` (or ``Qwen2Config``) of the given size; ``overrides`` are
    passed to the config constructor (e.g. ``rope_scaling=...``, ``tie_word_embeddings=True``)."""
    from transformers import LlamaConfig, Qwen2Config

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size + 16,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )
    kwargs.update(overrides)
    return (Qwen2Config if qwen2 else LlamaConfig)(**kwargs)


def tiny_llama(
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    qwen2: bool = False,
    init_std: float = 0.3,
    **overrides: Any,
) -> tuple[Any, LlamaForCausalLM, ModelConfig]:
    """A random transformers model and our :class:`LlamaForCausalLM` with identical weights.

    Weights are drawn N(0, ``init_std``) (norm weights U(0.5, 1.5), biases N(0, init_std)) with
    ``torch.manual_seed(seed)``: larger than transformers' default init so that greedy decoding
    produces varied tokens. Both models are in eval mode and ``dtype``.

    Returns:
        (hf_model, our_model, ModelConfig)
    """
    from transformers import AutoModelForCausalLM

    hf_config = tiny_hf_config(
        vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, qwen2, **overrides
    )
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    hf_model = AutoModelForCausalLM.from_config(hf_config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * init_std)
    hf_model = hf_model.to(dtype).eval()

    config = ModelConfig.from_hf(hf_config)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.load_state_dict(hf_model.state_dict())
    return hf_model, model, config


def hf_greedy(hf_model: Any, prompt_ids: list[int], max_new_tokens: int,
              eos_token_ids: tuple[int, ...] | list[int] | None = None) -> list[int]:
    """Hugging Face ``generate(do_sample=False)`` continuation of ``prompt_ids`` (output tokens
    only): the reference every exactness test compares against. ``eos_token_ids=None`` never
    stops early."""
    x = torch.tensor([list(prompt_ids)])
    with torch.inference_mode():
        out = hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                max_new_tokens=max_new_tokens,
                                eos_token_id=list(eos_token_ids) if eos_token_ids else None,
                                pad_token_id=0)
    return out[0, x.shape[1]:].tolist()


def hf_reference_model(model: str | None = None, dtype: str = "float32") -> Any:
    """The transformers model (eval) with the same weights as specmesh loads for ``model``."""
    from specmesh.benchmarks.harness.systems import load_hf_model

    return load_hf_model(model, dtype)
