"""Medusa's static tree (drafter/medusa/tree.py): chosen greedily from per-head accuracy by
rank with parents and lower-rank siblings first (branch 0 the top-1 chain), built from the
heads' candidates, cut by depth and nodes, and measured on held-out label ranks."""

import pytest

from specmesh.drafter.medusa.tree import (
    build_tree,
    chain_tree,
    check_tree,
    choose_tree,
    node_value,
    tree_acceptance,
)
from specmesh.engine.token_tree import check_parents, first_branch

ACC = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.05], [0.4, 0.1, 0.0]]


def test_choose_tree_adds_the_likeliest_admissible_node_each_time():
    tree = choose_tree(ACC, 6)
    # values: (0,) .6, (0,0) .3, (1,) .2, (0,1) .18, (0,0,0) .12, (2,) .1, (1,0) .1 ...
    assert tree == ((0,), (0, 0), (1,), (0, 1), (0, 0, 0), (2,))
    values = [node_value(p, ACC) for p in tree]
    assert values == sorted(values, reverse=True)
    assert check_tree(tree, 3) == tree
    assert choose_tree(ACC, 1) == ((0,),)


def test_a_node_of_value_zero_is_never_added_and_depth_is_bounded_by_the_heads():
    tree = choose_tree([[1.0, 0.0]], 5)
    assert tree == ((0,),)
    assert all(len(p) <= 3 for p in choose_tree(ACC, 40))
    assert len(choose_tree(ACC, 40)) < 40  # every admissible node of positive value
    with pytest.raises(ValueError):
        choose_tree(ACC, 0)


def test_lower_ranked_sibling_is_admitted_only_after_the_higher_one():
    # head 0's rank 1 is worth more than rank 0: still rank 0 first
    tree = choose_tree([[0.1, 0.8]], 2)
    assert tree == ((0,), (1,))


def test_check_tree_refuses_orphans_gaps_repeats_and_depth():
    with pytest.raises(ValueError, match="parent"):
        check_tree([(0, 0)], 3)
    with pytest.raises(ValueError, match="sibling"):
        check_tree([(1,)], 3)
    with pytest.raises(ValueError):
        check_tree([(0,), (0,)], 3)
    with pytest.raises(ValueError):
        check_tree([(0,), (0, 0)], 1)


def test_build_tree_maps_ranks_to_each_heads_candidates():
    top = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    tree = choose_tree(ACC, 6)
    tokens, parents = build_tree(top, tree, 3)
    assert tokens == [10, 20, 11, 21, 30, 12]
    assert parents == [-1, 0, -1, 0, 1, -1]
    check_parents(parents)
    assert first_branch(tokens, parents) == [10, 20, 30]  # branch 0: the top-1 chain
    assert build_tree(top, tree, 1) == ([10, 11, 12], [-1, -1, -1])  # depth cut
    assert build_tree(top, tree, 3, max_nodes=3) == ([10, 20, 11], [-1, 0, -1])
    # fewer heads left than the tree is deep (a state one position behind): cut there
    assert build_tree(top[1:], tree, 3) == ([20, 30, 21, 31, 22], [-1, 0, -1, 0, -1])
    # a rank past the candidates drops the node and its subtree
    assert build_tree([[10], [20]], ((0,), (1,), (1, 0), (0, 0)), 2) == ([10, 20], [-1, 0])


def test_chain_tree_and_tree_acceptance():
    assert chain_tree(3) == ((0,), (0, 0), (0, 0, 0))
    ranks = [[0, 0, 0], [1, 0, 5], [0, 1, -1], [2, 0, 0], [-1, 0, 0]]
    tree = ((0,), (0, 0), (1,), (0, 1), (0, 0, 0))
    # depth 1: rows 0, 1, 2; depth 2: rows 0 (0,0) and 2 (0,1) (row 1's (1,0) not a node);
    # depth 3: row 0
    assert tree_acceptance(ranks, tree) == [0.6, 0.4, 0.2]
    assert tree_acceptance(ranks, chain_tree(3)) == [0.4, 0.2, 0.2]
