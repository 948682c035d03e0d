"""The frozen-KV MTP assistant: one decoder block that reads the target's committed K/V of one
layer read-only and keeps no KV of its own (SGLang's FROZEN_KV_MTP, vLLM's Gemma4Proposer with
``constant_draft_positions``; notes_drafters_2 section 9).

A draft step at anchor ``L`` (the request's committed length; the target's K/V is written for
positions ``[0, L - 1)``, the last committed token's is not yet) reads:

- the token the step continues from (step 0: the last committed token, position ``L - 1``;
  step k: the step k-1's draft), embedded with the target's embedding (frozen);
- a hidden state: step 0 the target's final-norm hidden state at position ``L - 2`` (the seed
  state ``"hidden"`` the verifier ships with every commit), step k the assistant's own output of
  step k-1: the only thing that moves between steps;
- the target's keys and values of layer :attr:`AssistantConfig.target_layer` at positions
  ``[0, L - 1)`` (keys after RoPE, as the pool stores them).

``fc`` fuses the normed embedding and hidden state (2d -> d); the block's attention projects a
query (the target's head layout: ``num_heads`` x ``head_dim`` over ``num_kv_heads`` groups),
rotates it at position ``L - 1`` for **every** step (the RoPE phase is pinned: the keys do not
grow, so the query's distance to them must not either), attends over the target's rows only
(no row for the draft tokens: they are never attention context), and projects back; a SiLU MLP
and the final norm give the step's output ``g`` [d] in the target's final-norm space, whose
target-LM-head logits (the rows of a draft vocabulary) pick the draft and which the next step
reads as its hidden state. The attention, MLP and norms start from the target layer they read
(``init_from_target``), so the query lives in that layer's key space from the first step.

Shapes: B queries per call; ``keys`` / ``values`` one ``[n_b, num_kv_heads, head_dim]`` per
query (``n_b >= 1`` rows); hidden states ``[B, d]``; logits ``[B, draft_vocab]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specmesh.drafter.checkpoint_config import CheckpointConfig


@dataclass(frozen=True)
class AssistantConfig(CheckpointConfig):
    """Shape of an assistant: the target's ``hidden_size``, head layout and vocabulary,
    ``intermediate_size`` of its own MLP, ``draft_vocab_size`` LM-head rows kept (0: all),
    ``target_layer`` whose K/V it reads (default in :meth:`for_target`: the target's last,
    whose keys carry the most context, as Gemma 4's assistant reads the last non-shared layer),
    ``rope_theta`` (plain RoPE; a target with scaled RoPE passes its inverse frequencies to the
    module) and ``target`` (drafter/eagle/checkpoint.py ``target_identity``)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer: int
    draft_vocab_size: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    target: dict = field(default_factory=dict)

    @classmethod
    def for_target(cls, c, draft_vocab_size: int = 0, target_layer: int | None = None,  # noqa: ANN001
                   intermediate_size: int | None = None,
                   target: dict | None = None) -> AssistantConfig:
        """An assistant for the target whose engine.config.ModelConfig is ``c``.

        Raises:
            ValueError: ``target_layer`` not a layer of the target.
        """
        layer = c.num_layers - 1 if target_layer is None else target_layer
        if not 0 <= layer < c.num_layers:
            raise ValueError(f"target_layer {layer} is not a layer of a {c.num_layers}-layer "
                             "target")
        return cls(hidden_size=c.hidden_size, num_heads=c.num_heads,
                   num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                   intermediate_size=intermediate_size or c.intermediate_size,
                   vocab_size=c.vocab_size, target_layer=layer,
                   draft_vocab_size=draft_vocab_size, rms_norm_eps=c.rms_norm_eps,
                   rope_theta=c.rope_theta, target=dict(target or {}))

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes one token's K/V would take in a draft KV pool of this assistant (one layer:
        keys and values, ``num_kv_heads * head_dim`` each): what an EAGLE-style draft layer
        allocates per context token and a frozen-KV assistant does not (the chapter's
        ``2 * h_kv * d_h * bytes``)."""
        return 2 * self.num_kv_heads * self.head_dim * itemsize


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), w.shape, w.float(), eps).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FrozenKVAssistant(nn.Module):
    """Trainable: ``fc``, ``norm_embed``, ``norm_hidden``, ``input_norm``, ``q_proj``,
    ``o_proj``, ``post_norm``, ``gate_proj`` / ``up_proj`` / ``down_proj``, ``norm``. Frozen
    buffers (:meth:`set_target_weights`): ``embed`` [vocab, d], ``lm_head`` [draft_vocab, d],
    ``draft_to_target`` [draft_vocab]. No K/V projection and no KV buffer: the keys and values
    are the target's. ``inv_freq``: the target's RoPE inverse frequencies [head_dim / 2]
    (engine.model.rope_inv_freq; None: plain RoPE of ``rope_theta``)."""

    def __init__(self, config: AssistantConfig, inv_freq: torch.Tensor | None = None) -> None:
        super().__init__()
        c = self.config = config
        d, hd = c.hidden_size, c.num_heads * c.head_dim
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.norm_embed = nn.Parameter(torch.ones(d))
        self.norm_hidden = nn.Parameter(torch.ones(d))
        self.input_norm = nn.Parameter(torch.ones(d))
        self.q_proj = nn.Linear(d, hd, bias=False)
        self.o_proj = nn.Linear(hd, d, bias=False)
        self.post_norm = nn.Parameter(torch.ones(d))
        self.gate_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, d, bias=False)
        self.norm = nn.Parameter(torch.ones(d))
        n_draft = c.draft_vocab_size or c.vocab_size
        self.register_buffer("embed", torch.zeros(c.vocab_size, d), persistent=False)
        self.register_buffer("lm_head", torch.zeros(n_draft, d), persistent=False)
        self.register_buffer("draft_to_target", torch.arange(n_draft), persistent=False)
        if inv_freq is None:
            inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2).float()
                                              / c.head_dim)
        self._inv_freq = inv_freq.float()  # plain attribute: .to(dtype) must not round it

    # -- weights ---------------------------------------------------------------------------

    def set_target_weights(self, embed: torch.Tensor, lm_head: torch.Tensor,
                           draft_to_target: torch.Tensor | None = None) -> None:
        """Install the target's embedding and LM head [vocab, d], keeping the LM-head rows of
        ``draft_to_target`` (default: all).

        Raises:
            ValueError: shapes that do not fit the config.
        """
        c = self.config
        if tuple(embed.shape) != (c.vocab_size, c.hidden_size) or lm_head.shape != embed.shape:
            raise ValueError(f"target embedding {tuple(embed.shape)} / LM head "
                             f"{tuple(lm_head.shape)} do not fit vocab {c.vocab_size}, hidden "
                             f"{c.hidden_size}")
        n_draft = c.draft_vocab_size or c.vocab_size
        ids = torch.arange(c.vocab_size) if draft_to_target is None else draft_to_target.long()
        if ids.shape != (n_draft,) or int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size:
            raise ValueError(f"draft vocabulary of {tuple(ids.shape)} ids does not fit "
                             f"draft_vocab_size {n_draft} / vocab {c.vocab_size}")
        dtype = self.fc.weight.dtype
        self.embed = embed.detach().to(dtype).clone()
        self.lm_head = lm_head.detach()[ids].to(dtype).clone()
        self.draft_to_target = ids.clone()

    @torch.no_grad()
    def init_from_target(self, layer, final_norm: torch.Tensor) -> None:  # noqa: ANN001
        """Start the block from the target decoder layer it reads (``layer``: an
        engine.model.DecoderLayer of the same shape; its attention's q/o projections, MLP and
        norms) and the target's final norm; ``fc`` passes the hidden state through (its
        embedding half starts small)."""
        att = layer.self_attn
        self.q_proj.weight.copy_(att.q_proj.weight)
        self.o_proj.weight.copy_(att.o_proj.weight)
        self.input_norm.copy_(layer.input_layernorm.weight)
        self.post_norm.copy_(layer.post_attention_layernorm.weight)
        for mine, theirs in ((self.gate_proj, layer.mlp.gate_proj),
                             (self.up_proj, layer.mlp.up_proj),
                             (self.down_proj, layer.mlp.down_proj)):
            if mine.weight.shape == theirs.weight.shape:
                mine.weight.copy_(theirs.weight)
        self.norm.copy_(final_norm)
        d = self.config.hidden_size
        self.fc.weight.normal_(0.0, 0.02 / math.sqrt(d))
        self.fc.weight[:, d:] += torch.eye(d)

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def weights_bytes(self) -> int:
        """Bytes of every tensor the assistant holds: its own weights plus the target's
        embedding and LM-head rows it keeps (resident in the drafter's memory)."""
        own = sum(p.numel() * p.element_size() for p in self.parameters())
        return own + sum(b.numel() * b.element_size() for b in self.buffers())

    # -- compute ---------------------------------------------------------------------------

    def _rope(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """q [B, H, D] rotated at ``positions`` [B]."""
        freqs = positions.float()[:, None] * self._inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        return q * cos + _rotate_half(q) * sin

    def query(self, token_ids: torch.Tensor, hidden: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused input ``x`` [B, d] and the rotated query [B, H, D] of tokens ``token_ids``
        [B] with hidden states ``hidden`` [B, d] at RoPE ``positions`` [B]."""
        c = self.config
        e = self.embed[token_ids]
        x = self.fc(torch.cat([_rms(e, self.norm_embed, c.rms_norm_eps),
                               _rms(hidden.to(e.dtype), self.norm_hidden, c.rms_norm_eps)], -1))
        q = self.q_proj(_rms(x, self.input_norm, c.rms_norm_eps))
        return x, self._rope(q.view(-1, c.num_heads, c.head_dim), positions)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The step's output ``g`` [B, d] from the fused input ``x`` [B, d] and the attention
        output [B, H, D]."""
        c = self.config
        h = x + self.o_proj(attn.reshape(x.shape[0], -1))
        m = _rms(h, self.post_norm, c.rms_norm_eps)
        h = h + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))
        return _rms(h, self.norm, c.rms_norm_eps)

    def step(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """One draft step for B queries (module docstring): query b attends over its own
        target rows ``keys[b]`` / ``values[b]`` [n_b, Hkv, D]; returns ``g`` [B, d]."""
        c = self.config
        x, q = self.query(token_ids, hidden, positions)
        outs = []
        for b in range(q.shape[0]):
            k = keys[b].to(q.dtype).transpose(0, 1)  # [Hkv, n, D]
            v = values[b].to(q.dtype).transpose(0, 1)
            outs.append(F.scaled_dot_product_attention(
                q[b][:, None, :], k, v, scale=c.head_dim ** -0.5,
                enable_gqa=c.num_heads != c.num_kv_heads)[:, 0, :])
        return self.finish(x, torch.stack(outs))

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., draft_vocab] of outputs ``g`` [..., d]."""
        return g @ self.lm_head.t()

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary indices."""
        return self.draft_to_target[draft_ids]

    def unrolled(self, token_ids: torch.Tensor, hidden: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, anchors: torch.Tensor, depth: int,
                 own_drafts: bool = False) -> list[torch.Tensor]:
        """Training and evaluation over one sequence: ``depth`` steps from every anchor at
        once, teacher-forced. ``token_ids`` [T] the sequence, ``hidden`` [T, d] the target's
        final hidden states, ``keys`` / ``values`` [T, Hkv, D] the target layer's K/V,
        ``anchors`` [A] positions ``s`` (>= 1) of a last committed token: step k reads token
        ``s + k`` and (k = 0) the target's state at ``s - 1`` or (k > 0) its own step-(k-1)
        output, at RoPE position ``s``, over rows ``[0, s)``. Returns ``depth`` outputs
        ``g`` [A, d]; step k's predicts the token at ``s + k + 1`` (callers mask anchors
        whose ``s + k + 1`` is past the sequence: their token index is clamped).
        ``own_drafts``: step k > 0 reads step k-1's argmax draft instead of the sequence's
        token (drafting as served: the evaluation's chains)."""
        c = self.config
        T = token_ids.shape[0]
        mask = torch.arange(T, device=anchors.device)[None, :] < anchors[:, None]  # [A, T]
        k = keys.to(self.fc.weight.dtype).transpose(0, 1)[None]  # [1, Hkv, T, D]
        v = values.to(self.fc.weight.dtype).transpose(0, 1)[None]
        h = hidden[anchors - 1]
        outs = []
        for step in range(depth):
            tok = token_ids[(anchors + step).clamp(max=T - 1)]
            if own_drafts and step:
                tok = self.target_ids(self.logits(h).argmax(-1))
            x, q = self.query(tok, h, anchors)
            att = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k, v, attn_mask=mask[None, None],
                scale=c.head_dim ** -0.5, enable_gqa=c.num_heads != c.num_kv_heads)
            g = self.finish(x, att[0].transpose(0, 1))
            outs.append(g)
            h = g
        return outs
