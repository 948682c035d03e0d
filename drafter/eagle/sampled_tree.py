"""Sampled EAGLE-2 trees for unseeded sampled requests, verified with their draft
probabilities (SpecInfer's multi-draft rejection, kernels/tree_rejection_sample.py).

That rule is exact when each node was *drawn* from the row it is sent with, given its parent
and its earlier siblings, and when whether a node is in the tree does not depend on its own
token beyond that. EAGLE-2's deterministic top-k children (drafter/eagle/tree.py) are not
drawn from anything, so they are verified one-hot; here instead:

- a node's children are drawn *without replacement* from the node's row ``q`` (the head's
  distribution processed with the request's temperature, top-k, top-p, min-p) by the
  Gumbel-top-k trick: ``phi_x = log q(x) + g_x`` with ``g_x`` i.i.d. Gumbel(0, 1), children
  the ``topk`` largest ``phi``, in that order. Sibling ``i`` is then a draw from ``q`` with
  siblings ``0 .. i-1`` removed and renormalized: the row it is sent with
  (:func:`sibling_row`), so the rule's residual after each rejected sibling is the one that
  sibling's own row leaves;
- nodes are ranked by their *perturbed* score, Kool et al.'s stochastic beam search (arXiv
  1903.06059): the root scores 0, and child ``x`` of a node scoring ``G`` with path
  log-probability ``lp`` scores ``-log(exp(-G) - exp(-Z) + exp(-Gt_x))`` with ``Gt_x = lp +
  phi_x`` and ``Z = max Gt``: at most its parent's score (the first-drawn child equals it), so
  the per-depth expansion and the final rerank of EAGLE-2 (:func:`~drafter.eagle.tree.grow_tree`,
  :func:`~drafter.eagle.tree.select_tree`) keep a tree. Given the siblings drawn before it, a
  child's perturbed score is independent of its token (the max and the argmax of Gumbel
  perturbations are independent, also under a common truncation), so whether a node is kept
  never leans on its token: the rule stays exact. tests/drafter/test_eagle2_sampled_tree.py
  checks it with a chi-square test of the tokens the rule emits.

Branch 0 (the first-drawn child of every node, all scoring 0) is a chain of samples of ``q``,
which the drafter continues as sampled chains.
"""

from __future__ import annotations

import torch

from specmesh.drafter.eagle.tree import TreeNode


class SampledChildren:
    """The ``children`` maker of :func:`~drafter.eagle.tree.grow_tree` for a sampled tree:
    rows are probabilities (float ``[V]``, summing to 1), kept in :attr:`rows` (a node's
    ``row`` is its parent's index there); randomness from ``generator`` (None: torch's
    default)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator
        self.rows: list[torch.Tensor] = []

    def __call__(self, parent: int, parent_node: TreeNode | None, depth: int,
                 row: torch.Tensor, topk: int) -> list[TreeNode]:
        row_id = len(self.rows)
        self.rows.append(row)
        logq = row.double().log()  # -inf where q is 0: never drawn
        gumbel = -torch.empty_like(logq).exponential_(generator=self.generator).log()
        phi = logq + gumbel
        k = min(topk, int((row > 0).sum()))
        if k == 0:
            return []
        top = phi.topk(k)
        g_parent = 0.0 if parent_node is None else parent_node.score
        lp_parent = 0.0 if parent_node is None else parent_node.logp
        g_tilde = lp_parent + top.values  # float64 [k], descending
        scores = truncated_scores(g_parent, g_tilde)
        ids = top.indices.tolist()
        return [TreeNode(x, parent, depth, float(scores[i]), lp_parent + float(logq[x]),
                         row=row_id, rank=i) for i, x in enumerate(ids)]


def truncated_scores(g_parent: float, g_tilde: torch.Tensor) -> torch.Tensor:
    """Stochastic beam search's children scores: ``-log(exp(-G) - exp(-Z) + exp(-Gt))`` for
    the perturbed ``g_tilde`` (float64, descending; ``Z = g_tilde[0]``) under a parent
    scoring ``G = g_parent``, computed as ``G - softplus(u + log(-expm1(w - u)))`` with ``u =
    G - Gt``, ``w = G - Z`` (no overflow; the first child scores ``G`` exactly)."""
    u = g_parent - g_tilde
    w = g_parent - g_tilde[0]
    a = u + torch.log(-torch.expm1(w - u))
    return g_parent - torch.logaddexp(torch.zeros_like(a), a)


def sibling_row(nodes: list[TreeNode], index: int, rows: list[torch.Tensor]) -> torch.Tensor:
    """The row node ``index`` was drawn from: its parent's row without the siblings drawn
    before it, renormalized (float32 ``[V]``)."""
    node = nodes[index]
    row = rows[node.row].to(torch.float32).clone()
    earlier = [n.draft_id for n in nodes
               if n.row == node.row and n.parent == node.parent and n.rank < node.rank]
    if earlier:
        row[torch.tensor(earlier, dtype=torch.long)] = 0.0
    return row / row.sum()


__all__ = ["SampledChildren", "sibling_row", "truncated_scores"]
