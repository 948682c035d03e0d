"""EagleProposer: incremental drafting (commits, recomputes, rollbacks) equals drafting from
scratch on the same true states and context."""

import torch

from specmesh.drafter.eagle.head import EagleHead, EagleHeadConfig
from specmesh.drafter.registry import get_proposer
from specmesh.drafter.proposers.eagle import EagleProposer

V, D = 40, 32


def _head(seed=0, feature_layers=()):
    torch.manual_seed(seed)
    cfg = EagleHeadConfig(hidden_size=D, num_heads=4, num_kv_heads=2, head_dim=8,
                          intermediate_size=48, vocab_size=V, draft_vocab_size=30,
                          feature_layers=feature_layers)
    head = EagleHead(cfg).double()
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    emb = torch.randn(V, D, dtype=torch.float64)
    head.set_target_weights(emb, emb.clone(), torch.randperm(V)[:30])
    return head.eval()


def _fresh(head, feats, start, ctx, n):
    p = EagleProposer(head_module=head)
    p.open("r", ctx)
    p.observe_seed_state("r", start, feats)
    return p.propose("r", ctx, n)


def test_registered_with_hidden_seed_state():
    assert get_proposer("eagle") is EagleProposer
    assert EagleProposer.seed_state == "hidden"


def test_no_seed_state_no_drafts():
    p = EagleProposer(head_module=_head())
    p.open("r", [1, 2, 3])
    assert p.propose("r", [1, 2, 3], 4) == []


def test_incremental_drafting_equals_drafting_from_scratch():
    head = _head(1)
    torch.manual_seed(5)
    prompt = [3, 7, 1, 9, 4]
    truth = torch.randn(30, D, dtype=torch.float64)  # f_s for s = 4 ..
    p0 = len(prompt) - 1
    prop = EagleProposer(head_module=head)
    ctx = prompt + [11]  # first token
    prop.open("r", ctx)
    prop.observe_seed_state("r", p0, truth[:1])
    d = prop.propose("r", ctx, 4)
    assert d == _fresh(head, truth[:1], p0, ctx, 4)
    # the worker drafts on: the path grows, proposals continue the chain
    d2 = prop.propose("r", ctx + d, 3)
    assert (d + d2)[:7] == _fresh(head, truth[:1], p0, ctx, 7)
    # commit: 2 drafts accepted + a bonus token that differs from the 3rd draft -> rollback
    bonus = (d[2] + 1) % V
    committed = ctx + d[:2] + [bonus]
    prop.rollback("r", len(ctx) + 2)
    prop.observe_seed_state("r", len(ctx) - 1, truth[1:4])
    got = prop.propose("r", committed, 4)
    assert got == _fresh(head, truth[:4], p0, committed, 4)
    # a commit that agrees with the path: no rollback, true states replace predicted ones
    path = got
    committed2 = committed + path[:1]
    prop.observe_seed_state("r", len(committed) - 1, truth[4:5])
    assert prop.num_recomputed_entries > 0
    got2 = prop.propose("r", committed2 + path[1:], 2)
    want = _fresh(head, truth[:5], p0, committed2 + path[1:], 2)
    assert got2 == want


def test_context_change_without_rollback_is_still_exact():
    head = _head(2)
    truth = torch.randn(10, D, dtype=torch.float64)
    prop = EagleProposer(head_module=head)
    ctx = [1, 2, 3, 4]
    prop.open("r", ctx)
    prop.observe_seed_state("r", 2, truth[:1])
    d = prop.propose("r", ctx, 5)
    other = ctx + [(d[0] + 3) % V, 6]
    assert prop.propose("r", other, 3) == _fresh(head, truth[:1], 2, other, 3)


def test_a_gap_in_the_states_restarts_from_the_new_ones():
    head = _head(3)
    truth = torch.randn(12, D, dtype=torch.float64)
    prop = EagleProposer(head_module=head)
    ctx = list(range(1, 12))
    prop.open("r", ctx)
    prop.observe_seed_state("r", 2, truth[:1])
    prop.observe_seed_state("r", 7, truth[5:9])  # positions 3..6 never arrived
    assert prop.propose("r", ctx, 3) == _fresh(head, truth[5:9], 7, ctx, 3)
    prop.close("r")
    assert prop.propose("r", ctx, 3) == []


def test_fused_head_reads_layer_rows_and_drafts_what_its_training_passes_predict():
    """An EAGLE-3 fused head (feature_layers): its proposer declares "hidden:3,0,5", takes
    rows of 3 x hidden only, and its incremental drafts equal the argmax chain of
    ``forward_passes`` (the training / evaluation path) over the same true rows."""
    head = _head(2, feature_layers=(3, 0, 5))
    prop = EagleProposer(head_module=head)
    assert prop.seed_state == "hidden:3,0,5" and prop.seed_hidden_size == 3 * D
    assert EagleProposer.seed_state_for({"head_module": head}) == "hidden:3,0,5"
    torch.manual_seed(9)
    prompt = [3, 7, 1, 9, 4]
    rows = torch.randn(6, 3 * D, dtype=torch.float64)  # true rows at positions 4 .. 9
    tokens = prompt + [11, 2, 8, 5, 6, 13]  # context of 11 tokens: rows up to position 9
    prop.open("r", tokens)
    prop.observe_seed_state("r", len(prompt) - 1, rows)
    drafts = prop.propose("r", tokens, 3)
    # pass 1 over the true entries s = 4..9 (token s + 1 each) predicts the first draft
    passes = head.forward_passes(rows[None], torch.tensor([tokens[5:11]]),
                                 torch.arange(4, 10)[None], depth=1)
    first = int(head.target_ids(head.logits(passes[0][0, -1]).argmax()))
    assert drafts[0] == first
    assert drafts == _fresh(head, rows, len(prompt) - 1, tokens, 3)
    try:
        prop.observe_seed_state("r", 10, torch.randn(1, D, dtype=torch.float64))
    except ValueError as err:
        assert "wide" in str(err)
    else:
        raise AssertionError("a final-norm row was accepted by a fused head")


def test_propose_many_equals_each_request_alone():
    """One batched call for several requests (different prompts, seed states and drafts
    wanted; one with nothing to draft from) drafts what each gets alone, through a commit."""
    from specmesh.drafter.proposer import ProposeCall

    head = _head(4)
    torch.manual_seed(9)
    reqs = {f"r{i}": ([int(x) for x in torch.randint(0, V, (3 + 2 * i,))],
                      torch.randn(8, D, dtype=torch.float64)) for i in range(4)}
    batched = EagleProposer(head_module=head)
    alone = {rid: EagleProposer(head_module=head) for rid in reqs}
    for rid, (ctx, truth) in reqs.items():
        for p in (batched, alone[rid]):
            p.open(rid, ctx)
            if rid != "r3":  # r3 has no seed state: no drafts
                p.observe_seed_state(rid, len(ctx) - 2, truth[:1])
    wanted = {"r0": 1, "r1": 4, "r2": 2, "r3": 3}
    ctxs = {rid: ctx for rid, (ctx, _) in reqs.items()}
    for _ in range(3):  # draft, commit one accepted + bonus, draft on
        calls = [ProposeCall(rid, ctxs[rid], wanted[rid]) for rid in reqs]
        got = batched.propose_many(calls)
        for call, (drafts, rows) in zip(calls, got):
            assert drafts == alone[call.request_id].propose(call.request_id,
                                                             call.context_token_ids,
                                                             call.num_tokens)
            assert rows == [None] * len(drafts)
            assert (len(drafts) == call.num_tokens) == (call.request_id != "r3")
        for (rid, (ctx, truth)), (drafts, _) in zip(reqs.items(), got):
            if not drafts:
                continue
            n = len(ctxs[rid])
            bonus = (drafts[1] + 1) % V if len(drafts) > 1 else drafts[0]
            new = drafts[:1] + ([bonus] if len(drafts) > 1 else [])
            for p in (batched, alone[rid]):
                p.rollback(rid, n + 1)
                p.observe_seed_state(rid, n - 1, truth[n - len(ctx) + 1:n - len(ctx) + 1 + len(new)])
            ctxs[rid] = ctxs[rid] + new


def test_drafter_host_runs_the_head_in_the_cluster_dtype(tiny_model_dir, tmp_path):
    """The drafter role's EAGLE head takes the cluster's dtype unless method_kwargs name one."""
    from helpers.eagle_heads import save_random_head

    from specmesh.cluster.config import ClusterConfig
    from specmesh.cluster.hosts.drafter import build_proposer

    head = save_random_head(tiny_model_dir, tmp_path / "head")
    for dtype, kwargs, want in [("bfloat16", {}, torch.bfloat16),
                                ("float32", {}, torch.float32),
                                ("bfloat16", {"dtype": "float32"}, torch.float32)]:
        cfg = ClusterConfig.create(model=tiny_model_dir, dtype=dtype, device="cpu",
                                   draft_method="eagle",
                                   drafter_method_kwargs={"head": head, **kwargs})
        assert build_proposer(cfg).head.fc.weight.dtype == want


def test_branches_are_the_heads_next_likeliest_tokens_and_what_it_drafts_after_them():
    """propose_branches at a path position: the head's top tokens there other than the path's,
    each with the draft the proposer itself makes on the context extended by that token (the
    sibling entries read the KV as the chain would); nothing is written to the head's state."""
    head = _head(2)
    torch.manual_seed(6)
    prompt = [3, 7, 1, 9, 4, 2]
    truth = torch.randn(8, D, dtype=torch.float64)
    p0 = len(prompt) - 2
    prop = EagleProposer(head_module=head)
    prop.open("r", prompt)
    prop.observe_seed_state("r", p0, truth[:1])
    path = prop.propose("r", prompt, 3)
    st = prop.states["r"]
    entries, n = list(st.entry_tokens), st.kv.length
    from specmesh.drafter.proposer import BranchCall

    calls = [BranchCall("r", prompt + path[:j], path[j], 3) for j in range(2)]
    out = prop.propose_branches(calls)
    assert st.entry_tokens == entries and st.kv.length == n  # a peek writes nothing
    for j, got in enumerate(out):
        ctx = prompt + path[:j]
        g = st.outs[len(ctx) - 2 - st.kv.start]
        order = head.target_ids(head.logits(g[None])[0].argsort(descending=True)).tolist()
        assert order[0] == path[j]  # greedy: the path's token is the top one
        assert list(got) == order[1:4]
        for c, cont in got.items():
            alone = EagleProposer(head_module=head)
            alone.open("r", prompt)
            alone.observe_seed_state("r", p0, truth[:1])
            assert cont == alone.propose("r", ctx + [c], 1), (j, c)
    # a request whose head KV does not reach the context, or an unknown one: no branches
    assert prop.propose_branches([BranchCall("r", prompt + path + [5, 5], 1, 3),
                                  BranchCall("x", prompt, 1, 3)]) == [{}, {}]
