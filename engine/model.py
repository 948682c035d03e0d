"""Llama-family causal LM (Llama, Llama-3, Qwen2): batched ragged forward over a paged KV cache.

Every module takes the model's CPU backend (engine/backend.py) at construction: it decides
whether the layers use the compiled CPU ops (``layer_ops``), the compiled attention
(``cpu_attention``), prepacked products (``prepacked_linear``) and one compiled call for all
layers (``compiled_stack``); the tensors then decide whether a path applies (dtype, device,
autograd).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specmesh.engine.attention_metadata import AttentionMetadata
from specmesh.engine.backend import CpuBackend, default_backend
from specmesh.engine.compiled_stack import CompiledStack
from specmesh.engine.config import ModelConfig
from specmesh.engine.dense_kv import DenseBatch, DenseKVCache
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.linear import FusedLinears, RowInvariantLinear
from specmesh.kernels import layer_ops
from specmesh.kernels.paged_attention import paged_attention

__all__ = ["AttentionMetadata", "LlamaForCausalLM", "rope_inv_freq"]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Float32 inverse frequencies [head_dim // 2], computed as transformers does (incl. llama3)."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta
        ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float) / dim)
    )
    if config.rope_type != "llama3":
        return inv_freq
    rs = config.rope_scaling
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight multiply (as transformers);
    one compiled call where ``backend.layer_ops`` is on and applies (None: the process's
    default backend)."""

    def __init__(self, hidden_size: int, eps: float, backend: CpuBackend | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.backend = backend if backend is not None else default_backend()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> normalised x, same shape and dtype."""
        if x.dim() == 2 and self.backend.layer_ops.on and layer_ops.applies(x, self.weight):
            return layer_ops.add_rms_norm(x, self.weight, self.variance_epsilon)[1]
        if x.dtype == torch.float32 == self.weight.dtype:  # one fused op, the same bits
            return F.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    """Grouped-query self-attention over a ragged batch; K/V go through the paged cache."""

    def __init__(self, config: ModelConfig, backend: CpuBackend | None = None) -> None:
        super().__init__()
        self.backend = backend = backend if backend is not None else default_backend()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.scaling = config.head_dim**-0.5
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = RowInvariantLinear(hidden, self.num_heads * self.head_dim, bias=bias,
                                         backend=backend)
        self.k_proj = RowInvariantLinear(hidden, self.num_kv_heads * self.head_dim, bias=bias,
                                         backend=backend)
        self.v_proj = RowInvariantLinear(hidden, self.num_kv_heads * self.head_dim, bias=bias,
                                         backend=backend)
        self.o_proj = RowInvariantLinear(self.num_heads * self.head_dim, hidden,
                                         bias=config.o_proj_bias, backend=backend)
        self._qkv = FusedLinears(self.q_proj, self.k_proj, self.v_proj)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata | DenseBatch,
        kv_cache: KVCache | DenseKVCache,
        layer: int,
    ) -> torch.Tensor:
        """x [T, hidden], cos/sin [T, 1, D] -> [T, hidden]; writes this chunk's K/V of ``layer``."""
        T = x.shape[0]
        q, k, v = (t.reshape(T, -1, self.head_dim) for t in self._qkv(x))  # [T, heads, D]
        if self.backend.layer_ops.on and layer_ops.applies(q, cos):  # one call each, same bits
            q, k = layer_ops.rope(q, cos, sin), layer_ops.rope(k, cos, sin)
        else:
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        if isinstance(kv_cache, DenseKVCache):  # offline generation (engine/dense_kv.py)
            return self.o_proj(kv_cache.attend(layer, q, k, v, meta, self.scaling).flatten(1))
        kv_cache.write(layer, meta.slot_mapping, k, v)
        if meta._plan is None:  # whole prompts: causal attention within each chunk
            if kv_cache.dtype != k.dtype:  # a 16-bit cache: K/V as stored, as the paged path
                k, v = k.to(kv_cache.dtype).to(k.dtype), v.to(kv_cache.dtype).to(v.dtype)
            out = torch.empty_like(q)
            offset = 0
            for q_len in meta.query_lens:
                rows = slice(offset, offset + q_len)
                out[rows] = F.scaled_dot_product_attention(
                    q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1),
                    is_causal=q_len > 1, scale=self.scaling,
                    enable_gqa=self.num_heads != self.num_kv_heads,
                ).transpose(0, 1)
                offset += q_len
        else:  # decode / verify / chunked prefill: one batched op over the paged cache
            k_blocks, v_blocks = kv_cache.layer_blocks(layer)
            out = paged_attention(q, k_blocks, v_blocks, meta.block_tables, meta.query_lens,
                                  meta.kv_lens, self.scaling, plan=meta._plan,
                                  cpu_kernel=self.backend.cpu_attention.on)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SiLU-gated feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, backend: CpuBackend | None = None) -> None:
        super().__init__()
        self.backend = backend = backend if backend is not None else default_backend()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = RowInvariantLinear(hidden, inter, bias=False, backend=backend)
        self.up_proj = RowInvariantLinear(hidden, inter, bias=False, backend=backend)
        self.down_proj = RowInvariantLinear(inter, hidden, bias=False, backend=backend)
        self._gate_up = FusedLinears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        if self.backend.layer_ops.on and \
                layer_ops.applies(x, self.gate_proj.weight, self.up_proj.weight):
            gate_up = self._gate_up.joint(x)  # [T, 2 * inter], one product
            if gate_up is not None:  # one compiled call, as engine/compiled_stack.py
                return self.down_proj(layer_ops.silu_mul(gate_up, self.gate_proj.out_features))
        gate, up = self._gate_up(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block: h + attn(norm(h)), then h + mlp(norm(h))."""

    def __init__(self, config: ModelConfig, backend: CpuBackend | None = None) -> None:
        super().__init__()
        backend = backend if backend is not None else default_backend()
        self.self_attn = Attention(config, backend)
        self.mlp = MLP(config, backend)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)

    def forward(self, h, cos, sin, meta, kv_cache, layer):  # noqa: ANN001, ANN201
        """h [T, hidden] -> [T, hidden]."""
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, meta, kv_cache, layer)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_fused(self, h, pending, cos, sin, meta, kv_cache, layer):  # noqa: ANN001, ANN201
        """The same layer with each residual add fused into the RMSNorm after it
        (:func:`kernels.layer_ops.add_rms_norm`, float32 CPU inference): takes the residual
        stream ``h`` [T, hidden] and the previous layer's MLP output ``pending`` not yet added
        to it (None for the first layer); returns this layer's (h, pending). h + pending is
        what :meth:`forward` returns, bit for bit up to the norms' rounding."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if pending is None:
            x = layer_ops.add_rms_norm(h, norm1.weight, norm1.variance_epsilon)[1]
        else:
            h, x = layer_ops.add_rms_norm(pending, norm1.weight, norm1.variance_epsilon, h)
        attn = self.self_attn(x, cos, sin, meta, kv_cache, layer)
        h, x = layer_ops.add_rms_norm(attn, norm2.weight, norm2.variance_epsilon, h)
        return h, self.mlp(x)


class LlamaModel(nn.Module):
    """Container with transformers' names: embed_tokens, layers, norm."""

    def __init__(self, config: ModelConfig, backend: CpuBackend | None = None) -> None:
        super().__init__()
        backend = backend if backend is not None else default_backend()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, backend)
                                     for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 causal LM whose parameter names equal transformers' state dict keys.

    With ``tie_word_embeddings`` the ``lm_head.weight`` parameter is ``model.embed_tokens.weight``.
    ``backend``: the CPU backend every module of the model computes with (engine/backend.py;
    None: the process's :func:`~engine.backend.default_backend`).
    """

    def __init__(self, config: ModelConfig, backend: CpuBackend | None = None) -> None:
        super().__init__()
        self.config = config
        self.backend = backend = backend if backend is not None else default_backend()
        self.model = LlamaModel(config, backend)
        self.lm_head = RowInvariantLinear(config.hidden_size, config.vocab_size, bias=False,
                                          backend=backend)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Plain attribute, not a buffer: .to(dtype) must not round it (RoPE runs in float32).
        self._inv_freq = rope_inv_freq(config)
        self._compiled: CompiledStack | None = None  # built on first float32 CPU forward
        self.lora = None  # engine/lora.py's LoraBank once adapters are loaded

    @property
    def dtype(self) -> torch.dtype:
        """Parameter dtype."""
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        """Parameter device."""
        return self.model.embed_tokens.weight.device

    def rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] in ``dtype`` for absolute ``positions`` [T] (fp32 angles)."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata | DenseBatch,
        kv_cache: KVCache | DenseKVCache,
        return_hidden: bool = False,
        logits_indices: torch.Tensor | list[int] | None = None,
        hidden_layers: tuple[int, ...] | None = None,
        adapter_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One ragged forward over all requests' chunks; writes their K/V into ``kv_cache``.

        Args:
            input_ids: LongTensor [T], the chunks of all requests concatenated.
            positions: LongTensor [T], absolute position of each token.
            meta: request boundaries, KV lengths, block tables and slots (sum(query_lens) == T),
                or a DenseBatch with a DenseKVCache (engine/dense_kv.py, offline generation).
            logits_indices: rows of the T tokens to compute logits for (default: all).
            adapter_rows: LongTensor [T], each token's LoRA adapter slot in ``self.lora``
                (engine/lora.py; -1: the base model), or None: all base.

        Returns:
            logits [N, vocab] in the model dtype (N = len(logits_indices) or T), or
            (logits, hidden [T, hidden_size]) when ``return_hidden``; hidden is the final-norm
            output, the input of ``lm_head``, or with ``hidden_layers`` (decoder-layer indices,
            see :mod:`engine.hidden_layers`) those layers' outputs side by side,
            [T, len(hidden_layers) * hidden_size] (EAGLE-3's low / middle / high features).

        Raises:
            ValueError: an ``adapter_rows`` slot that holds no adapter.
        """
        if self.lora is None or adapter_rows is None:
            return self._forward(input_ids, positions, meta, kv_cache, return_hidden,
                                 logits_indices, hidden_layers, False)
        with self.lora.batch(adapter_rows, logits_indices) as adapted:
            return self._forward(input_ids, positions, meta, kv_cache, return_hidden,
                                 logits_indices, hidden_layers, adapted)

    def _forward(self, input_ids, positions, meta, kv_cache, return_hidden,  # noqa: ANN001
                 logits_indices, hidden_layers, adapted: bool):  # noqa: ANN001, ANN202
        """:meth:`forward`; ``adapted``: rows of LoRA adapters in the batch (the compiled
        stack, which adds no deltas, does not run then: the layer-by-layer path computes the
        same bits for base rows)."""
        meta.prepare(input_ids.device)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, h.dtype)
        captured: dict[int, torch.Tensor] = {}
        norm = self.model.norm
        # float32 CPU inference with the compiled layer ops: residual adds fused into norms
        if self.backend.layer_ops.on and layer_ops.applies(h, norm.weight):
            if self._compiled is None:
                self._compiled = CompiledStack(self)
            compiled = None if adapted else \
                self._compiled.run(h, cos, sin, meta, kv_cache, hidden_layers)
            if compiled is not None:  # every layer in one call (engine/compiled_stack.py)
                captured = compiled
                h = norm(h)
            else:
                pending = None
                for i, layer in enumerate(self.model.layers):
                    h, pending = layer.forward_fused(h, pending, cos, sin, meta, kv_cache, i)
                    if hidden_layers and i in hidden_layers:
                        captured[i] = h + pending
                h = norm(h) if pending is None else \
                    layer_ops.add_rms_norm(pending, norm.weight, norm.variance_epsilon, h)[1]
        else:
            for i, layer in enumerate(self.model.layers):
                h = layer(h, cos, sin, meta, kv_cache, i)
                if hidden_layers and i in hidden_layers:
                    captured[i] = h
            h = norm(h)
        rows = h if logits_indices is None else h[logits_indices]
        logits = self.lm_head(rows)
        if return_hidden and hidden_layers:
            return logits, torch.cat([captured[i] for i in hidden_layers], dim=-1)
        return (logits, h) if return_hidden else logits
