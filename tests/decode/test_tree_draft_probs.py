"""Draft trees with draft-probability rows on the verifier (a sampled EAGLE-2 tree): the tail
buffer keeps each node's row through the chain, a commit's subtree and the plan (siblings in
their order, a prefix of each group when capped), the scheduler plans the tree with its rows,
and the tree rule's unseeded sampled path judges the nodes with those rows (the kernel's
multi-draft rejection with real q), in a mixed batch too."""

from __future__ import annotations

import torch

from specmesh.decode.draft_tree import DraftTree
from specmesh.decode.rules import get_rule
from specmesh.decode.tail_buffer import TailBuffer
from specmesh.decode.verification import RuleBatch
from specmesh.kernels.tree_rejection_sample import (tree_rejection_sample_noise,
                                                    tree_rejection_sample_ref)
from specmesh.protocol.messages import SamplingParams

# branch 0: 5 6 7, branch 1: 5 8, branch 2: 9 10
TOKENS = [5, 6, 7, 8, 9, 10]
PARENTS = [-1, 0, 1, 0, -1, 4]
ROWS = [f"q{t}" for t in TOKENS]  # any row object: kept, never read by the buffer


def test_rows_follow_their_nodes_through_the_buffer():
    buf = TailBuffer(3)
    committed = [1, 2, 3]
    buf.add_tree(3, TOKENS, PARENTS, committed, base_committed_len=3, draft_probs=ROWS)
    assert buf.usable_probs(3) == ["q5", "q6", "q7"]  # branch 0's rows, as a chain
    tokens, parents, rows = buf.usable_tree_rows(4, 8)
    assert tokens == TOKENS and parents == PARENTS
    assert rows == ROWS
    buf.add(6, [11], committed, base_committed_len=3, draft_probs=["q11"])
    tokens, parents, rows = buf.usable_tree_rows(4, 8)
    assert tokens == [5, 6, 7, 11, 8, 9, 10]
    assert rows == ["q5", "q6", "q7", "q11", "q8", "q9", "q10"]
    # capped: depth 2, 4 nodes: each sibling group keeps a prefix of its order
    tokens, parents, rows = buf.usable_tree_rows(2, 4)
    assert tokens == [5, 6, 8, 9] and rows == ["q5", "q6", "q8", "q9"]
    # a commit along branch 0's first token keeps the subtree with its rows
    buf.on_commit(committed + [5])
    assert buf.tree.tokens == [6, 7, 8] and buf.tree.rows == ["q6", "q7", "q8"]
    assert buf.usable_tree_rows(4, 8)[2] == ["q6", "q7", "q11", "q8"]


def test_a_tree_without_rows_still_plans_one_hot():
    t = DraftTree.from_segment(TOKENS, PARENTS)
    assert t.rows == [None] * len(TOKENS)
    out = t.plan_tree([5, 6], None, 3, 10)
    assert out.rows == [None] * len(out.tokens)


def test_tree_rule_judges_sampled_nodes_with_their_rows():
    """One unseeded sampled tree (rows) beside a greedy one (one-hot): the sampled request's
    result is the kernel's with its rows and the same noise."""
    V = 8
    gen = torch.Generator().manual_seed(3)
    sampled = SamplingParams(max_tokens=8, temperature=1.0)
    greedy = SamplingParams(max_tokens=8)
    drafts = [2, 5, 1, 4]  # sampled tree: root children 2, 5; 1 under 2; 4 under 5
    parents = [-1, -1, 0, 1]
    q = torch.softmax(torch.randn(4, V, generator=gen), -1)
    q[1, 2] = 0  # the second root child was drawn without the first
    q[1] /= q[1].sum()
    target = torch.randn(len(drafts) + 1, V, generator=gen)
    g_drafts, g_parents = [3, 6], [-1, 0]
    g_target = torch.randn(3, V, generator=gen)
    onehot = torch.nn.functional.one_hot(torch.tensor(g_drafts), V).float()
    batch = RuleBatch(
        draft_token_ids=torch.tensor(g_drafts + drafts),
        cu_num_draft_tokens=torch.tensor([2, 6]), target_logits=torch.cat([g_target, target]),
        sampling=[greedy, sampled], positions=torch.tensor([4, 4]),
        draft_probs=torch.cat([onehot, q]), generator=torch.Generator().manual_seed(9),
        parents=torch.tensor(g_parents + parents))
    rule = get_rule("tree")
    assert rule.uses_draft_probs
    out, acc, nodes = rule.verify_tree(batch)
    # the sampled request alone through the kernel, with the rule's noise
    noise_gen = torch.Generator().manual_seed(9)
    cu = torch.tensor([4])
    probs = torch.softmax(target, -1)
    uniform, noise = tree_rejection_sample_noise(cu, V, dtype=torch.float32,
                                                 generator=noise_gen)
    want = tree_rejection_sample_ref(torch.tensor(drafts), cu, torch.tensor(parents), q, probs,
                                     uniform, noise)
    a = int(want[1][0])
    assert int(acc[1]) == a
    assert out[1, :a + 1].tolist() == want[0][0, :a + 1].tolist()
    assert nodes[1, :a].tolist() == want[2][0, :a].tolist()
    # and the rows matter: one-hot rows give another acceptance on some noise
    differs = False
    for seed in range(40):
        b2 = RuleBatch(draft_token_ids=torch.tensor(drafts), cu_num_draft_tokens=cu,
                       target_logits=target, sampling=[sampled],
                       positions=torch.tensor([4]), draft_probs=q,
                       generator=torch.Generator().manual_seed(seed),
                       parents=torch.tensor(parents))
        b3 = RuleBatch(draft_token_ids=torch.tensor(drafts), cu_num_draft_tokens=cu,
                       target_logits=target, sampling=[sampled],
                       positions=torch.tensor([4]), draft_probs=None,
                       generator=torch.Generator().manual_seed(seed),
                       parents=torch.tensor(parents))
        r2, r3 = rule.verify_tree(b2), rule.verify_tree(b3)
        differs |= not torch.equal(r2[1], r3[1])
    assert differs
