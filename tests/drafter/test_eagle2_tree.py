"""EAGLE-2 draft trees (drafter/eagle/tree.py, head_tree.py, tree_draft.py): the tree an
EagleProposer with ``topk`` > 1 drafts equals a brute-force EAGLE-2 over a tiny random head
(every node's distribution from a plain chain extend of its path, the per-depth top-k
expansion and the final top-``max_nodes`` rerank written out directly), topk 1 keeps today's
chains, and branch 0's entries continue as the chain drafted after the tree."""

from __future__ import annotations

import copy

import pytest
import torch

from specmesh.drafter.eagle.head import EagleHead, EagleHeadConfig
from specmesh.drafter.eagle.tree import grow_tree, select_tree
from specmesh.drafter.proposers.eagle import EagleProposer

V, D = 40, 32


def _head(seed=0):
    torch.manual_seed(seed)
    cfg = EagleHeadConfig(hidden_size=D, num_heads=4, num_kv_heads=2, head_dim=8,
                          intermediate_size=48, vocab_size=V, draft_vocab_size=30)
    head = EagleHead(cfg).double()
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    emb = torch.randn(V, D, dtype=torch.float64)
    head.set_target_weights(emb, emb.clone(), torch.randperm(V)[:30])
    return head.eval()


def _ready(head, ctx, truth, topk=1, nodes=None):
    p = EagleProposer(head_module=head, topk=topk, tree_nodes=nodes)
    p.open("r", ctx)
    p.observe_seed_state("r", len(ctx) - 1 - truth.shape[0], truth)
    return p


def _brute_force(head, ctx, truth, topk, depth, max_nodes):
    """EAGLE-2 written out: the full topk-ary tree of paths (draft-vocabulary indices), each
    node's row from a chain extend of its path on a copy of the caught-up head KV, then the
    per-depth frontier and the final rerank over the generated nodes. Returns the kept paths
    as target-id tuples."""
    p = _ready(head, ctx, truth)
    p.propose("r", ctx, 1)  # catch up: entries through len(ctx) - 2
    st = p.states["r"]
    p._truncate(st, len(ctx) - 1)
    base_kv, root = st.kv, st.outs[-1]

    def row(path):  # log-probs of the children of the node at ``path`` (draft ids)
        kv, g = copy.deepcopy(base_kv), root
        for d, tok in enumerate(path):
            g = head.extend(kv, g[None], head.target_ids(torch.tensor([tok])),
                            len(ctx) - 1 + d)[0]
        return torch.log_softmax(head.logits(g[None]).float(), -1)[0]

    def top(path, score):
        r = row(path)
        v, i = r.topk(topk)
        return [(path + (int(t),), score + float(s)) for s, t in zip(v, i)]

    generated = top((), 0.0)  # (path, score) in the order made
    frontier = generated
    for _ in range(2, depth + 1):
        kids = [c for path, score in frontier for c in top(path, score)]
        generated = generated + kids
        frontier = sorted(kids, key=lambda c: -c[1])[:topk]
    kept = sorted(generated, key=lambda c: -c[1])[:max_nodes]
    ids = head.draft_to_target
    return {tuple(int(ids[t]) for t in path) for path, _ in kept}


def _paths(tokens, parents):
    out = []
    for j in range(len(tokens)):
        path, n = [], j
        while n >= 0:
            path.append(tokens[n])
            n = parents[n]
        out.append(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("topk,depth,nodes", [(2, 3, 5), (3, 4, 8), (4, 3, 20), (3, 1, 3)])
def test_tree_equals_brute_force_eagle2(topk, depth, nodes):
    head = _head(topk + depth)
    torch.manual_seed(7)
    ctx = [3, 7, 1, 9, 4, 11]
    truth = torch.randn(2, D, dtype=torch.float64)  # true states at positions 3, 4
    p = _ready(head, ctx, truth, topk, nodes)
    assert p.draft_shape == "tree"
    tokens, parents = p.propose_tree("r", ctx, depth)
    assert all(-1 <= q < j for j, q in enumerate(parents))
    paths = _paths(tokens, parents)
    assert len(set(paths)) == len(paths) <= nodes
    assert set(paths) == _brute_force(head, ctx, truth, topk, depth, nodes)
    assert max(len(x) for x in paths) <= depth
    # one forward per expanded depth, never more than depth - 1
    assert p.num_tree_forwards <= depth - 1


def test_topk_one_is_todays_chain():
    head = _head(1)
    torch.manual_seed(3)
    ctx = [5, 2, 8, 13, 1]
    truth = torch.randn(2, D, dtype=torch.float64)
    chain = _ready(head, ctx, truth)
    assert chain.draft_shape == "chain"
    assert EagleProposer.options.parse("topk=1", {}) == {"topk": 1}
    assert _ready(head, ctx, truth, topk=1).propose("r", ctx, 5) == chain.propose("r", ctx, 5)


def test_branch0_entries_continue_as_the_chain_after_the_tree():
    """After a tree the worker drafts on from the end of branch 0 with chains: they equal a
    fresh proposer's chain over the same context (branch 0's entries, copied from the tree
    into the request's head KV, are the chain's own)."""
    head = _head(5)
    torch.manual_seed(4)
    ctx = [3, 7, 1, 9, 4, 11, 6]
    truth = torch.randn(3, D, dtype=torch.float64)
    p = _ready(head, ctx, truth, topk=3, nodes=9)
    tokens, parents = p.propose_tree("r", ctx, 4)
    branch0, node = [], -1
    while (nxt := next((j for j, q in enumerate(parents) if q == node), None)) is not None:
        branch0.append(tokens[nxt])
        node = nxt
    assert len(branch0) >= 2
    forwards = p.num_tree_forwards
    more = p.propose("r", ctx + branch0, 3)
    fresh = _ready(head, ctx + branch0, truth)  # same true states, longer context
    want = fresh.propose("r", ctx + branch0, 3)
    assert more == want
    assert p.num_tree_forwards == forwards


def test_rerank_keeps_a_tree_and_breaks_ties_to_the_parent():
    """Scores that tie (log-prob 0 children) never keep a child without its parent."""
    rows = {0: torch.tensor([0.0, -50.0, -60.0])}

    def expand(frontier, nodes):
        return torch.stack([torch.tensor([0.0, -70.0, -80.0]) for _ in frontier])

    nodes = grow_tree(rows[0], expand, topk=2, depth=4, max_nodes=3)
    order = select_tree(nodes, 3)
    kept = set(order)
    assert all(nodes[i].parent < 0 or nodes[i].parent in kept for i in order)
    assert [nodes[i].depth for i in order] == [1, 2, 3]


def test_bad_options_are_refused():
    head = _head(0)
    with pytest.raises(ValueError):
        EagleProposer(head_module=head, topk=0)
    with pytest.raises(ValueError):
        EagleProposer(head_module=head, topk=2, tree_nodes=0)


def test_propose_trees_equals_each_request_alone(monkeypatch):
    """One lockstep call for several requests (different contexts, states and depths; one
    with nothing to draft from) drafts the trees each gets alone, with one forward per depth
    for all of them."""
    from specmesh.drafter.proposer import ProposeCall

    head = _head(6)
    torch.manual_seed(12)
    reqs = {f"r{i}": ([int(x) for x in torch.randint(0, V, (4 + i,))],
                      torch.randn(2, D, dtype=torch.float64)) for i in range(4)}
    depths = {"r0": 1, "r1": 3, "r2": 4, "r3": 2}
    batched = EagleProposer(head_module=head, topk=3, tree_nodes=7)
    calls = []
    for rid, (ctx, truth) in reqs.items():
        batched.open(rid, ctx)
        if rid != "r3":  # r3 has no seed state: no tree
            batched.observe_seed_state(rid, len(ctx) - 1 - truth.shape[0], truth)
        calls.append(ProposeCall(rid, ctx, depths[rid]))
    from specmesh.drafter.eagle import tree_draft

    forwards = []
    level_many = tree_draft.tree_level_many

    def counting(h, items):  # noqa: ANN001, ANN202
        forwards.append(len(items))
        return level_many(h, items)

    monkeypatch.setattr(tree_draft, "tree_level_many", counting)
    got = batched.propose_trees(calls)
    monkeypatch.setattr(tree_draft, "tree_level_many", level_many)
    assert len(forwards) <= 3 and max(forwards) >= 2  # per depth, several requests at once
    for call, (tokens, parents, rows) in zip(calls, got):
        ctx, truth = reqs[call.request_id]
        if call.request_id == "r3":
            assert tokens == [] and parents == []
            continue
        alone = _ready(head, ctx, truth, topk=3, nodes=7)
        assert (tokens, parents) == alone.propose_tree("r", ctx, call.num_tokens)
        assert rows == [None] * len(tokens) and tokens


def test_greedy_chain_q_is_the_head_softmax_at_each_draft():
    """EAGLE sends a greedy chain draft's q (``returns_token_probs``, for the confidence
    budget): asked with ``DraftSampling.token_probs`` it drafts the same tokens as without, and
    each q is the head's softmax at the drafted token over its draft vocabulary, alone
    (``propose_sampled``) and batched with an unscored request (``propose_many``)."""
    from specmesh.drafter.draft_sampling import DraftSampling
    from specmesh.drafter.proposer import ProposeCall
    from specmesh.protocol.messages import SamplingParams

    head = _head(11)
    torch.manual_seed(5)
    ctx = [4, 9, 2, 17, 6]
    truth = torch.randn(2, D, dtype=torch.float64)
    plain = _ready(head, ctx, truth).propose("r", ctx, 4)
    how = DraftSampling(SamplingParams(max_tokens=8), len(ctx), token_probs=True)
    p = _ready(head, ctx, truth)
    drafts, qs = p.propose_sampled("r", ctx, 4, how)
    assert drafts == plain and all(isinstance(q, float) for q in qs)
    # q by hand: replay the chain, the head's softmax over its draft vocabulary at each draft
    ref = _ready(head, ctx, truth)
    st = ref.states["r"]
    want = []
    for j in range(4):
        ref.propose("r", ctx + plain[:j], 1)
        probs = torch.softmax(head.logits(st.last_g[None]).double(), -1)[0]
        want.append(float(probs.max()))
    assert qs == pytest.approx(want, rel=1e-5) and all(0 < q <= 1 for q in qs)  # float32
    two = _ready(head, ctx, truth)
    two.open("s", ctx)
    two.observe_seed_state("s", len(ctx) - 1 - truth.shape[0], truth)
    (d1, q1), (d2, q2) = two.propose_many([ProposeCall("r", ctx, 4, how),
                                           ProposeCall("s", ctx, 4, None)])
    assert d1 == d2 == plain and q1 == pytest.approx(qs, rel=1e-6) and q2 == [None] * 4
