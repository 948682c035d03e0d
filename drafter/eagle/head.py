"""EAGLE-style feature head: drafts the target's next tokens from its hidden states.

Li et al., EAGLE (arXiv 2401.15077): the input at entry position ``s`` is the target's final
hidden state ``f_s`` (final-norm output, the input of the LM head) fused with the embedding of
the token at ``s + 1``; a fusion layer (2d -> d) and ``num_layers`` decoder layers of the
target's shape predict ``f_{s+1}``, and the target's LM head turns that into the distribution
of the token at ``s + 2``. Embedding and LM head are the target's, frozen; the head keeps only
the rows of a draft vocabulary (EAGLE-3, arXiv 2503.01840, drafts over a reduced vocabulary):
the LM head is the expensive part of a 1-layer head at a 49k vocabulary.

With ``feature_layers`` (EAGLE-3's feature fusion) the true input at ``s`` is instead the
outputs of those target decoder layers side by side (low, middle and high), each RMS-normed and
fused by a linear layer (n*d -> d) into the d-wide state the rest of the head reads; predicted
states (pass 2 on, and the chain while drafting) are the head's own d-wide outputs.

A multi-layer head (``num_steps`` > 1, drafter/eagle/steps.py) has one such module per draft
depth: the one above is module 0, modules 1.. are
:class:`~drafter.eagle.steps.StepModule` modules in ``steps``; the entry points below take the
module to run (``step``, default 0).

Two entry points share the weights: :meth:`EagleHead.forward_passes` runs ``depth`` unrolled
passes over whole sequences for training and evaluation (EAGLE-3's "training-time test": pass
k sees the features pass k-1 predicted, as drafting does), and :meth:`EagleHead.extend` runs
entries for one request against its own :class:`HeadKV` (drafting).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specmesh.drafter.eagle.config import EagleHeadConfig
from specmesh.drafter.eagle.head_kv import HeadKV
from specmesh.drafter.eagle.layer import DecoderLayer, RMSNorm
from specmesh.drafter.eagle.steps import StepModule, forward_steps
from specmesh.engine import onednn
from specmesh.engine.backend import CpuBackend, default_backend
from specmesh.engine.linear import RowInvariantLinear
from specmesh.kernels.gguf_matmul import gguf_matmul


class EagleHead(nn.Module):
    """Trainable parameters: ``fc`` (2d -> d), ``layers``, ``norm`` (module 0) and, for a
    multi-layer head, ``steps`` (modules 1 .. num_steps - 1). Frozen buffers set by
    :meth:`set_target_weights`: ``embed`` [vocab, d] and ``lm_head`` [draft_vocab, d] with
    ``draft_to_target`` [draft_vocab] (target token id of each draft-vocabulary row).
    Inference runs its products on prepacked oneDNN weights (engine/onednn.py) where
    ``backend`` (the CPU backend, engine/backend.py; None: the process's default) has
    ``prepacked_linear`` on."""

    def __init__(self, config: EagleHeadConfig, backend: CpuBackend | None = None) -> None:
        super().__init__()
        self.config = config
        self.backend = backend = backend if backend is not None else default_backend()
        self._lm_head_pack = onednn.PackCache()  # of the frozen lm_head buffer
        # (Q8_0 blocks that expand to lm_head, (its data_ptr, _version) then):
        # drafter/eagle/quantize.py
        self.lm_head_blocks = None
        d = config.hidden_size
        self.fc = RowInvariantLinear(2 * d, d, bias=False, backend=backend)
        n_feat = len(config.feature_layers)
        self.feature_norms = nn.ModuleList([RMSNorm(d, config.rms_norm_eps)
                                            for _ in range(n_feat)])
        self.fuse = RowInvariantLinear(n_feat * d, d, bias=False, backend=backend) \
            if n_feat else None
        self.layers = nn.ModuleList([DecoderLayer(config, backend)
                                     for _ in range(config.num_layers)])
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.steps = nn.ModuleList([StepModule(config, backend)
                                    for _ in range(config.num_steps - 1)])
        n_draft = config.draft_vocab_size or config.vocab_size
        self.register_buffer("embed", torch.zeros(config.vocab_size, d), persistent=False)
        self.register_buffer("lm_head", torch.zeros(n_draft, d), persistent=False)
        self.register_buffer("draft_to_target", torch.arange(n_draft), persistent=False)
        inv = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2).float()
                                          / config.head_dim)
        self._inv_freq = inv

    # -- weights ---------------------------------------------------------------------------

    def set_target_weights(self, embed: torch.Tensor, lm_head: torch.Tensor,
                           draft_to_target: torch.Tensor | None = None) -> None:
        """Install the target's embedding [vocab, d] and LM head [vocab, d]; keep the LM-head
        rows of ``draft_to_target`` (LongTensor [draft_vocab], default: all rows).

        Raises:
            ValueError: shapes that do not fit the config.
        """
        c = self.config
        if tuple(embed.shape) != (c.vocab_size, c.hidden_size) or lm_head.shape != embed.shape:
            raise ValueError(f"target embedding {tuple(embed.shape)} / LM head "
                             f"{tuple(lm_head.shape)} do not fit a head for vocab {c.vocab_size},"
                             f" hidden {c.hidden_size}")
        n_draft = c.draft_vocab_size or c.vocab_size
        ids = torch.arange(c.vocab_size) if draft_to_target is None else draft_to_target.long()
        if ids.shape != (n_draft,) or int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size:
            raise ValueError(f"draft vocabulary of {tuple(ids.shape)} ids does not fit "
                             f"draft_vocab_size {n_draft} / vocab {c.vocab_size}")
        dtype = self.fc.weight.dtype
        self.embed = embed.detach().to(dtype).clone()
        self.lm_head = lm_head.detach()[ids].to(dtype).clone()
        self.draft_to_target = ids.clone()

    def step_parts(self, step: int) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
        """``(fc, layers, norm)`` of module ``step`` (0: the head's own).

        Raises:
            IndexError: no such module.
        """
        if step == 0:
            return self.fc, self.layers, self.norm
        if not 0 < step < self.config.num_steps:
            raise IndexError(f"module {step} of a {self.config.num_steps}-module EAGLE head")
        s = self.steps[step - 1]
        return s.fc, s.layers, s.norm

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):  # noqa: ANN202
        freqs = positions.float()[..., None] * self._inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def seed_features(self, rows: torch.Tensor) -> torch.Tensor:
        """True seed-state rows [..., seed_width] -> the d-wide states the head reads
        (identity for an EAGLE-1 head; the norms and fusion layer with ``feature_layers``).

        Raises:
            ValueError: rows of another width.
        """
        c = self.config
        if rows.shape[-1] != c.seed_width:
            raise ValueError(f"seed rows are {rows.shape[-1]} wide, the head reads {c.seed_width}")
        rows = rows.to(self.fc.weight.dtype)
        if self.fuse is None:
            return rows
        parts = rows.split(c.hidden_size, dim=-1)
        return self.fuse(torch.cat([n(p) for n, p in zip(self.feature_norms, parts)], dim=-1))

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., draft_vocab] of predicted features [..., d]."""
        if features.dim() == 2:  # inference rows: the LM head's blocks or prepacked product
            b = self.lm_head_blocks
            if b is not None and features.dtype == torch.float32 and features.is_cpu \
                    and b[1] == (self.lm_head.data_ptr(), self.lm_head._version):
                return gguf_matmul(features, b[0])
            if self.backend.prepacked_linear.on:
                packed = self._lm_head_pack.get(features, self.lm_head)
                if packed is not None:
                    return onednn.linear(features, packed, None)
        return features @ self.lm_head.T

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary indices."""
        return self.draft_to_target[draft_ids]

    # -- training / evaluation -------------------------------------------------------------

    def forward_passes(self, features: torch.Tensor, next_tokens: torch.Tensor,
                       positions: torch.Tensor, depth: int = 1) -> list[torch.Tensor]:
        """``depth`` unrolled passes over a batch of sequences (EAGLE-3's training-time test).

        Args:
            features: [B, S, seed_width] the target's seed states at entries s = 0..S-1
                (f_s, or with ``feature_layers`` the fused layers' outputs).
            next_tokens: LongTensor [B, S], the token at s + 1 of each entry.
            positions: LongTensor [B, S] absolute positions (RoPE).
            depth: passes. Pass 1 reads the true features; pass k reads at entry s the feature
                pass k-1 predicted at entry s-1, and attends to pass-1 entries ``<= s-k+1`` and
                to pass-m entry ``s-k+m`` (m = 2..k), exactly what drafting a chain of k tokens
                from true features up to ``s-k+1`` sees.

        Returns:
            ``depth`` tensors [B, S, d] of predicted features; pass k's row s predicts the
            feature at s + 1, whose LM-head argmax is the k-th draft of a chain started from
            true features up to entry s - k + 1. Row s < k - 1 of pass k has no such chain.
            A multi-layer head runs :func:`~drafter.eagle.steps.forward_steps` (fewer
            passes when it stops at its last module).
        """
        if self.config.num_steps > 1:
            return forward_steps(self, features, next_tokens, positions, depth)
        features = self.seed_features(features)
        B, S, _ = features.shape
        dtype = features.dtype
        cos, sin = self._cos_sin(positions, dtype)  # [B, S, hd]
        cos, sin = cos[:, None], sin[:, None]
        emb = self.embed[next_tokens]
        idx = torch.arange(S, device=features.device)
        outs: list[torch.Tensor] = []
        passes_kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # [pass][layer] (k, v)
        prev = features
        for k in range(1, depth + 1):
            if k == 1:
                feat = features
            else:  # entry s reads pass k-1's prediction made at s-1 (row 0: none -> zeros)
                feat = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)
            x = self.fc(torch.cat([emb, feat], dim=-1))
            # mask over keys [pass 1 | pass 2 | ... | pass k], each S long; every row sees at
            # least its own pass-k key, so no row is fully masked
            masks = [idx[None, :] <= (idx[:, None] - k + 1)]
            for m in range(2, k + 1):
                masks.append(idx[None, :] == (idx[:, None] - k + m))
            mask = torch.cat(masks, dim=1)  # [S, k*S]
            new_kv = []
            for li, layer in enumerate(self.layers):
                q, kk, vv = layer.qkv(x, cos, sin)
                new_kv.append((kk, vv))
                keys = torch.cat([p[li][0] for p in passes_kv] + [kk], dim=2)
                vals = torch.cat([p[li][1] for p in passes_kv] + [vv], dim=2)
                attn = F.scaled_dot_product_attention(
                    q, keys, vals, attn_mask=mask, enable_gqa=layer.nh != layer.nkv)
                x = layer.finish(x, attn)
            passes_kv.append(new_kv)
            prev = self.norm(x)
            outs.append(prev)
        return outs

    # -- drafting --------------------------------------------------------------------------

    @torch.inference_mode()
    def extend(self, kv: HeadKV, features: torch.Tensor, next_tokens: torch.Tensor,
               start: int, step: int = 0) -> torch.Tensor:
        """Append entries at positions ``[start, start + n)`` to one request's ``kv``.

        Args:
            kv: the request's head KV; must end at ``start`` (an empty one starts there).
            features: [n, d] state of each entry: a true one through :meth:`seed_features`,
                or the one the previous entry predicted.
            next_tokens: LongTensor [n], the token after each entry's position.

            step: the module to run (its own ``kv``).

        Returns:
            predicted features [n, d]; row i predicts the target's feature at ``start + i + 1``.

        Raises:
            ValueError: ``kv`` does not end at ``start``.
        """
        return self.extend_many([(kv, features, next_tokens, start)], step)[0]

    @torch.inference_mode()
    def extend_many(self, items: list[tuple[HeadKV, torch.Tensor, torch.Tensor, int]],
                    step: int = 0) -> list[torch.Tensor]:
        """:meth:`extend` for several requests at once: ``items`` are ``(kv, features [n_i,
        d], next_tokens [n_i], start_i)``, one per request (distinct ``kv``). The products
        (fusion, projections, MLP) run once over all ``sum(n_i)`` rows, so their weights are
        read once per call instead of once per request; attention runs per request over its
        own KV. Each row's result does not depend on the other requests (row-invariant
        products, engine/linear.py). ``step``: the module to run, every ``kv`` being that
        module's.

        Returns:
            per item the predicted features [n_i, d].

        Raises:
            ValueError: a ``kv`` that does not end at its ``start``, or one listed twice.
        """
        if len({id(it[0]) for it in items}) != len(items):
            raise ValueError("extend_many: a request's KV is listed twice")
        for kv, _, _, start in items:
            if kv.length and kv.end != start:
                raise ValueError(f"head KV ends at {kv.end}, entries start at {start}")
        if not items:
            return []
        sizes = [int(f.shape[0]) for _, f, _, _ in items]
        device = items[0][1].device
        pos = torch.cat([torch.arange(s, s + n, device=device)
                         for (_, _, _, s), n in zip(items, sizes)])
        x, cos, sin = self._entry_inputs([f for _, f, _, _ in items],
                                         [t for _, _, t, _ in items], pos, step)
        for kv, _, _, start in items:
            if kv.length == 0:
                kv.start, kv.n = start, 0
        _, layers, norm = self.step_parts(step)
        for li, layer in enumerate(layers):
            q, k, v = layer.qkv(x, cos, sin)  # [nh, T, hd], [nkv, T, hd]
            parts, lo = [], 0
            for (kv, _, _, _), n in zip(items, sizes):
                keys, vals = kv.write(li, k[:, lo:lo + n], v[:, lo:lo + n])
                past = kv.n
                mask = None
                if n > 1:  # row i sees entries up to past + i
                    mask = (torch.arange(past + n, device=device)[None, :]
                            <= (past + torch.arange(n, device=device))[:, None])
                parts.append(F.scaled_dot_product_attention(
                    q[:, lo:lo + n], keys, vals, attn_mask=mask,
                    enable_gqa=layer.nh != layer.nkv))
                lo += n
            x = layer.finish(x, torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
        for (kv, _, _, _), n in zip(items, sizes):
            kv.commit(n)
        return list(norm(x).split(sizes))

    def _entry_inputs(self, features: list[torch.Tensor], next_tokens: list[torch.Tensor],
                      positions: torch.Tensor, step: int = 0):  # noqa: ANN202
        """The fused inputs ``x`` [T, d] of entries (states and next tokens of every item, in
        order) through module ``step``'s fusion layer and the RoPE ``cos, sin`` [T, hd] of
        their ``positions`` [T]."""
        dtype = self.fc.weight.dtype
        cos, sin = self._cos_sin(positions, dtype)
        feats = torch.cat([f.to(dtype) for f in features])
        toks = torch.cat([t.reshape(-1) for t in next_tokens])
        fc = self.step_parts(step)[0]
        return fc(torch.cat([self.embed[toks], feats], dim=-1)), cos, sin

    @torch.inference_mode()
    def peek_many(self, items: list[tuple[HeadKV, int, torch.Tensor, torch.Tensor]],
                  step: int = 0) -> list[torch.Tensor]:
        """Sibling entries, without writing any KV: per item ``(kv, end, features [m, d],
        next_tokens [m])``, m entries all at position ``end``, each attending to ``kv``'s
        entries before ``end`` and to itself only (one level of a token tree): what
        :meth:`extend` would predict for each of them alone on ``kv`` cut at ``end``. The
        products run once over every item's rows, as in :meth:`extend_many`; ``step``: the
        module to run, every ``kv`` being that module's.

        Returns:
            per item the predicted features [m, d].

        Raises:
            ValueError: an ``end`` outside ``(kv.start, kv.end]`` (no entry before it).
        """
        for kv, end, _, _ in items:
            if not kv.length or not kv.start < end <= kv.end:
                raise ValueError(f"peek at {end} on a head KV holding [{kv.start}, {kv.end})")
        if not items:
            return []
        sizes = [int(f.shape[0]) for _, _, f, _ in items]
        device = items[0][2].device
        pos = torch.cat([torch.full((m,), end, dtype=torch.long, device=device)
                         for (_, end, _, _), m in zip(items, sizes)])
        x, cos, sin = self._entry_inputs([f for _, _, f, _ in items],
                                         [t for _, _, _, t in items], pos, step)
        _, layers, norm = self.step_parts(step)
        for li, layer in enumerate(layers):
            q, k, v = layer.qkv(x, cos, sin)
            parts, lo = [], 0
            for (kv, end, _, _), m in zip(items, sizes):
                past = end - kv.start
                keys = torch.cat([kv.keys[li][:, :past], k[:, lo:lo + m]], dim=1)
                vals = torch.cat([kv.values[li][:, :past], v[:, lo:lo + m]], dim=1)
                mask = torch.cat([torch.ones(m, past, dtype=torch.bool, device=device),
                                  torch.eye(m, dtype=torch.bool, device=device)], dim=1)
                parts.append(F.scaled_dot_product_attention(
                    q[:, lo:lo + m], keys, vals, attn_mask=mask,
                    enable_gqa=layer.nh != layer.nkv))
                lo += m
            x = layer.finish(x, torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
        return list(norm(x).split(sizes))

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
