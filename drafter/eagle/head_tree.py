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
               parents: list[int]) -> torch.Tensor:
    """Run ``m`` tree entries of one depth in one forward and append them to ``tree``.

    Args:
        head: the EAGLE head.
        tree: the request's tree entries so far.
        features: ``[m, d]`` the state each entry reads (its parent's predicted state).
        next_tokens: LongTensor ``[m]``, each entry's own token (target ids).
        positions: LongTensor ``[m]`` absolute positions (RoPE).
        parents: per entry the tree entry of its parent (-1: none, a depth-1 node).

    Returns:
        predicted states ``[m, d]``; row i's logits are the distribution of entry i's
        children. Each row equals what :meth:`EagleHead.extend` gives that entry on a KV
        holding the ``past`` entries and then its ancestors' entries.

    Raises:
        ValueError: a parent that is not an earlier tree entry, or sizes that differ.
    """
    m, T = int(features.shape[0]), len(tree)
    if next_tokens.shape != (m,) or positions.shape != (m,) or len(parents) != m:
        raise ValueError(f"tree level of {m} states, {tuple(next_tokens.shape)} tokens, "
                         f"{tuple(positions.shape)} positions, {len(parents)} parents")
    if any(not -1 <= p < T for p in parents):
        raise ValueError(f"tree parents {parents} outside the {T} entries run so far")
    device = features.device
    own = torch.zeros((m, T), dtype=torch.bool, device=device)
    for i, p in enumerate(parents):
        if p >= 0:
            own[i] = tree.anc[p]
    mask = torch.cat([torch.ones((m, tree.past), dtype=torch.bool, device=device), own,
                      torch.eye(m, dtype=torch.bool, device=device)], dim=1)
    x, cos, sin = head._entry_inputs([features], [next_tokens], positions)
    first = not tree.keys
    for li, layer in enumerate(head.layers):
        q, k, v = layer.qkv(x, cos, sin)  # [nh, m, hd], [nkv, m, hd]
        past_k = tree.kv.key_buffers[li][:, :tree.past] if tree.kv.key_buffers else k[:, :0]
        past_v = tree.kv.value_buffers[li][:, :tree.past] if tree.kv.value_buffers else v[:, :0]
        if first:
            tree.keys.append(k)
            tree.values.append(v)
        else:
            tree.keys[li] = torch.cat([tree.keys[li], k], dim=1)
            tree.values[li] = torch.cat([tree.values[li], v], dim=1)
        keys = torch.cat([past_k, tree.keys[li]], dim=1)
        vals = torch.cat([past_v, tree.values[li]], dim=1)
        attn = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask,
                                              enable_gqa=layer.nh != layer.nkv)
        x = layer.finish(x, attn)
    anc = torch.zeros((T + m, T + m), dtype=torch.bool, device=device)
    anc[:T, :T] = tree.anc
    anc[T:, :T] = own
    anc[T:, T:] = torch.eye(m, dtype=torch.bool, device=device)
    tree.anc = anc
    return head.norm(x)


__all__ = ["TreeKV", "tree_level"]
