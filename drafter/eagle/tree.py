"""EAGLE-2 draft trees: expand the likeliest nodes per depth, keep the likeliest nodes overall.

Li et al., EAGLE-2 (arXiv 2406.16858), as SGLang runs it (``--speculative-eagle-topk``,
``--speculative-num-draft-tokens``): a node's score is its *cumulative* draft log-probability
(the sum of the head's log-probabilities along its path from the context). Depth 1 holds the
``topk`` likeliest tokens after the context. At each further depth the ``topk`` best-scored
nodes of the previous depth (the frontier) are expanded by one head forward, each giving its
``topk`` likeliest children; of those ``topk * topk`` children the ``topk`` best-scored form
the next frontier. Finally every node generated is reranked by score and the best
``max_nodes`` are kept. A child's score is at most its parent's, and ties go to the node made
first (a parent is made before its children), so the kept nodes always form a tree: every
kept node's parent is kept.

The output numbering is DraftTailStream's (``parents[j] < j``, -1: the context's last token):
nodes by depth, and within a depth branch 0 first, then by score. Branch 0 (each node's first
child, the path the drafter continues as chains) is the path to the best-scored node of the
deepest depth kept. Pure torch over score rows: the head's forwards are the caller's
(drafter/proposers/eagle.py, drafter/eagle/head_tree.py).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch


@dataclass
class TreeNode:
    """One generated node: draft-vocabulary index ``draft_id``, ``parent`` (index among the
    generated nodes, -1: the context), ``depth`` (1: after the context), cumulative
    log-probability ``score`` and ``logp`` (its own log-probability under its parent's row);
    ``expanded``: the index of its head entry when it was expanded (its children exist),
    else -1."""

    draft_id: int
    parent: int
    depth: int
    score: float
    logp: float
    expanded: int = -1
    #: sampled trees (drafter/eagle/sampled_tree.py): the parent's row (its index in the
    #: children maker's ``rows``) and the node's place in its siblings' draw order
    row: int = -1
    rank: int = 0


#: ``children(parent, parent_node, depth, row, topk)``: the children of node ``parent`` (-1
#: and None: the context) from its ``row``, best first
Children = Callable[[int, "TreeNode | None", int, torch.Tensor, int], list[TreeNode]]


def top_children(parent: int, parent_node: TreeNode | None, depth: int, row: torch.Tensor,
                 topk: int) -> list[TreeNode]:
    """EAGLE-2's children: the ``topk`` likeliest of the log-probability ``row``, best first
    (ties: the lower draft id), scored by cumulative log-probability."""
    base = 0.0 if parent_node is None else parent_node.score
    k = min(topk, row.shape[0])
    top = row.topk(k)
    out = [TreeNode(int(i), parent, depth, base + float(v), float(v))
           for v, i in zip(top.values.tolist(), top.indices.tolist())]
    out.sort(key=lambda n: (-n.score, n.draft_id))
    return out


def grow_tree(root_row: torch.Tensor,
              expand: Callable[[list[int], list[TreeNode]], torch.Tensor],
              topk: int, depth: int, max_nodes: int,
              children: Children = top_children) -> list[TreeNode]:
    """Generate the nodes of an EAGLE-2 tree (module docstring), before the final rerank:
    :func:`grow_tree_steps` with each frontier's rows from ``expand``.

    Args:
        root_row: float ``[vocab]`` the row of the token after the context: log-probabilities
            for :func:`top_children`, what ``children`` reads otherwise.
        expand: called once per depth ``2 .. depth`` with the frontier (indices into the
            list of nodes so far, and that list); returns their rows ``[len(frontier),
            vocab]``. It may set ``node.expanded``.
        topk, depth, max_nodes, children: as :func:`grow_tree_steps`.

    Returns:
        every generated node, in the order made (parents before children).

    Raises:
        ValueError: ``topk``, ``depth`` or ``max_nodes`` below 1.
    """
    steps = grow_tree_steps(root_row, topk, depth, max_nodes, children)
    try:
        frontier, nodes = next(steps)
        while True:
            frontier, nodes = steps.send(expand(frontier, nodes))
    except StopIteration as done:
        return done.value


def grow_tree_steps(root_row: torch.Tensor, topk: int, depth: int, max_nodes: int,
                    children: Children = top_children,
                    ) -> Generator[tuple[list[int], list[TreeNode]], torch.Tensor,
                                   list[TreeNode]]:
    """The nodes of an EAGLE-2 tree as a generator, so that several requests' trees advance
    in lockstep, one batched head forward per depth for all of them
    (drafter/eagle/tree_draft.py): it yields ``(frontier, nodes)`` for each depth ``2 ..
    depth`` it expands (the frontier's indices into the nodes so far) and takes the
    frontier's rows ``[len(frontier), vocab]`` back through ``send``; its return value (the
    ``StopIteration``'s) is every generated node, in the order made.

    Args:
        root_row: as :func:`grow_tree`.
        topk: children per expanded node and nodes expanded per depth (>= 1).
        depth: deepest node (>= 1).
        max_nodes: nodes kept in the end (>= 1); depths that cannot reach the kept set are
            not expanded (the ``max_nodes``-th best score is known after each depth).
        children: makes a node's children from its row, scored so that none outscores its
            parent (:func:`top_children`; a sampled tree's, drafter/eagle/sampled_tree.py).

    Raises:
        ValueError: ``topk``, ``depth`` or ``max_nodes`` below 1 (on the first ``next``).
    """
    if topk < 1 or depth < 1 or max_nodes < 1:
        raise ValueError(f"need topk, depth and max_nodes >= 1, got {topk}, {depth}, "
                         f"{max_nodes}")
    nodes = children(-1, None, 1, root_row, topk)
    frontier = list(range(len(nodes)))
    for d in range(2, depth + 1):
        if not frontier or _kept_cutoff(nodes, max_nodes) >= nodes[frontier[0]].score:
            break  # no child of the frontier can outscore the nodes already kept
        rows = yield frontier, nodes
        made = []
        for f, row in zip(frontier, rows):
            made += children(f, nodes[f], d, row, topk)
        lo = len(nodes)
        nodes += made
        frontier = sorted(range(lo, len(nodes)), key=lambda i: (-nodes[i].score, i))[:topk]
    return nodes


def _kept_cutoff(nodes: list[TreeNode], max_nodes: int) -> float:
    """The ``max_nodes``-th best score so far (-inf with fewer nodes): a later node (whose
    score is at most its parent's, and which ranks after every node made before it at equal
    score) is kept only when its parent's score is above it."""
    if len(nodes) < max_nodes:
        return float("-inf")
    return sorted((n.score for n in nodes), reverse=True)[max_nodes - 1]


def select_tree(nodes: list[TreeNode], max_nodes: int) -> list[int]:
    """The ``max_nodes`` best-scored of ``nodes`` (ties: made first), numbered as sent
    (module docstring): returns their indices into ``nodes`` in output order."""
    kept = set(sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, i))[:max_nodes])
    deepest = max(nodes[i].depth for i in kept)
    best = min((i for i in kept if nodes[i].depth == deepest), key=lambda i: (-nodes[i].score, i))
    branch0 = set()
    while best >= 0:
        branch0.add(best)
        best = nodes[best].parent
    return sorted(kept, key=lambda i: (nodes[i].depth, i not in branch0, -nodes[i].score, i))


def tree_arrays(nodes: list[TreeNode], order: list[int]) -> list[int]:
    """``parents`` of the nodes ``order`` (as :func:`select_tree` returns them) renumbered:
    ``parents[j] < j``, -1 for a child of the context."""
    where = {i: j for j, i in enumerate(order)}
    return [-1 if nodes[i].parent < 0 else where[nodes[i].parent] for i in order]


__all__ = ["Children", "TreeNode", "grow_tree", "grow_tree_steps", "select_tree",
           "top_children", "tree_arrays"]
