"""Multi-layer EAGLE heads (drafter/eagle/steps.py, step_draft.py): the training passes see
what serving drafts see, module i drafts depth i and nothing else, incremental drafting equals
drafting from scratch, trees with per-depth modules are EAGLE-2's over the per-depth chains,
checkpoints round-trip (an old config is a 1-module head), and the head's memory and per-module
cost are reported."""

import copy
import json
from types import SimpleNamespace

import pytest
import torch

from specmesh.drafter.eagle.checkpoint import load_head, save_head, target_identity
from specmesh.drafter.eagle.head import EagleHead, EagleHeadConfig
from specmesh.drafter.eagle.step_draft import StepChains, StepState, catch_up_steps
from specmesh.drafter.proposer import BranchCall, ProposeCall
from specmesh.drafter.proposers.eagle import EagleProposer

V, D = 40, 32


def _head(seed=0, num_steps=2, after="repeat"):
    torch.manual_seed(seed)
    cfg = EagleHeadConfig(hidden_size=D, num_heads=4, num_kv_heads=2, head_dim=8,
                          intermediate_size=48, vocab_size=V, draft_vocab_size=30,
                          num_steps=num_steps, after_last_step=after)
    head = EagleHead(cfg).double()
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    emb = torch.randn(V, D, dtype=torch.float64)
    head.set_target_weights(emb, emb.clone(), torch.randperm(V)[:30])
    return head.eval()


def _ready(head, ctx, truth, **kw):
    p = EagleProposer(head_module=head, **kw)
    p.open("r", ctx)
    p.observe_seed_state("r", len(ctx) - 1 - truth.shape[0], truth)
    return p


def test_config_defaults_are_the_one_module_head_and_bad_keys_are_refused():
    d = _head(num_steps=1).config.to_dict()
    del d["num_steps"], d["after_last_step"]  # a config.json written before the fields
    cfg = EagleHeadConfig.from_dict(d)
    assert cfg.num_steps == 1 and cfg.after_last_step == "repeat"
    assert not [k for k in EagleHead(cfg).state_dict() if k.startswith("steps")]
    assert [cfg.step_of_depth(j) for j in (1, 2, 5)] == [0, 0, 0]
    c3 = EagleHeadConfig.from_dict({**d, "num_steps": 3, "after_last_step": "stop"})
    assert [c3.step_of_depth(j) for j in (1, 2, 3, 4)] == [0, 1, 2, None]
    for bad in ({"num_steps": 0}, {"after_last_step": "loop"}):
        with pytest.raises(ValueError):
            EagleHeadConfig.from_dict({**d, **bad})


@pytest.mark.parametrize("num_steps,after", [(2, "repeat"), (3, "repeat"), (3, "stop")])
def test_training_passes_equal_the_served_per_module_chains(num_steps, after):
    """forward_steps (masks over whole sequences) and the proposer's per-module KVs with the
    chain entries beside them (step_draft.py) compute the same states at every depth."""
    head = _head(num_steps, num_steps, after)
    S, start, depth = 10, 4, 4
    torch.manual_seed(11)
    feats = torch.randn(1, S, D, dtype=torch.float64)
    toks = torch.randint(0, V, (1, S))
    pos = torch.arange(start, start + S)[None]
    with torch.no_grad():
        passes = head.forward_passes(feats, toks, pos, depth=depth)
    assert len(passes) == (num_steps if after == "stop" else depth)
    for i0 in range(S - depth + 1):
        mods = [StepState() for _ in range(num_steps)]
        mods[0].outs.extend(head.extend(mods[0].kv, feats[0, :i0 + 1], toks[0, :i0 + 1], start))
        ctx = [0] * (start + 1) + toks[0, :i0 + 1].tolist()  # ctx[p + 1]: entry p's token
        catch_up_steps(head, [(mods, ctx)])
        g, chains = mods[0].outs[-1], StepChains(head)
        torch.testing.assert_close(passes[0][0, i0], g)
        for k in range(2, len(passes) + 1):
            g = chains.step(k, {0: (mods, len(ctx), g, int(toks[0, i0 + k - 1]))})[0]
            torch.testing.assert_close(passes[k - 1][0, i0 + k - 1], g)
        assert not chains.step(len(passes) + 1, {0: (mods, len(ctx), g, 1)}) \
            or after == "repeat"


def test_module_i_drafts_depth_i_only():
    """Changing module 1's weights changes drafts at depth >= 2 only; changing module 0's
    changes the first draft too."""
    head = _head(3)
    other = copy.deepcopy(head)
    with torch.no_grad():
        for p in other.steps[0].parameters():
            p.add_(0.5 * torch.randn_like(p))
    first = copy.deepcopy(head)
    with torch.no_grad():
        for p in first.layers.parameters():
            p.add_(0.5 * torch.randn_like(p))
    later_differs = first_differs = 0
    for seed in range(12):
        torch.manual_seed(100 + seed)
        ctx = torch.randint(0, V, (8,)).tolist()
        truth = torch.randn(4, D, dtype=torch.float64)
        a = _ready(head, ctx, truth).propose("r", ctx, 4)
        b = _ready(other, ctx, truth).propose("r", ctx, 4)
        c = _ready(first, ctx, truth).propose("r", ctx, 4)
        assert len(a) == len(b) == 4 and a[0] == b[0]
        later_differs += a[1:] != b[1:]
        first_differs += a[0] != c[0]
    assert later_differs > 0 and first_differs > 0


def test_stop_head_drafts_at_most_num_steps():
    head = _head(4, num_steps=2, after="stop")
    ctx = [3, 7, 1, 9, 4, 11]
    truth = torch.randn(3, D, dtype=torch.float64)
    assert len(_ready(head, ctx, truth).propose("r", ctx, 5)) == 2
    tokens, parents = _ready(head, ctx, truth, topk=2).propose_tree("r", ctx, 5)
    assert tokens and max(_depth(parents, j) for j in range(len(parents))) <= 2


def test_every_module_forward_is_counted_as_a_draft_forward():
    """A 3-module head's chain of 3 drafts runs module 0, 1 and 2 (and catches modules 1..
    up over the context): num_draft_forwards counts them all, as the bench's forward cost
    and the drafter's stats read it, not module 0's alone."""
    head = _head(5, num_steps=3, after="stop")
    ctx = [3, 7, 1, 9, 4, 11]
    p = _ready(head, ctx, torch.randn(3, D, dtype=torch.float64))
    assert len(p.propose("r", ctx, 3)) == 3
    assert p.clock.forwards[1] >= 1 and p.clock.forwards[2] >= 1
    assert p.num_draft_forwards >= 3
    assert p.num_draft_forwards == p.clock.forwards[0] + sum(p.clock.forwards[1:])
    before = p.num_draft_forwards
    p.num_draft_forwards += 1  # a tree depth or branch peek adds to it as before
    assert p.num_draft_forwards == before + 1


def _fresh(head, feats, start, ctx, n):
    p = EagleProposer(head_module=head)
    p.open("r", ctx)
    p.observe_seed_state("r", start, feats)
    return p.propose("r", ctx, n)


def test_incremental_drafting_equals_drafting_from_scratch():
    head = _head(5, num_steps=3)
    torch.manual_seed(5)
    prompt = [3, 7, 1, 9, 4]
    truth = torch.randn(30, D, dtype=torch.float64)
    p0 = len(prompt) - 1
    prop = EagleProposer(head_module=head)
    ctx = prompt + [11]
    prop.open("r", ctx)
    prop.observe_seed_state("r", p0, truth[:1])
    d = prop.propose("r", ctx, 4)
    assert d == _fresh(head, truth[:1], p0, ctx, 4)
    bonus = (d[2] + 1) % V  # 2 drafts accepted, then a token other than the 3rd
    committed = ctx + d[:2] + [bonus]
    prop.rollback("r", len(ctx) + 2)
    prop.observe_seed_state("r", len(ctx) - 1, truth[1:4])
    got = prop.propose("r", committed, 4)
    assert got == _fresh(head, truth[:4], p0, committed, 4)
    committed2 = committed + got[:1]  # all module KVs extend; nothing of a draft kept
    prop.observe_seed_state("r", len(committed) - 1, truth[4:5])
    got2 = prop.propose("r", committed2, 3)
    assert got2 == _fresh(head, truth[:5], p0, committed2, 3)
    st = prop.states["r"]
    assert [s.kv.end for s in (st, *st.steps)] == [len(committed2) - 1] * 3
    assert [s.kv.start for s in (st, *st.steps)] == [p0, p0 + 1, p0 + 2]


@pytest.mark.parametrize("num_steps,after", [(2, "repeat"), (3, "repeat"), (2, "stop")])
def test_one_draft_per_call_equals_the_whole_chain(num_steps, after):
    """The worker drafts a chain one call per draft, each call's context the path so far:
    the drafts are the chain's (module i at depth i, not module 0 again), and the chain's
    entries are reused, not run again."""
    head = _head(12, num_steps=num_steps, after=after)
    torch.manual_seed(12)
    ctx = [3, 7, 1, 9, 4, 11, 2]
    truth = torch.randn(4, D, dtype=torch.float64)
    whole = _ready(head, ctx, truth).propose("r", ctx, 5)
    assert len(whole) == (5 if after == "repeat" else num_steps)
    p = _ready(head, ctx, truth)
    path = []
    for _ in range(5):
        path += p.propose("r", ctx + path, 1)
    assert path == whole
    forwards = sum(p.clock.forwards[1:])
    assert forwards == len(whole) - 1 + (num_steps - 1)  # one per draft + modules' catch-up
    # a commit of 1 draft and a bonus token: the chain starts again from the new anchor
    committed = ctx + whole[:1] + [(whole[1] + 1) % V]
    new = torch.randn(2, D, dtype=torch.float64)
    p.rollback("r", len(ctx) + 1)
    p.observe_seed_state("r", len(ctx) - 1, new)
    fresh = EagleProposer(head_module=head)
    fresh.open("r", committed)
    fresh.observe_seed_state("r", len(ctx) - 1 - truth.shape[0], torch.cat([truth, new]))
    assert p.propose("r", committed, 3) == fresh.propose("r", committed, 3)


def test_propose_many_equals_each_request_alone():
    head = _head(6, num_steps=2)
    torch.manual_seed(8)
    ctxs = [torch.randint(0, V, (n,)).tolist() for n in (6, 9, 7)]
    truths = [torch.randn(3, D, dtype=torch.float64) for _ in ctxs]
    prop = EagleProposer(head_module=head)
    for i, (ctx, t) in enumerate(zip(ctxs, truths)):
        prop.open(f"r{i}", ctx)
        prop.observe_seed_state(f"r{i}", len(ctx) - 1 - t.shape[0], t)
    got = prop.propose_many([ProposeCall(f"r{i}", ctx, 4, None) for i, ctx in enumerate(ctxs)])
    for (ctx, t), (toks, _) in zip(zip(ctxs, truths), got):
        assert toks == _ready(head, ctx, t).propose("r", ctx, 4)


def _depth(parents, j):
    d = 1
    while parents[j] >= 0:
        j, d = parents[j], d + 1
    return d


def _paths(tokens, parents):
    out = []
    for j in range(len(tokens)):
        path, n = [], j
        while n >= 0:
            path.append(tokens[n])
            n = parents[n]
        out.append(tuple(reversed(path)))
    return out


def _brute_force(head, ctx, truth, topk, depth, max_nodes):
    """EAGLE-2 over a multi-layer head written out: every node's row from its own chain
    (StepChains over the caught-up module KVs, module i at depth i), the per-depth frontier
    and the final rerank. Returns the kept paths as target-id tuples."""
    p = _ready(head, ctx, truth)
    p.propose("r", ctx, 1)  # catch up every module: entries through len(ctx) - 2
    st = p.states["r"]
    mods, root, L = [st, *st.steps], st.outs[-1], len(ctx)

    def row(path):
        g, chains = root, StepChains(head)
        for d, tok in enumerate(path):
            g = chains.step(d + 2, {0: (mods, L, g, int(head.target_ids(torch.tensor(tok))))})[0]
        return torch.log_softmax(head.logits(g[None]).float(), -1)[0]

    def top(path, score):
        v, i = row(path).topk(topk)
        return [(path + (int(t),), score + float(s)) for s, t in zip(v, i)]

    generated = frontier = top((), 0.0)
    for _ in range(2, depth + 1):
        kids = [c for path, score in frontier for c in top(path, score)]
        generated = generated + kids
        frontier = sorted(kids, key=lambda c: -c[1])[:topk]
    kept = sorted(generated, key=lambda c: -c[1])[:max_nodes]
    ids = head.draft_to_target
    return {tuple(int(ids[t]) for t in path) for path, _ in kept}


@pytest.mark.parametrize("num_steps,topk,depth,nodes", [(2, 2, 3, 5), (3, 3, 4, 8),
                                                        (3, 2, 3, 20)])
def test_trees_with_per_depth_modules_equal_brute_force_eagle2(num_steps, topk, depth, nodes):
    head = _head(num_steps + topk, num_steps=num_steps)
    torch.manual_seed(7)
    ctx = [3, 7, 1, 9, 4, 11, 2, 5]
    truth = torch.randn(4, D, dtype=torch.float64)
    p = _ready(head, ctx, truth, topk=topk, tree_nodes=nodes)
    tokens, parents = p.propose_tree("r", ctx, depth)
    paths = _paths(tokens, parents)
    assert len(set(paths)) == len(paths) <= nodes
    assert set(paths) == _brute_force(head, ctx, truth, topk, depth, nodes)
    # a chain after the tree is the chain drafted without it
    assert p.propose("r", ctx, 3) == _ready(head, ctx, truth).propose("r", ctx, 3)


def test_branches_read_the_depth_two_module():
    head = _head(9, num_steps=2)
    torch.manual_seed(9)
    ctx = [3, 7, 1, 9, 4, 11]
    truth = torch.randn(3, D, dtype=torch.float64)
    p = _ready(head, ctx, truth)
    path = p.propose("r", ctx, 2)
    (got,) = p.propose_branches([BranchCall("r", ctx, path[0], 2)])
    assert len(got) == 2 and path[0] not in got
    for cand, after in got.items():  # module 1's draft after the candidate
        assert after == [_second_draft(head, ctx, truth, cand)]


def _second_draft(head, ctx, truth, cand):
    p = _ready(head, ctx, truth)
    p.propose("r", ctx, 1)
    st = p.states["r"]
    g = StepChains(head).step(2, {0: ([st, *st.steps], len(ctx), st.outs[-1], cand)})[0]
    return int(head.target_ids(head.logits(g[None]).argmax(-1))[0])


def test_checkpoint_round_trip_and_draft_stats(tmp_path):
    head = _head(10, num_steps=2).float()
    ident = target_identity("toy", SimpleNamespace(vocab_size=V, hidden_size=D, num_layers=1),
                            head.embed)
    head.config.target.update(ident)
    save_head(head, tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    assert meta["config"]["num_steps"] == 2 and meta["config"]["after_last_step"] == "repeat"
    loaded = load_head(tmp_path, head.embed, head.embed.clone(), ident)
    assert loaded.config.num_steps == 2
    for k, v in head.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    ctx = [3, 7, 1, 9, 4, 11, 6, 2]
    truth = torch.randn(5, D)
    one = _head(10, num_steps=1).float()
    p2, p1 = _ready(loaded, ctx, truth), _ready(one, ctx, truth)
    assert p2.propose("r", ctx, 3) == _ready(head, ctx, truth).propose("r", ctx, 3)
    p1.propose("r", ctx, 3)
    s2, s1 = p2.draft_stats(), p1.draft_stats()
    assert s2["draft_num_steps"] == 2 and s1["draft_num_steps"] == 1
    per_module = sum(p.numel() * 4 for p in loaded.steps[0].parameters())
    assert s2["draft_weights_bytes"] == s1["draft_weights_bytes"] + per_module
    assert len(s2["draft_step_weight_bytes"]) == 2 and len(s2["draft_step_ms"]) == 2
    assert s2["draft_step_weight_bytes"][1] == per_module + loaded.lm_head.numel() * 4
    # a KV per module: module 1's buffers beside module 0's (same capacity here)
    st = p2.states["r"]
    kv_bytes = [sum(t.numel() * 4 for t in (*kv.key_buffers, *kv.value_buffers))
                for kv in (st.kv, st.steps[0].kv)]
    chain = p2.chains.nbytes()  # the chain's entries beside the modules' KVs
    assert s2["draft_kv_pool_bytes"] == sum(kv_bytes) + chain and kv_bytes[1] > 0 and chain > 0
    assert s1["draft_kv_pool_bytes"] == kv_bytes[0]
    assert all(f > 0 for f in s2["draft_step_forwards"])
