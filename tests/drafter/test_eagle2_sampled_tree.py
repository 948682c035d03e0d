"""Sampled EAGLE-2 trees (drafter/eagle/sampled_tree.py) verified by SpecInfer's multi-draft
rejection with their rows (kernels/tree_rejection_sample.py, the tree rule's sampled path):
the tokens emitted, continued by the target, follow the target (chi-square, the test the
tree kernels use), with trees pruned by the perturbed-score rerank (fewer nodes kept than
generated, so which nodes are kept matters), and each node's row is the distribution it was
drawn from (its parent's row without its earlier siblings)."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest
import torch

from specmesh.drafter.eagle.sampled_tree import SampledChildren, sibling_row, truncated_scores
from specmesh.drafter.eagle.tree import grow_tree, select_tree, tree_arrays
from specmesh.kernels.tree_rejection_sample import (tree_rejection_sample_noise,
                                                    tree_rejection_sample_ref)

_spec = importlib.util.spec_from_file_location(
    "_chi2", Path(__file__).resolve().parents[1] / "kernels" / "_chi2.py")
_chi2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_chi2)
chi2_pvalue = _chi2.chi2_pvalue

P_MIN = 1e-3
VOCAB, DEPTH = 4, 3
#: TARGET[d][prev]: the target's distribution of the token at depth d after token ``prev``
TARGET = [
    torch.tensor([[0.40, 0.30, 0.20, 0.10]] * VOCAB),
    torch.tensor([[0.10, 0.20, 0.30, 0.40], [0.50, 0.10, 0.10, 0.30],
                  [0.25, 0.25, 0.25, 0.25], [0.05, 0.05, 0.45, 0.45]]),
    torch.tensor([[0.70, 0.10, 0.10, 0.10], [0.10, 0.20, 0.60, 0.10],
                  [0.30, 0.40, 0.20, 0.10], [0.20, 0.20, 0.20, 0.40]]),
    torch.tensor([[0.10, 0.60, 0.20, 0.10], [0.40, 0.40, 0.10, 0.10],
                  [0.25, 0.25, 0.40, 0.10], [0.30, 0.10, 0.30, 0.30]]),
]
#: DRAFT[d][prev]: the head's (processed) distribution of the token at depth d + 1
DRAFT = [
    torch.tensor([[0.10, 0.20, 0.30, 0.40]] * VOCAB),
    torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.40, 0.40, 0.10, 0.10],
                  [0.10, 0.10, 0.40, 0.40], [0.30, 0.00, 0.30, 0.40]]),
    torch.tensor([[0.40, 0.20, 0.20, 0.20], [0.10, 0.30, 0.30, 0.30],
                  [0.20, 0.50, 0.20, 0.10], [0.60, 0.10, 0.00, 0.30]]),
]


def _tree(gen, topk, max_nodes):
    """One sampled tree: (tokens, parents, rows [n, V], depths)."""
    children = SampledChildren(gen)

    def expand(frontier, nodes):
        return torch.stack([DRAFT[nodes[f].depth][nodes[f].draft_id].double()
                            for f in frontier])

    nodes = grow_tree(DRAFT[0][0].double(), expand, topk, DEPTH, max_nodes, children)
    order = select_tree(nodes, max_nodes)
    rows = torch.stack([sibling_row(nodes, i, children.rows) for i in order])
    return ([nodes[i].draft_id for i in order], tree_arrays(nodes, order), rows,
            [nodes[i].depth for i in order], len(nodes))


def _verify(trees, gen):
    tokens = torch.tensor([t for tr in trees for t in tr[0]], dtype=torch.long)
    parents = torch.tensor([p for tr in trees for p in tr[1]], dtype=torch.long)
    draft = torch.cat([tr[2] for tr in trees]).double()
    target = []
    for tr in trees:
        target.append(TARGET[0][0])
        target += [TARGET[d][t] for t, d in zip(tr[0], tr[3])]
    target = torch.stack(target).double()
    cu = torch.tensor([len(tr[0]) for tr in trees]).cumsum(0)
    uniform, noise = tree_rejection_sample_noise(cu, VOCAB, torch.float64, gen)
    return tree_rejection_sample_ref(tokens, cu, parents, draft, target, uniform, noise,
                                     max_depth=DEPTH)


def _exact(positions):
    probs = {}
    for z in itertools.product(range(VOCAB), repeat=DEPTH + 1):
        pr = float(TARGET[0][0, z[0]])
        for d in range(1, DEPTH + 1):
            pr *= float(TARGET[d][z[d - 1], z[d]])
        key = tuple(z[i] for i in positions)
        probs[key] = probs.get(key, 0.0) + pr
    return probs


@pytest.mark.parametrize("topk,max_nodes", [(2, 4), (3, 6)])
def test_sampled_trees_with_their_rows_emit_the_targets_distribution(topk, max_nodes):
    gen = torch.Generator().manual_seed(11 * topk + max_nodes)
    n = 8_000
    trees = [_tree(gen, topk, max_nodes) for _ in range(n)]
    assert any(tr[4] > len(tr[0]) for tr in trees)  # the rerank pruned generated nodes
    assert all(len(tr[0]) <= max_nodes for tr in trees)
    out, accept, nodes = _verify(trees, gen)
    seq = out.clone()
    for d in range(1, DEPTH + 1):  # continue each emitted prefix with the target
        todo = accept < d
        seq[todo, d] = torch.multinomial(TARGET[d][seq[todo, d - 1]].double(), 1,
                                         generator=gen)[:, 0]
    for positions in ((0,), (1,), (2,), (0, 1), (1, 2), (0, 1, 2)):
        exact = _exact(positions)
        keys = sorted(exact)
        index = {k: i for i, k in enumerate(keys)}
        counts = [0] * len(keys)
        for row in seq[:, list(positions)].tolist():
            counts[index[tuple(row)]] += 1
        p = chi2_pvalue(counts, [exact[k] for k in keys])
        assert p > P_MIN, (topk, max_nodes, positions, p)
    assert (accept >= 2).any() and (nodes[:, 0] > 0).any()  # deep, and through siblings


def test_sibling_rows_are_draws_without_replacement():
    """Node i of a sibling group is sent with its parent's row minus the earlier siblings;
    the first child of every node scores its parent's score (branch 0 scores 0)."""
    gen = torch.Generator().manual_seed(2)
    children = SampledChildren(gen)
    row = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    kids = children(-1, None, 1, row, 3)
    assert [k.rank for k in kids] == [0, 1, 2] and len({k.draft_id for k in kids}) == 3
    assert kids[0].score == 0.0 and kids[1].score <= 0.0 and kids[2].score <= kids[1].score
    r2 = sibling_row(kids, 2, children.rows)
    want = row.float().clone()
    want[[kids[0].draft_id, kids[1].draft_id]] = 0
    torch.testing.assert_close(r2, want / want.sum())
    # a zero-probability token is never drawn
    zero = children(-1, None, 1, torch.tensor([0.5, 0.0, 0.5, 0.0], dtype=torch.float64), 4)
    assert sorted(k.draft_id for k in zero) == [0, 2]


def test_truncated_scores_match_the_direct_formula():
    g = torch.tensor([-0.3, -1.2, -4.0], dtype=torch.float64)
    got = truncated_scores(-0.7, g)
    want = -torch.log(torch.exp(torch.tensor(0.7, dtype=torch.float64)) - torch.exp(-g[0])
                      + torch.exp(-g))
    torch.testing.assert_close(got, want)
    assert float(got[0]) == -0.7
