"""The EAGLE head's decoder layer: a pre-norm Llama layer (GQA self-attention with RoPE, SiLU
MLP) of the target's shape, split into ``qkv`` and ``finish`` so the head can attend over its
own KV (drafter/eagle/head.py) or over whole training sequences."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from specmesh.engine.linear import RowInvariantLinear

if TYPE_CHECKING:
    from specmesh.drafter.eagle.config import EagleHeadConfig
    from specmesh.engine.backend import CpuBackend


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer (GQA self-attention + SiLU MLP) of the target's shape; its
    products compute with ``backend`` (engine/backend.py; None: the process's default)."""

    def __init__(self, c: EagleHeadConfig, backend: CpuBackend | None = None) -> None:
        super().__init__()
        d, hd, inter = c.hidden_size, c.head_dim, c.intermediate_size
        self.nh, self.nkv, self.hd = c.num_heads, c.num_kv_heads, hd

        def linear(n_in: int, n_out: int) -> RowInvariantLinear:
            return RowInvariantLinear(n_in, n_out, bias=False, backend=backend)

        self.q_proj = linear(d, c.num_heads * hd)
        self.k_proj = linear(d, c.num_kv_heads * hd)
        self.v_proj = linear(d, c.num_kv_heads * hd)
        self.o_proj = linear(c.num_heads * hd, d)
        self.gate_proj = linear(d, inter)
        self.up_proj = linear(d, inter)
        self.down_proj = linear(inter, d)
        self.input_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, c.rms_norm_eps)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):  # noqa: ANN201
        """x [..., T, d] -> q [..., nh, T, hd], k/v [..., nkv, T, hd] (RoPE applied)."""
        h = self.input_layernorm(x)
        shape = h.shape[:-1]
        q = self.q_proj(h).view(*shape, self.nh, self.hd).transpose(-2, -3)
        k = self.k_proj(h).view(*shape, self.nkv, self.hd).transpose(-2, -3)
        v = self.v_proj(h).view(*shape, self.nkv, self.hd).transpose(-2, -3)
        return rope(q, cos, sin), rope(k, cos, sin), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual + output projection of ``attn`` [..., nh, T, hd], then the MLP block."""
        a = attn.transpose(-2, -3).flatten(-2)
        x = x + self.o_proj(a)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
