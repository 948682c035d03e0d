"""Token-tree verify chunks (engine/token_tree.py): the tree mask in the ragged forward and
the KV compaction of an accepted path (float64 tiny Llama)."""

from __future__ import annotations

import pytest
import torch
from helpers.models import tiny_llama

from specmesh.engine.kv_cache import KVCache
from specmesh.engine.runner import ModelRunner, SeqChunk
from specmesh.engine.token_tree import ancestry_mask, chunk_positions, node_depths, path_to

BLOCK = 4
PROMPT = [3, 17, 4, 99, 25, 8]  # 6 tokens: the chunk (positions 6 ..) crosses the block at 8
ROOT = 41
#         0   1   2   3   4   5   6   7   8
PARENTS = [-1, -1, 0, 1, 1, 2, -1, 5, 3]
NODES = [10, 11, 12, 13, 14, 15, 16, 17, 18]
TOL = 1e-10


@pytest.fixture(scope="module")
def model():
    _, ours, config = tiny_llama(seed=3, dtype=torch.float64)
    return ours, config


def _runner(model, num_blocks=16):
    ours, config = model
    return ModelRunner(ours, config, KVCache(config, num_blocks, BLOCK, torch.float64))


def _prefilled(model, table):
    runner = _runner(model)
    runner.prefill(PROMPT, table)
    return runner


def _leaves(parents):
    return [j for j in range(len(parents)) if j not in parents]


def test_token_tree_helpers():
    assert node_depths(PARENTS) == [1, 1, 2, 2, 2, 3, 1, 4, 3]
    assert chunk_positions(6, [-1, 0]) == [6, 7, 8]
    assert path_to(PARENTS, 7) == [0, 2, 5, 7] and path_to(PARENTS, -1) == []
    m = ancestry_mask([-1, -1, 0])
    assert m.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert torch.equal(ancestry_mask([-1, 0, 1]), torch.ones(4, 4, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="parent"):
        node_depths([-1, 1])


def test_tree_chunk_equals_each_path_run_as_a_chain(model):
    table = [5, 2, 9, 7]  # shuffled blocks; the chunk crosses the boundary at position 8
    runner = _prefilled(model, table)
    (tree,) = runner.forward([SeqChunk([ROOT] + NODES, len(PROMPT), table, PARENTS)])
    assert tree.shape == (1 + len(NODES), model[1].vocab_size)
    checked = set()
    for leaf in _leaves(PARENTS):
        path = path_to(PARENTS, leaf)
        chain_runner = _prefilled(model, table)
        (chain,) = chain_runner.forward(
            [SeqChunk([ROOT] + [NODES[j] for j in path], len(PROMPT), table)])
        rows = [0] + [1 + j for j in path]
        torch.testing.assert_close(tree[rows], chain, atol=TOL, rtol=0)
        checked.update(rows)
    assert checked == set(range(1 + len(NODES)))
    # a wrong mask would not pass: the same tokens as a plain chunk differ on branch rows
    (plain,) = _prefilled(model, table).forward([SeqChunk([ROOT] + NODES, len(PROMPT), table)])
    assert (plain[2] - tree[2]).abs().max() > 1e-3


def test_chains_and_batch_neighbours_are_bit_identical(model):
    table_a, table_b = [0, 1, 2, 3], [4, 5, 6, 7]
    chain = SeqChunk([ROOT, 10, 12, 15], len(PROMPT), table_a)
    tree = SeqChunk([ROOT] + NODES, len(PROMPT), table_b, PARENTS)
    runner = _runner(model)
    runner.prefill(PROMPT, table_a)
    runner.prefill(PROMPT, table_b)
    (alone,) = runner.forward([chain])
    (as_chain_parents,) = runner.forward([SeqChunk(chain.token_ids, chain.start_pos, table_a,
                                                   [-1, 0, 1])])
    mixed, _ = runner.forward([chain, tree])
    assert torch.equal(as_chain_parents, alone)
    assert torch.equal(mixed, alone)


def test_compacted_path_continues_like_the_chain(model):
    """After accepting path 1 -> 4 (a second branch), copying its rows' KV to the positions
    right after the root makes the next step equal the chain run's next step."""
    table = [5, 2, 9, 7]
    path = [1, 4]
    runner = _prefilled(model, table)
    runner.forward([SeqChunk([ROOT] + NODES, len(PROMPT), table, PARENTS)])
    start = len(PROMPT)
    runner.kv_cache.copy_positions(table, [start + 1 + j for j in path],
                                   [start + 1 + i for i in range(len(path))])
    nxt = SeqChunk([77, 78], start + 1 + len(path), table)
    (after_tree,) = runner.forward([nxt])
    chain_runner = _prefilled(model, table)
    chain_runner.forward([SeqChunk([ROOT] + [NODES[j] for j in path], start, table)])
    (after_chain,) = chain_runner.forward([nxt])
    torch.testing.assert_close(after_tree, after_chain, atol=TOL, rtol=0)
    # without the compaction the next step reads the wrong branch's KV
    stale = _prefilled(model, table)
    stale.forward([SeqChunk([ROOT] + NODES, len(PROMPT), table, PARENTS)])
    (wrong,) = stale.forward([nxt])
    assert (wrong - after_chain).abs().max() > 1e-3


def test_copy_positions_errors(model):
    cache = _runner(model).kv_cache
    with pytest.raises(ValueError, match="destination"):
        cache.copy_positions([0], [1], [])
    with pytest.raises(ValueError, match="positions must lie"):
        cache.copy_positions([0], [1], [BLOCK])


@pytest.mark.parametrize("parents,match", [([-1, 0], "parents for"), ([0, -1, 0], "parent 0"),
                                           ([-1, 2, -1], "parent 2")])
def test_bad_parents_are_refused(model, parents, match):
    with pytest.raises(ValueError, match=match):
        _runner(model).forward([SeqChunk([ROOT, 1, 2, 3], 0, [0], parents)])
