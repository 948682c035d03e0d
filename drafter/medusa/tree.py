"""Medusa's static draft tree (arXiv 2401.10774, section 2.1.2 "tree attention"; the sparse
trees of FasterDecoding/Medusa ``medusa_choices.py``).

A node is a path of per-head ranks ``(r_0, ..., r_{d-1})``: the token at depth ``t + 1`` is
head t's rank-``r_t`` candidate, so the tree is a subset of the Cartesian product of the heads'
top-k. Which subset: :func:`choose_tree` adds, one node at a time, the node of highest
estimated acceptance, the product of the heads' held-out accuracies at those ranks (Medusa's
choice, which assumes the heads independent), among the nodes whose parent and lower-rank
sibling are in already. The order it adds them is the order the tree is sent in: parents before
children, and at every node the rank-0 child first, so branch 0 (engine/token_tree.py
``first_branch``) is the heads' top-1 chain, and a verifier that keeps only the first nodes
(decode/draft_tree.py ``pruned``) keeps the likeliest ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

Path = tuple[int, ...]


def node_value(path: Path, accuracy: Sequence[Sequence[float]]) -> float:
    """Estimated acceptance of the node ``path``: the product of ``accuracy[t][path[t]]``
    (0 for a rank or depth outside ``accuracy``)."""
    v = 1.0
    for t, r in enumerate(path):
        if t >= len(accuracy) or r >= len(accuracy[t]):
            return 0.0
        v *= accuracy[t][r]
    return v


def choose_tree(accuracy: Sequence[Sequence[float]], max_nodes: int) -> tuple[Path, ...]:
    """The static tree of at most ``max_nodes`` nodes that greedily maximises the sum of
    :func:`node_value` (the expected accepted drafts per step under independence).

    Args:
        accuracy: ``accuracy[i][j]`` the held-out share of positions where head i's rank-j
            candidate is the target's token; K rows of k ranks each.
        max_nodes: nodes of the tree (>= 1).

    Returns:
        The node paths in the order chosen (see the module docstring); nodes of estimated
        value 0 are never added, so the tree may be smaller.

    Raises:
        ValueError: ``max_nodes`` < 1 or an empty ``accuracy``.
    """
    if max_nodes < 1 or not accuracy or not accuracy[0]:
        raise ValueError(f"need max_nodes >= 1 and a non-empty accuracy table, got "
                         f"{max_nodes}, {accuracy!r}")
    chosen: list[Path] = []
    frontier = [(-node_value((0,), accuracy), 1, (0,))]
    while frontier and len(chosen) < max_nodes:
        neg, _, path = heapq.heappop(frontier)
        if -neg <= 0.0:
            break
        chosen.append(path)
        sibling = path[:-1] + (path[-1] + 1,)
        child = path + (0,)
        for nxt in (sibling, child):
            if len(nxt) <= len(accuracy) and nxt[-1] < len(accuracy[len(nxt) - 1]):
                heapq.heappush(frontier, (-node_value(nxt, accuracy), len(nxt), nxt))
    return tuple(chosen)


def chain_tree(depth: int) -> tuple[Path, ...]:
    """The top-1 chain of ``depth`` nodes as a tree: ``(0,), (0, 0), ...``."""
    return tuple((0,) * d for d in range(1, depth + 1))


def check_tree(tree: Sequence[Sequence[int]], num_heads: int) -> tuple[Path, ...]:
    """``tree`` as tuples, checked: every path non-empty, at most ``num_heads`` deep, ranks
    >= 0, no path twice, each node's parent and lower-rank sibling before it.

    Raises:
        ValueError: naming the first node that breaks a rule.
    """
    seen: set[Path] = set()
    out = []
    for j, p in enumerate(tree):
        path = tuple(int(r) for r in p)
        if not path or len(path) > num_heads or min(path) < 0 or path in seen:
            raise ValueError(f"tree node {j} {list(path)}: a path must be 1..{num_heads} ranks "
                             f">= 0, given once")
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"tree node {j} {list(path)} comes before its parent")
        if path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in seen:
            raise ValueError(f"tree node {j} {list(path)} comes before its lower-rank sibling")
        seen.add(path)
        out.append(path)
    return tuple(out)


def build_tree(top: Sequence[Sequence[int]], tree: Sequence[Path], max_depth: int,
               max_nodes: int | None = None) -> tuple[list[int], list[int]]:
    """The token tree of one draft step: ``(draft_token_ids, parents)`` as DraftTailStream
    carries it (``parents[j] < j``, -1: the context's last token).

    Args:
        top: ``top[t]`` the candidates (best first) of the head drafting depth ``t + 1``.
        tree: node paths (:func:`choose_tree` / :func:`check_tree` order).
        max_depth: deepest node kept (the drafts asked for; at most ``len(top)``).
        max_nodes: most nodes kept (None: all), the first ones of ``tree``.
    """
    depth = min(max_depth, len(top))
    index: dict[Path, int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    for path in tree:
        if max_nodes is not None and len(tokens) >= max_nodes:
            break
        d = len(path)
        if d > depth or path[-1] >= len(top[d - 1]):
            continue
        if d > 1 and path[:-1] not in index:
            continue
        parent = index[path[:-1]] if d > 1 else -1
        index[path] = len(tokens)
        tokens.append(int(top[d - 1][path[-1]]))
        parents.append(parent)
    return tokens, parents


def tree_acceptance(label_ranks: Sequence[Sequence[int]], tree: Sequence[Path]) -> list[float]:
    """Acceptance per depth of ``tree`` measured on held-out positions: ``label_ranks[n][t]``
    is the rank of the target's true token among head t's candidates at position n (-1: not
    among them, or no token there). A step accepts depth ``d`` when the path of the first ``d``
    ranks is a node of the tree (greedy tree verification). Returns the share of positions
    accepting at least 1, 2, ... ``max depth`` drafts (their sum: mean accepted drafts per
    step)."""
    nodes = set(tree)
    depth = max((len(p) for p in tree), default=0)
    hits = [0] * depth
    for ranks in label_ranks:
        path: Path = ()
        for t in range(min(depth, len(ranks))):
            if ranks[t] < 0:
                break
            path = path + (int(ranks[t]),)
            if path not in nodes:
                break
            hits[t] += 1
    n = max(len(label_ranks), 1)
    return [h / n for h in hits]
