"""Model hyper-parameters of the Llama family (Llama, Llama-3, Qwen2) as one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_SUPPORTED_ROPE_TYPES = ("default", "llama3")


def _as_int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runtime needs to build a model and size its KV cache.

    ``rope_scaling`` is None for plain RoPE or a dict with ``rope_type`` ("default" | "llama3")
    and, for "llama3", ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings``. ``attention_bias`` is the q/k/v projection bias (Qwen2
    and Llama with ``attention_bias=True``); ``o_proj_bias`` the output projection bias (Llama
    only: Qwen2 has none).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        rope_type = self.rope_type
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_type {rope_type!r}; supported: {_SUPPORTED_ROPE_TYPES}"
            )

    def __hash__(self) -> int:  # rope_scaling is a dict: hash its items instead
        scaling = tuple(sorted((self.rope_scaling or {}).items()))
        return hash((self.vocab_size, self.hidden_size, self.num_layers, self.head_dim, scaling))

    @property
    def rope_type(self) -> str:
        """``"default"`` or ``"llama3"``."""
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Build from a transformers ``LlamaConfig`` or ``Qwen2Config``.

        Reads ``rope_parameters`` (transformers >= 5) or ``rope_theta``/``rope_scaling`` (older).

        Raises:
            ValueError: unsupported architecture or rope type.
        """
        model_type = getattr(hf_config, "model_type", "llama")
        if model_type not in ("llama", "qwen2"):
            raise ValueError(f"unsupported model_type {model_type!r} (llama and qwen2 only)")
        if model_type == "qwen2" and getattr(hf_config, "use_sliding_window", False):
            raise ValueError("Qwen2 sliding-window attention is not supported")
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (silu only)")

        params = getattr(hf_config, "rope_parameters", None)
        if params:
            params = dict(params)
            rope_theta = float(params.pop("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        else:
            rope_theta = float(getattr(hf_config, "rope_theta", 10000.0))
            params = dict(getattr(hf_config, "rope_scaling", None) or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        rope_scaling = None if rope_type == "default" else params

        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        llama_bias = model_type == "llama" and bool(getattr(hf_config, "attention_bias", False))
        return cls(
            vocab_size=int(hf_config.vocab_size),
            hidden_size=int(hf_config.hidden_size),
            intermediate_size=int(hf_config.intermediate_size),
            num_layers=int(hf_config.num_hidden_layers),
            num_heads=int(num_heads),
            num_kv_heads=int(num_kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=llama_bias or model_type == "qwen2",
            o_proj_bias=llama_bias,
            max_position_embeddings=int(hf_config.max_position_embeddings),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=_as_int_tuple(getattr(hf_config, "eos_token_id", None)),
        )
