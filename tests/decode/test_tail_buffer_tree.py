"""Draft trees on the verifier: decode/draft_tree.py and the tree rule of the tail buffer."""

from __future__ import annotations

import pytest

from specmesh.decode.draft_tree import DraftTree
from specmesh.decode.tail_buffer import TailBuffer

# branch 0: 5 6 7, branch 1: 5 8, branch 2: 9 10
TOKENS = [5, 6, 7, 8, 9, 10]
PARENTS = [-1, 0, 1, 0, -1, 4]


def test_trie_merges_duplicate_siblings_and_keeps_order():
    t = DraftTree.from_segment([5, 6, 5, 7], [-1, 0, -1, 2])
    assert t.tokens == [5, 6, 7] and t.parents == [-1, 0, 0]
    assert t.first_path() == [5, 6]
    with pytest.raises(ValueError, match="parent"):
        DraftTree.from_segment([1, 2], [-1, 1])


def test_plan_puts_the_chain_first_and_caps_depth_and_nodes():
    t = DraftTree.from_segment(TOKENS, PARENTS)
    assert t.plan([5, 6, 7, 11], 4, 100) == ([5, 6, 7, 11, 8, 9, 10], [-1, 0, 1, 2, 0, -1, 5])
    assert t.plan([5, 6, 7], 2, 100) == ([5, 6, 8, 9, 10], [-1, 0, 0, -1, 3])
    assert t.plan([5, 6, 7], 3, 4) == ([5, 6, 7, 8], [-1, 0, 1, 0])
    assert t.plan([], 3, 0) == ([], [])


def test_fresh_tree_is_usable_and_feeds_the_chain():
    buf = TailBuffer(3)
    committed = [1, 2, 3]
    assert buf.add_tree(3, TOKENS, PARENTS, committed, base_committed_len=3) == 6
    assert buf.usable(8) == [5, 6, 7]  # branch 0
    tokens, parents = buf.usable_tree(4, 8)
    assert tokens == [5, 6, 7, 8, 9, 10] and parents == [-1, 0, 1, 0, -1, 4]
    assert buf.stats.num_received_tokens == 6
    # a later chain segment continues branch 0 and lengthens the tree's first path
    buf.add(6, [11], committed, base_committed_len=3)
    assert buf.usable_tree(4, 8)[0] == [5, 6, 7, 11, 8, 9, 10]


def test_tree_drafted_on_an_older_prefix_is_stale():
    buf = TailBuffer(3)
    assert buf.add_tree(3, TOKENS, PARENTS, [1, 2, 3, 4], base_committed_len=3) == 0
    assert buf.tree is None and buf.usable_tree(4, 8) is None
    assert buf.stats.num_stale_tokens >= len(TOKENS)


def test_commit_along_a_branch_keeps_the_subtree_below_it():
    buf = TailBuffer(3)
    committed = [1, 2, 3]
    buf.add_tree(3, TOKENS, PARENTS, committed, base_committed_len=3)
    buf.on_commit(committed + [9])  # branch 2's first token
    assert buf.tree.tokens == [10] and buf.usable(4) == []
    assert buf.usable_tree(4, 8) is None  # a single node is a chain: verified as one
    buf.on_commit(committed + [9, 10])
    assert buf.tree is None  # leaf reached: nothing below


def test_commit_off_the_tree_drops_it():
    buf = TailBuffer(3)
    committed = [1, 2, 3]
    buf.add_tree(3, TOKENS, PARENTS, committed, base_committed_len=3)
    buf.on_commit(committed + [5, 42])
    assert buf.tree is None and buf.usable(4) == []
    buf.add_tree(5, [1, 2], [-1, -1], committed + [5, 42], base_committed_len=5)
    buf.reset(5)
    assert buf.tree is None


def test_scheduler_plans_trees_within_the_request_reservation():
    """A bushy tree near the end of a request gets no more nodes than a chain could have
    (num_remaining - 1): its KV never reaches past prompt + max_tokens."""
    from specmesh.decode.config import VerifierConfig
    from specmesh.decode.request import Request, RequestStatus
    from specmesh.decode.scheduler import Scheduler
    from specmesh.engine.block_manager import BlockManager
    from specmesh.protocol.messages import SamplingParams

    sched = Scheduler(VerifierConfig(), BlockManager(64, 4))
    req = Request("r", "gw", list(range(4)), SamplingParams(max_tokens=8), 4)
    sched.enqueue(req)
    sched.admit([req], ["p0"], lambda p: 0)
    req.status, req.drafter = RequestStatus.RUNNING, "d0"
    bushy = ([10, 11, 12, 13, 14, 15], [-1] * 6)
    req.output_token_ids = [1, 2]
    req.tail.reset(2)
    req.tail.add_tree(2, *bushy, req.output_token_ids, base_committed_len=2)
    (p,) = sched.plan([req])
    assert p.parents == [-1] * 5 and p.draft_token_ids == [10, 11, 12, 13, 14]  # 8 - 2 - 1
    req.output_token_ids = [1, 2, 3, 4, 5, 6]  # two left: one node
    req.tail.reset(6)
    req.tail.add_tree(6, *bushy, req.output_token_ids, base_committed_len=6)
    (p,) = sched.plan([req])
    assert len(p.draft_token_ids) == 1 and p.parents is None  # one node is a chain
    assert len(req.block_table) * 4 <= req.prompt_len + 8
