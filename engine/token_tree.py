"""Token trees of tree verification (SpecInfer, arXiv 2305.09781): a verify chunk is
``[root] + nodes``, the root being the last committed token and node ``j``'s parent
``parents[j]`` (an index into the nodes, ``-1`` = the root, always ``< j``: a parent comes
before its children, as DraftTailStream.parents and kernels/tree_layout.py number them).

Chunk row 0 is the root, row ``1 + j`` node ``j``; the row's KV lands in the slot of chunk
position ``start_pos + row`` (rows are contiguous in the cache) while its RoPE position is
``start_pos + depth`` (the root has depth 0, a child of the root depth 1): the position the
token would have on its root-to-leaf path run as a plain chain. A chain is the tree whose
parents are ``[-1, 0, 1, ...]``.
"""

from __future__ import annotations

import torch


def check_parents(parents: list[int]) -> None:
    """Raises ValueError unless every ``parents[j]`` lies in ``[-1, j)``."""
    for j, p in enumerate(parents):
        if not -1 <= p < j:
            raise ValueError(f"tree node {j} has parent {p}; need -1 <= parent < {j}")


def is_chain(parents: list[int]) -> bool:
    """Whether ``parents`` is the chain ``[-1, 0, 1, ...]``."""
    return all(p == j - 1 for j, p in enumerate(parents))


def node_depths(parents: list[int]) -> list[int]:
    """Depth of each node, 1 for a child of the root (``parents`` validated first).

    Raises:
        ValueError: see :func:`check_parents`.
    """
    check_parents(parents)
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


def chunk_positions(start_pos: int, parents: list[int]) -> list[int]:
    """RoPE positions of the chunk rows ``[root] + nodes``: ``start_pos + depth``."""
    return [start_pos] + [start_pos + d for d in node_depths(parents)]


def ancestry_mask(parents: list[int]) -> torch.Tensor:
    """bool [1 + N, 1 + N] over the chunk rows: ``mask[i, c]`` = row ``c`` is row ``i`` or one
    of its ancestors (the root is everyone's). The lower triangle for a chain.

    Raises:
        ValueError: see :func:`check_parents`.
    """
    check_parents(parents)
    n = len(parents) + 1
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[0, 0] = True
    for j, p in enumerate(parents):
        mask[j + 1] = mask[p + 1]
        mask[j + 1, j + 1] = True
    return mask


def first_branch(tokens: list[int], parents: list[int]) -> list[int]:
    """Tokens of branch 0: from the root, always the lowest-numbered child (a drafter's own
    path in a tree it sent)."""
    first: dict[int, int] = {}
    for j, p in enumerate(parents):
        first.setdefault(p, j)
    out, node = [], first.get(-1)
    while node is not None:
        out.append(tokens[node])
        node = first.get(node)
    return out


def path_to(parents: list[int], node: int) -> list[int]:
    """Node indices from the root's child down to ``node`` (inclusive); [] for ``node == -1``."""
    path: list[int] = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


__all__ = ["ancestry_mask", "check_parents", "chunk_positions", "first_branch", "is_chain",
           "node_depths", "path_to"]
