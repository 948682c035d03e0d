"""The DFlash draft model: a block drafter that borrows the target's embedding and LM head and
reads the target's hidden states as its attention context (z-lab, DFlash, arXiv 2602.06036;
vLLM ``vllm/v1/spec_decode/dflash.py`` ``DFlashProposer``; SGLang ``dflash_worker_v2.py``).

Shape (:class:`DFlashConfig`, drafter/dflash_config.py): ``num_layers`` pre-norm decoder
layers of the target's shape (drafter/eagle/layer.py), a fusion ``fc`` ([n_feat * d] -> d) with
``hidden_norm``, a final ``norm`` and ``mask_embedding`` [d], the input vector of a mask row.
No embedding table and no LM head of its own: ``embed`` and ``lm_head`` are the target's,
frozen buffers that are never stored in a checkpoint.

Context (:meth:`DFlashDraft.context_kv`): a target hidden-state row at position ``i`` (the
outputs of the target layers ``feature_layers`` side by side, engine/hidden_layers.py; or the
final-norm state) is fused, ``c_i = hidden_norm(fc(row_i))``, and every layer's K/V at
position ``i`` is ``rope(k_proj(c_i))``, ``v_proj(c_i)``: computed once, from the target's
states alone, when the verifier commits the token at ``i``, and written into the request's
context KV (drafter/dflash_kv.py). The draft's own forwards never add to it (no draft /
draft-extend split: SGLang's DFlash worker states the same).

Block (:meth:`DFlashDraft.block_hidden`): one forward over ``[x_a, .., x_{a+r}, MASK x k]`` at
positions ``a .. a+r+k``: the tokens after the last context row (``x_a``, the bonus token, and
``r`` run-ahead tokens whose hidden states the target has not computed yet), embedded with the
target's embedding, then ``k`` mask rows. Queries come only from the block; keys and values
are the context rows at positions ``< a`` followed by the block's own, attention is
non-causal (every block row sees the whole block). Mask row ``j`` predicts the token AT its
position (``a + r + j``): ``k`` drafts per forward, none of which saw another.

Anchor input (``anchor_input``, a specmesh variant for drafts of one or two layers): every
block row's input also carries ``anchor_fc([c_{a-1}; e(x_a)])``, the fused target row just
before the block and the embedding of the block's first token (what an EAGLE head's input
pairs, arXiv 2401.15077). Through attention alone a one-layer draft reads a context row only
through its ``num_kv_heads * head_dim`` value dimensions; this hands the block the whole
state the target's last row carries. ``anchor_fc`` starts at zero (training starts from plain
DFlash); the context KV then also holds the fused rows (one more entry after the layers').

Training (:meth:`DFlashDraft.training_logits`) runs many anchors of one sample in one forward
under a boolean attention mask and computes exactly what serving computes for each anchor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specmesh.drafter.dflash_config import DFlashConfig
from specmesh.drafter.eagle.layer import DecoderLayer, RMSNorm, rope
from specmesh.engine.backend import CpuBackend, default_backend
from specmesh.engine.linear import RowInvariantLinear
from specmesh.kernels.gguf_matmul import gguf_matmul

#: the token id that marks a mask row in a block (never a vocabulary id)
MASK = -1


#: one layer's context K/V: k, v [num_kv_heads, n, head_dim] (RoPE applied to k)
LayerKV = tuple[torch.Tensor, torch.Tensor]


class DFlashDraft(nn.Module):
    """Trainable: ``fc``, ``hidden_norm``, ``layers``, ``norm``, ``mask_embedding``. Frozen
    buffers set by :meth:`set_target_weights`: the target's ``embed`` [vocab, d] and the rows
    ``draft_to_target`` [num_draft_logits] of its LM head, ``lm_head`` [num_draft_logits, d]
    (module docstring; ``draft_to_target`` is stored in the checkpoint when the draft has a
    draft vocabulary). Products compute with ``backend`` (engine/backend.py;
    None: the process's default)."""

    def __init__(self, config: DFlashConfig, backend: CpuBackend | None = None) -> None:
        super().__init__()
        self.config = config
        backend = backend if backend is not None else default_backend()
        d = config.hidden_size
        self.fc = RowInvariantLinear(config.seed_width, d, bias=False, backend=backend)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        if config.feature_norms:
            self.feature_norms = nn.ModuleList([
                RMSNorm(d, config.rms_norm_eps)
                for _ in range(max(1, len(config.feature_layers)))])
        self.layers = nn.ModuleList([DecoderLayer(config, backend)  # type: ignore[arg-type]
                                     for _ in range(config.num_layers)])
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(d))
        if config.anchor_input:
            self.anchor_fc = RowInvariantLinear(2 * d, d, bias=False, backend=backend)
            with torch.no_grad():
                self.anchor_fc.weight.zero_()
        self.register_buffer("embed", torch.zeros(config.vocab_size, d), persistent=False)
        n = config.num_draft_logits
        self.register_buffer("lm_head", torch.zeros(n, d), persistent=False)
        self.register_buffer("draft_to_target", torch.arange(n),
                             persistent=config.draft_vocab_size > 0)
        #: Q8_0 blocks of ``lm_head`` and the (data_ptr, _version) they expand to, for serving
        #: (drafter/eagle/quantize.py ``quantize_rows``; None: the float product)
        self.lm_head_blocks = None
        self._columns: torch.Tensor | None = None  # draft_columns' table, built on first use
        self._inv_freq = 1.0 / config.rope_theta ** (
            torch.arange(0, config.head_dim, 2).float() / config.head_dim)

    # -- weights ---------------------------------------------------------------------------

    def set_draft_vocabulary(self, draft_to_target: torch.Tensor) -> None:
        """The target ids [draft_vocab_size] the draft's logits score, before
        :meth:`set_target_weights` (a checkpoint load sets them from its weights).

        Raises:
            ValueError: a draft without a draft vocabulary, ids of another count or outside
                the vocabulary.
        """
        c = self.config
        ids = draft_to_target.long()
        if c.draft_vocab_size == 0 or tuple(ids.shape) != (c.draft_vocab_size,) or (
                int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size):
            raise ValueError(f"draft vocabulary of shape {tuple(ids.shape)} does not fit "
                             f"draft_vocab_size {c.draft_vocab_size} / vocab {c.vocab_size}")
        self.draft_to_target = ids.to(self.draft_to_target.device).clone()
        self._columns = None  # the target id -> column table, rebuilt on first use

    def set_target_weights(self, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        """Install the target's embedding and LM head, [vocab, d] each (a tied model: the
        same tensor twice); only the ``draft_to_target`` rows of the LM head are kept.

        Raises:
            ValueError: shapes that do not fit the config.
        """
        c = self.config
        if tuple(embed.shape) != (c.vocab_size, c.hidden_size) or lm_head.shape != embed.shape:
            raise ValueError(f"target embedding {tuple(embed.shape)} / LM head "
                             f"{tuple(lm_head.shape)} do not fit a DFlash draft for vocab "
                             f"{c.vocab_size}, hidden {c.hidden_size}")
        dtype = self.fc.weight.dtype
        self.embed = embed.detach().to(dtype).clone()
        rows = self.draft_to_target.to(lm_head.device)
        self.lm_head = lm_head.detach()[rows].to(dtype).contiguous()

    def init_from_target(self, target_layers: list[nn.Module]) -> None:
        """Start draft layer ``i`` from the engine decoder layer ``target_layers[i]``
        (engine/model.py ``DecoderLayer``: attention, MLP and both norms copied); the fusion
        and the mask vector keep their initialisation."""
        with torch.no_grad():
            for mine, theirs in zip(self.layers, target_layers):
                a, m = theirs.self_attn, theirs.mlp
                for name, src in (("q_proj", a.q_proj), ("k_proj", a.k_proj),
                                  ("v_proj", a.v_proj), ("o_proj", a.o_proj),
                                  ("gate_proj", m.gate_proj), ("up_proj", m.up_proj),
                                  ("down_proj", m.down_proj),
                                  ("input_layernorm", theirs.input_layernorm),
                                  ("post_attention_layernorm", theirs.post_attention_layernorm)):
                    getattr(mine, name).weight.copy_(src.weight)

    def num_own_parameters(self) -> int:
        """Parameters the checkpoint stores (the target's embedding and LM head excluded)."""
        return sum(p.numel() for p in self.parameters())

    def own_weight_bytes(self) -> int:
        """Bytes of the stored weights as they sit in memory (excluding the target's)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    # -- pieces ----------------------------------------------------------------------------

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):  # noqa: ANN202
        freqs = positions.float()[..., None] * self._inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def fuse(self, rows: torch.Tensor) -> torch.Tensor:
        """Context rows [n, seed_width] -> the fused states [n, d] every layer's K/V reads.

        Raises:
            ValueError: rows of another width.
        """
        if rows.shape[-1] != self.config.seed_width:
            raise ValueError(f"context rows are {rows.shape[-1]} wide, the DFlash draft reads "
                             f"{self.config.seed_width}")
        rows = rows.to(self.fc.weight.dtype)
        if self.config.feature_norms:
            parts = rows.split(self.config.hidden_size, dim=-1)
            rows = torch.cat([n(x) for n, x in zip(self.feature_norms, parts)], dim=-1)
        return self.hidden_norm(self.fc(rows))

    def context_kv(self, rows: torch.Tensor, positions: torch.Tensor) -> list[LayerKV]:
        """Per layer, the K/V [num_kv_heads, n, head_dim] of target hidden-state ``rows``
        [n, seed_width] at ``positions`` [n] (what the context KV holds for them)."""
        return self._context_kv(self.fuse(rows), positions)

    def _context_kv(self, c: torch.Tensor, positions: torch.Tensor) -> list[LayerKV]:
        cos, sin = self._cos_sin(positions, c.dtype)
        n, cfg = c.shape[0], self.config
        out = []
        for layer in self.layers:
            k = layer.k_proj(c).view(n, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
            v = layer.v_proj(c).view(n, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
            out.append((rope(k, cos, sin), v))
        if cfg.anchor_input:  # the fused rows themselves, for the next block's anchor
            out.append((c[None], c[None, :, :0]))
        return out

    def block_embeddings(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Inputs [T, d] of a block's ids [T] (:data:`MASK` rows: ``mask_embedding``)."""
        is_mask = token_ids == MASK
        emb = self.embed[token_ids.clamp(min=0)]
        return torch.where(is_mask[:, None], self.mask_embedding.to(emb.dtype), emb)

    def anchor(self, fused_row: torch.Tensor, first_ids: torch.Tensor) -> torch.Tensor:
        """``anchor_fc([c; e(x)])`` [n, d] of fused rows [n, d] and block-first ids [n]."""
        return self.anchor_fc(torch.cat([fused_row.to(self.embed.dtype),
                                         self.embed[first_ids]], dim=-1))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., num_draft_logits] of final hidden states [..., d]: column i
        scores target id ``draft_to_target[i]``."""
        b = self.lm_head_blocks
        if b is not None and hidden.dim() == 2 and hidden.dtype == torch.float32 \
                and hidden.is_cpu and b[1] == (self.lm_head.data_ptr(), self.lm_head._version):
            return gguf_matmul(hidden, b[0])
        return F.linear(hidden, self.lm_head)

    def draft_columns(self, token_ids: torch.Tensor, missing: int = -100) -> torch.Tensor:
        """The logit column of each target id in ``token_ids`` (same shape), ``missing``
        where the draft vocabulary lacks the id (a training label it cannot score)."""
        if self.config.draft_vocab_size == 0:
            return token_ids
        if self._columns is None:
            ids = self.draft_to_target
            self._columns = torch.full((self.config.vocab_size,), -1, dtype=torch.long,
                                       device=ids.device)
            self._columns[ids] = torch.arange(ids.shape[0], device=ids.device)
        cols = self._columns.to(token_ids.device)[token_ids.clamp(min=0)]
        cols = torch.where(cols < 0, torch.full_like(cols, missing), cols)
        return torch.where(token_ids >= 0, cols, token_ids)

    def target_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Target token ids of logit ``columns`` (any shape)."""
        return self.draft_to_target.to(columns.device)[columns]

    # -- serving ---------------------------------------------------------------------------

    def block_hidden(self, blocks: list[tuple[list[LayerKV], list[int], int]]) -> torch.Tensor:
        """One forward for several requests' blocks: each ``(context, token_ids, start)`` is
        a request's context K/V (per layer, the rows at positions before ``start``), its block
        ids (:data:`MASK` for mask rows) and the block's first position. Returns the final
        hidden states [sum of block lengths, d], the blocks one after the other. The products
        run on all blocks at once; attention per block (non-causal, over context + block)."""
        lengths = [len(ids) for _, ids, _ in blocks]
        dev = self.embed.device
        ids = torch.tensor([t for _, b, _ in blocks for t in b], dtype=torch.long, device=dev)
        pos = torch.tensor([s + j for (_, _, s), n in zip(blocks, lengths) for j in range(n)],
                           dtype=torch.long, device=dev)
        x = self.block_embeddings(ids)
        if self.config.anchor_input:  # each block's anchor on all its rows
            fused = torch.stack([ctx[-1][0][0, -1] for ctx, _, _ in blocks])
            first = torch.tensor([b[0] for _, b, _ in blocks], dtype=torch.long, device=dev)
            x = x + self.anchor(fused, first).repeat_interleave(
                torch.tensor(lengths, device=dev), dim=0)
        cos, sin = self._cos_sin(pos, x.dtype)
        rep = self.config.num_heads // self.config.num_kv_heads
        for li, layer in enumerate(self.layers):
            q, k, v = layer.qkv(x, cos, sin)  # [nh, T, hd], [nkv, T, hd]
            parts, lo = [], 0
            for (ctx, _, _), n in zip(blocks, lengths):
                ck, cv = ctx[li]
                kk = torch.cat([ck.to(k.dtype), k[:, lo:lo + n]], dim=1)
                vv = torch.cat([cv.to(v.dtype), v[:, lo:lo + n]], dim=1)
                parts.append(F.scaled_dot_product_attention(
                    q[:, lo:lo + n], kk.repeat_interleave(rep, dim=0),
                    vv.repeat_interleave(rep, dim=0)))
                lo += n
            x = layer.finish(x, torch.cat(parts, dim=1))
        return self.norm(x)

    # -- training --------------------------------------------------------------------------

    def training_logits(self, rows: torch.Tensor, rows_start: int, block_ids: torch.Tensor,
                        block_starts: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
        """Logits of many anchors' blocks of one sample in one forward, as serving computes
        each alone: ``rows`` [n, seed_width] are the sample's context rows at positions
        ``rows_start ..``; ``block_ids`` [A, B] the blocks (:data:`MASK` rows), block ``i`` at
        positions ``block_starts[i] ..`` attending to the rows before ``block_starts[i]`` and
        to itself. Returns the logits [m, vocab] of the block rows where ``select`` [A, B] is
        True (row-major order)."""
        A, B = block_ids.shape
        dev = rows.device
        c = self.fuse(rows)
        n = c.shape[0]
        ctx_pos = torch.arange(rows_start, rows_start + n, device=dev)
        pos = (block_starts[:, None] + torch.arange(B, device=dev)).reshape(-1)
        x = self.block_embeddings(block_ids.reshape(-1))
        if self.config.anchor_input:  # the row before each block, its first token
            u = self.anchor(c[block_starts - rows_start - 1], block_ids[:, 0])
            x = x + u.repeat_interleave(B, dim=0)
        cos, sin = self._cos_sin(pos, x.dtype)
        anchor = torch.arange(A, device=dev).repeat_interleave(B)
        sees_ctx = ctx_pos[None, :] < block_starts[anchor][:, None]  # [A*B, n]
        sees_blk = anchor[:, None] == anchor[None, :]  # [A*B, A*B]
        allowed = torch.cat([sees_ctx, sees_blk], dim=1)
        rep = self.config.num_heads // self.config.num_kv_heads
        ctx_kv = self._context_kv(c, ctx_pos)
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            q, k, v = layer.qkv(x, cos, sin)
            kk = torch.cat([ck.to(k.dtype), k], dim=1).repeat_interleave(rep, dim=0)
            vv = torch.cat([cv.to(v.dtype), v], dim=1).repeat_interleave(rep, dim=0)
            attn = F.scaled_dot_product_attention(q, kk, vv, attn_mask=allowed)
            x = layer.finish(x, attn)
        h = self.norm(x)[select.reshape(-1)]
        return self.logits(h)
