"""Contiguous per-slot KV for batched offline generation (self-distillation data for
``specmesh train-drafter``), where throughput matters and batch invariance does not.

The serving path keeps its KV paged and reduces attention in fixed tiles
(:mod:`kernels.paged_attention`) so that a verify step equals a decode step bit for bit; that
costs a gather and copies of every request's KV per layer and step. Offline generation needs
neither property: each sequence owns a slot, a contiguous ``[Hkv, max_len, D]`` strip of keys
and one of values per layer, and a decode step attends with one masked
``scaled_dot_product_attention`` over views of the slots (no gather, no copy), several times
cheaper than the paged reference for a large offline batch (docs/benchmarks.md, 'Attention').

Chunks of a forward (:class:`DenseBatch`): either one token each (a decode step: batched over
slots) or several tokens (a prompt, or any chunk: attended one by one, causal aligned
bottom-right). Results are those of exact attention up to floating-point order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specmesh.engine.config import ModelConfig
from specmesh.engine.dtypes import model_dtype


@dataclass
class DenseBatch:
    """Where the chunks of one forward over a :class:`DenseKVCache` go: chunk i is
    ``query_lens[i]`` tokens of slot ``slots[i]`` starting at position ``start_positions[i]``
    (the KV of positions ``[0, start)`` of that slot is already cached). Slots of one forward
    must differ."""

    slots: list[int]
    start_positions: list[int]
    query_lens: list[int]
    _index: dict = field(default_factory=dict, repr=False)

    def prepare(self, device: torch.device) -> None:
        """Build the index tensors every layer shares (once per forward)."""
        if self._index:
            return
        decode = [i for i, q in enumerate(self.query_lens) if q == 1]
        offsets = [0]
        for q in self.query_lens:
            offsets.append(offsets[-1] + q)
        idx = self._index
        idx["offsets"] = offsets
        idx["chunks"] = [i for i, q in enumerate(self.query_lens) if q > 1]
        if decode:
            slots = [self.slots[i] for i in decode]
            pos = [self.start_positions[i] for i in decode]
            span, length = max(slots) + 1, max(pos) + 1
            visible = torch.ones(span, dtype=torch.long)  # unused slots: one position (finite)
            visible[slots] = torch.tensor(pos) + 1
            idx["decode_rows"] = torch.tensor([offsets[i] for i in decode], device=device)
            idx["decode_slots"] = torch.tensor(slots, device=device)
            idx["decode_pos"] = torch.tensor(pos, device=device)
            idx["span"], idx["length"] = span, length
            idx["mask"] = (torch.arange(length)[None, :] < visible[:, None]).to(device)[
                :, None, None, :]


class DenseKVCache:
    """Keys and values of ``num_slots`` sequences of up to ``max_len`` positions each, per
    layer ``[num_slots, Hkv, max_len, D]`` (keys after RoPE), for :class:`DenseBatch`
    forwards of ``engine.model.LlamaForCausalLM``.

    Memory: ``num_layers * 2 * num_slots * max_len * Hkv * D`` elements of ``dtype``.

    Raises:
        ValueError: ``num_slots < 1`` or ``max_len < 1``, or (in :meth:`check`, which callers
            run before a forward) a chunk outside its slot, or two chunks of one forward in
            the same slot.
    """

    def __init__(self, config: ModelConfig, num_slots: int, max_len: int,
                 dtype: str | torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"need num_slots >= 1 and max_len >= 1, got {num_slots}, {max_len}")
        self.num_slots, self.max_len = num_slots, max_len
        self.dtype = model_dtype(dtype)
        shape = (config.num_layers, num_slots, config.num_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=device)

    def check(self, batch: DenseBatch) -> None:
        """Validate a batch against this cache (see the class doc for the errors)."""
        if len(set(batch.slots)) != len(batch.slots):
            raise ValueError("two chunks of one forward share a slot")
        for s, start, q in zip(batch.slots, batch.start_positions, batch.query_lens):
            if not 0 <= s < self.num_slots:
                raise ValueError(f"slot {s} outside [0, {self.num_slots})")
            if q < 1 or start < 0 or start + q > self.max_len:
                raise ValueError(f"chunk of {q} tokens at {start} does not fit a slot of "
                                 f"{self.max_len} positions")

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               batch: DenseBatch, scale: float) -> torch.Tensor:
        """Write this forward's ``k``/``v`` [T, Hkv, D] of ``layer`` into their slots and return
        the attention of ``q`` [T, H, D] over each slot's positions up to its own row, [T, H,
        D] (grouped-query: head h reads KV head h // (H // Hkv))."""
        idx = batch._index
        kc, vc = self.k[layer], self.v[layer]
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        if "decode_rows" in idx:
            rows, slots, pos = idx["decode_rows"], idx["decode_slots"], idx["decode_pos"]
            kc[slots, :, pos] = k[rows]
            vc[slots, :, pos] = v[rows]
            span, length = idx["span"], idx["length"]
            qd = q.new_zeros((span, q.shape[1], 1, q.shape[2]))
            qd[slots, :, 0] = q[rows]
            res = F.scaled_dot_product_attention(
                qd, kc[:span, :, :length], vc[:span, :, :length], attn_mask=idx["mask"],
                scale=scale, enable_gqa=gqa)
            out[rows] = res[slots, :, 0]
        offsets = idx["offsets"]
        for i in idx["chunks"]:
            s, start, n = batch.slots[i], batch.start_positions[i], batch.query_lens[i]
            lo, hi = offsets[i], offsets[i] + n
            kc[s, :, start:start + n] = k[lo:hi].transpose(0, 1)
            vc[s, :, start:start + n] = v[lo:hi].transpose(0, 1)
            end = start + n
            mask = None
            if start:  # bottom-right causal: row j sees positions <= start + j
                mask = (torch.arange(end, device=q.device)[None, :]
                        <= start + torch.arange(n, device=q.device)[:, None])
            out[lo:hi] = F.scaled_dot_product_attention(
                q[lo:hi].transpose(0, 1), kc[s, :, :end], vc[s, :, :end], attn_mask=mask,
                is_causal=mask is None and n > 1, scale=scale, enable_gqa=gqa).transpose(0, 1)
        return out


__all__ = ["DenseBatch", "DenseKVCache"]
