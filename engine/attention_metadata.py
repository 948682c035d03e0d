"""Where each request's tokens sit in one ragged forward: the metadata every attention layer
of :mod:`engine.model` reads, with the paged-attention plan they share."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specmesh.engine.block_manager import slot_mapping as _slot_mapping
from specmesh.kernels.paged_attention_plan import PagedAttentionPlan, plan_paged_attention


@dataclass
class AttentionMetadata:
    """Where each request's tokens sit in a flat batch of T = sum(query_lens) tokens.

    ``kv_lens[i]`` is request i's KV length after this chunk (start_pos + q_len);
    ``slot_mapping`` is a LongTensor [T] of cache slots for the batch's new K/V.
    ``tree_masks`` (None: all chains): per request None or the bool [q_len, q_len] ancestry
    mask of its token tree chunk (engine/token_tree.py): its rows see the KV before the chunk
    and their ancestors' rows only. ``paged``: whole prompts too go through the paged
    attention (chunk invariant: a row's result does not depend on where its chunk starts, so a
    prompt computed after a cached prefix equals the prompt computed whole, bit for bit; the
    prefill's prefix cache asks for it).
    """

    query_lens: list[int]
    kv_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor
    block_size: int = 0
    tree_masks: list[torch.Tensor | None] | None = None
    paged: bool = False
    _plan: PagedAttentionPlan | None = field(default=None, repr=False)
    _prepared: bool = field(default=False, repr=False)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        start_positions: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: str | torch.device = "cpu",
        tree_masks: list[torch.Tensor | None] | None = None,
        paged: bool = False,
    ) -> AttentionMetadata:
        """Metadata for requests whose chunk i starts at ``start_positions[i]`` (the slot of
        its row 0; rows take consecutive slots, trees included).

        Raises:
            ValueError: lists of different lengths, an empty chunk, or a block table too short.
        """
        if not len(query_lens) == len(start_positions) == len(block_tables):
            raise ValueError("query_lens, start_positions and block_tables differ in length")
        slots: list[int] = []
        for q_len, start, table in zip(query_lens, start_positions, block_tables):
            if q_len < 1:
                raise ValueError("every chunk needs at least one query token")
            slots += _slot_mapping(table, start, q_len, block_size)
        return cls(
            query_lens=list(query_lens),
            kv_lens=[s + q for s, q in zip(start_positions, query_lens)],
            block_tables=[list(t) for t in block_tables],
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            block_size=block_size,
            tree_masks=tree_masks if tree_masks and any(m is not None for m in tree_masks)
            else None,
            paged=paged,
        )

    @property
    def whole_prompts(self) -> bool:
        """Every chunk is a whole prompt (q_len == kv_len): its K/V are all in this chunk
        (never with a token tree)."""
        return self.tree_masks is None and all(
            q == n for q, n in zip(self.query_lens, self.kv_lens))

    def prepare(self, device: torch.device) -> None:
        """Build (once per forward) the paged-attention plan every layer shares; nothing when
        every chunk is a whole prompt (those attend within the chunk, causal) unless ``paged``."""
        if self._prepared:
            return
        self._prepared = True
        if self.paged or not self.whole_prompts:
            self._plan = plan_paged_attention(self.query_lens, self.kv_lens, self.block_tables,
                                              self.block_size, device, self.tree_masks)


__all__ = ["AttentionMetadata"]
