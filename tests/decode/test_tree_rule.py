"""The verifier's tree rule (decode/verification.py TreeRule): on chains it equals the chain
rules; in a batch that mixes greedy, seeded and unseeded sampled trees every request gets what
it gets alone."""

from __future__ import annotations

import torch

from specmesh.decode.rules import get_rule
from specmesh.decode.verification import RuleBatch, _sub_batch
from specmesh.protocol.messages import SamplingParams

V = 32
GREEDY = SamplingParams(max_tokens=8)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, seed=7)
SAMPLED = SamplingParams(max_tokens=8, temperature=0.9)


def _batch(trees, sampling, seed=0, positions=None):
    """trees: per request (draft_token_ids, parents); logits random, peaked at the drafts of
    branch 0's first node so that paths get accepted."""
    gen = torch.Generator().manual_seed(seed)
    drafts = [t for d, _ in trees for t in d]
    parents = [p for _, ps in trees for p in ps]
    counts = torch.tensor([len(d) for d, _ in trees])
    logits = torch.randn(len(drafts) + len(trees), V, generator=gen, dtype=torch.float64)
    row = 0
    for d, ps in trees:  # row 0 prefers the second child of the root, row 1+j node j's child
        kids = [j for j, p in enumerate(ps) if p == -1]
        logits[row, d[kids[-1]]] += 8
        for j in range(len(d)):
            nxt = [c for c, p in enumerate(ps) if p == j]
            if nxt:
                logits[row + 1 + j, d[nxt[0]]] += 8
        row += len(d) + 1
    return RuleBatch(draft_token_ids=torch.tensor(drafts), cu_num_draft_tokens=counts.cumsum(0),
                     target_logits=logits.float(), sampling=list(sampling),
                     positions=torch.tensor(positions or [3] * len(trees)),
                     generator=torch.Generator().manual_seed(seed),
                     parents=torch.tensor(parents))


def test_tree_rule_on_chains_equals_the_chain_rules():
    chains = [([4, 5, 6], [-1, 0, 1]), ([7, 8], [-1, 0])]
    for sp, rule in ((GREEDY, "greedy"), (SEEDED, "coupled")):
        b = _batch(chains, [sp, sp], positions=[3, 9])
        out, acc, nodes = get_rule("tree").verify_tree(b)
        want_out, want_acc = get_rule(rule).verify(b)
        assert torch.equal(acc, want_acc)
        for i in range(2):
            a = int(acc[i])
            assert out[i, :a + 1].tolist() == want_out[i, :a + 1].tolist()
            assert nodes[i, :a].tolist() == list(range(a))


def test_mixed_batch_equals_each_request_alone():
    trees = [([4, 5, 6, 9], [-1, -1, 1, 0]), ([7, 8, 3], [-1, -1, 0]),
             ([10, 11, 12], [-1, 0, -1])]
    sampling = [GREEDY, SAMPLED, SEEDED]
    mixed = _batch(trees, sampling)
    out, acc, nodes = get_rule("tree").verify_tree(mixed)
    assert acc[0] > 0 and nodes[0, 0] == 1  # greedy: the second root child (a side branch)
    for b in (0, 2):  # deterministic rules: the same alone
        alone = _batch(trees, sampling)
        o, a, n = get_rule("tree").verify_tree(_sub_batch(alone, [b]))
        assert int(a[0]) == int(acc[b])
        assert o[0, :int(a[0]) + 1].tolist() == out[b, :int(acc[b]) + 1].tolist()
        assert n[0, :int(a[0])].tolist() == nodes[b, :int(acc[b])].tolist()
    a1 = int(acc[1])  # sampled: a valid path of its own tree
    path = nodes[1, :a1].tolist()
    assert all(0 <= t < V for t in out[1, :a1 + 1].tolist())
    assert out[1, :a1].tolist() == [trees[1][0][j] for j in path]
