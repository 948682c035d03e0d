"""The EAGLE head over a draft tree: one batched forward per tree depth with a tree attention
mask over the request's own head KV (drafter/eagle/head.py, head_kv.py).

An EAGLE-2 tree (drafter/eagle/tree.py) expands several nodes per depth. Node ``c`` at depth
``d`` below a context of ``L`` tokens is the head entry at position ``L - 2 + d`` that reads
its parent's predicted state and its own token; it attends to the request's committed head
entries (positions ``< L - 1``, :class:`~drafter.eagle.head_kv.HeadKV`), to the entries of its
ancestors in the tree and to itself, never to its siblings or cousins: the mask SpecInfer's
tree attention uses (and SGLang's EAGLE draft stage, per depth). Tree entries live in a
:class:`TreeKV` beside the request's KV, which they never change; the proposer copies the
entries of the path it keeps (branch 0) into the KV afterwards (:meth:`TreeKV.entries`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specmesh.drafter.eagle.head import EagleHead
from specmesh.drafter.eagle.head_kv import HeadKV


class TreeKV:
    """The tree entries of one request's draft tree: per layer keys/values ``[nkv, T, hd]``
    of the ``T`` entries run so far and ``anc`` bool ``[T, T]`` (row i: the entries entry i
    attends to among them: its ancestors and itself), over the first ``past`` entries of
    ``kv`` (those before the tree's first position)."""

    def __init__(self, kv: HeadKV, past: int) -> None:
        if not 0 <= past <= kv.length:
            raise ValueError(f"tree over {past} entries of a head KV holding {kv.length}")
        self.kv, self.past = kv, past
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.anc = torch.zeros((0, 0), dtype=torch.bool)

    def __len__(self) -> int:
        return self.anc.shape[0]

    def entries(self, idx: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer the keys and values ``[nkv, len(idx), hd]`` of tree entries ``idx``."""
        ix = torch.tensor(idx, dtype=torch.long)
        return ([k[:, ix] for k in self.keys], [v[:, ix] for v in self.values])


@torch.inference_mode()
def tree_level(head: EagleHead, tree: TreeKV, features: torch.Tensor,
               next_tokens: torch.Tensor, positions: torch.Tensor,
               parents: list[int], step: int = 0) -> torch.Tensor:
    """Run ``m`` tree entries of one depth in one forward and append them to ``tree``.

    Args:
        head: the EAGLE head.
        tree: the request's tree entries so far.
        features: ``[m, d]`` the state each entry reads (its parent's predicted state).
        next_tokens: LongTensor ``[m]``, each entry's own token (target ids).
        positions: LongTensor ``[m]`` absolute positions (RoPE).
        parents: per entry the tree entry of its parent (-1: none, a depth-1 node).
        step: the head's module to run (drafter/eagle/steps.py), ``tree`` over its KV.

    Returns:
        predicted states ``[m, d]``; row i's logits are the distribution of entry i's
        children. Each row equals what :meth:`EagleHead.extend` gives that entry on a KV
        holding the ``past`` entries and then its ancestors' entries.

    Raises:
        ValueError: a parent that is not an earlier tree entry, or sizes that differ.
    """
    return tree_level_many(head, [(tree, features, next_tokens, positions, parents)], step)[0]


@torch.inference_mode()
def tree_level_many(head: EagleHead, items: list[tuple[TreeKV, torch.Tensor, torch.Tensor,
                                                       torch.Tensor, list[int]]],
                    step: int = 0) -> list[torch.Tensor]:
    """:func:`tree_level` for several requests' trees at once, ``items`` its arguments
    ``(tree, features, next_tokens, positions, parents)`` per request (distinct trees): the
    products run once over every item's rows (the head's weights read once per depth, as
    :meth:`EagleHead.extend_many` does for chains), attention per item over its own KV and
    tree. Each item's result is the one it gets alone (row-invariant products). ``step``:
    the module to run (every tree over that module's KV).

    Raises:
        ValueError: as :func:`tree_level`, or a tree listed twice.
    """
    if len({id(it[0]) for it in items}) != len(items):
        raise ValueError("tree_level_many: a tree is listed twice")
    if not items:
        return []
    masks, sizes = [], []
    for tree, features, next_tokens, positions, parents in items:
        m, T = int(features.shape[0]), len(tree)
        if next_tokens.shape != (m,) or positions.shape != (m,) or len(parents) != m:
            raise ValueError(f"tree level of {m} states, {tuple(next_tokens.shape)} tokens, "
                             f"{tuple(positions.shape)} positions, {len(parents)} parents")
        if any(not -1 <= p < T for p in parents):
            raise ValueError(f"tree parents {parents} outside the {T} entries run so far")
        own = torch.zeros((m, T), dtype=torch.bool, device=features.device)
        for i, p in enumerate(parents):
            if p >= 0:
                own[i] = tree.anc[p]
        masks.append(own)
        sizes.append(m)
    x, cos, sin = head._entry_inputs([it[1] for it in items], [it[2] for it in items],
                                     torch.cat([it[3] for it in items]), step)
    first = [not it[0].keys for it in items]
    _, layers, norm = head.step_parts(step)
    for li, layer in enumerate(layers):
        q, k, v = layer.qkv(x, cos, sin)  # [nh, sum m, hd], [nkv, sum m, hd]
        parts, lo = [], 0
        for (tree, _, _, _, _), own, m, new in zip(items, masks, sizes, first):
            kk, vv = k[:, lo:lo + m], v[:, lo:lo + m]
            if new:
                tree.keys.append(kk)
                tree.values.append(vv)
            else:
                tree.keys[li] = torch.cat([tree.keys[li], kk], dim=1)
                tree.values[li] = torch.cat([tree.values[li], vv], dim=1)
            bufs = tree.kv.key_buffers, tree.kv.value_buffers
            past_k = bufs[0][li][:, :tree.past] if bufs[0] else kk[:, :0]
            past_v = bufs[1][li][:, :tree.past] if bufs[1] else vv[:, :0]
            mask = torch.cat([torch.ones((m, tree.past), dtype=torch.bool, device=x.device),
                              own, torch.eye(m, dtype=torch.bool, device=x.device)], dim=1)
            parts.append(F.scaled_dot_product_attention(
                q[:, lo:lo + m], torch.cat([past_k, tree.keys[li]], dim=1),
                torch.cat([past_v, tree.values[li]], dim=1), attn_mask=mask,
                enable_gqa=layer.nh != layer.nkv))
            lo += m
        x = layer.finish(x, torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
    for (tree, _, _, _, _), own, m in zip(items, masks, sizes):
        T = len(tree)
        anc = torch.zeros((T + m, T + m), dtype=torch.bool, device=x.device)
        anc[:T, :T] = tree.anc
        anc[T:, :T] = own
        anc[T:, T:] = torch.eye(m, dtype=torch.bool, device=x.device)
        tree.anc = anc
    return list(norm(x).split(sizes))


__all__ = ["TreeKV", "tree_level", "tree_level_many"]
