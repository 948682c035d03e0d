"""The EAGLE draft seed across P/D (drafter/eagle/prefill_seed.py): a seed made by one proposer
(the prefill's) and adopted by another (the drafter's) gives drafts identical to drafting
without it, for chains, EAGLE-2 trees and a 2-module head, with one head forward fewer; a seed
that does not fit is refused and changes nothing."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from helpers.proposers import NullProposer
from specmesh.drafter.eagle.head import EagleHead, EagleHeadConfig
from specmesh.drafter.proposer import ProposeCall
from specmesh.drafter.proposers.eagle import EagleProposer
from specmesh.drafter.registry import makes_prefill_seed, register_proposer
from specmesh.engine.frames import buffer_to_tensor, tensor_to_buffer
from specmesh.protocol.messages import MAX_DRAFT_SEED_TOPK, DraftSeed

V, D = 40, 32
PROMPT = [3, 7, 1, 9, 4, 12]
FIRST = 11


def _head(seed=0, num_steps=1, dtype=torch.float64, hidden=D):
    torch.manual_seed(seed)
    cfg = EagleHeadConfig(hidden_size=hidden, num_heads=4, num_kv_heads=2, head_dim=8,
                          intermediate_size=48, vocab_size=V, draft_vocab_size=30,
                          num_steps=num_steps)
    head = EagleHead(cfg).to(dtype)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    emb = torch.randn(V, hidden, dtype=dtype)
    head.set_target_weights(emb, emb.clone(), torch.randperm(V)[:30])
    return head.eval()


def _opened(head, ctx, row, **kw):
    p = EagleProposer(head_module=head, **kw)
    p.open("r", ctx)
    p.observe_seed_state("r", len(ctx) - 2, row)
    return p


def _pair(head, **kw):
    """(row, seed made by a prefill-side proposer, drafter with the seed adopted, drafter
    without it)."""
    ctx = PROMPT + [FIRST]
    torch.manual_seed(9)
    row = torch.randn(1, D, dtype=head.fc.weight.dtype)
    prefill = EagleProposer(head_module=head, **kw)
    seed = prefill.make_prefill_seed("r", ctx, row, topk=kw.get("topk", 4))
    assert seed is not None and not prefill.states  # the temporary state is gone
    assert prefill.num_draft_forwards == 1
    seeded, plain = _opened(head, ctx, row, **kw), _opened(head, ctx, row, **kw)
    assert seeded.adopt_prefill_seed("r", ctx, seed)
    assert seeded.num_prefill_seeds_adopted == 1
    assert seeded.draft_stats()["num_prefill_seeds_adopted"] == 1
    return ctx, row, seed, seeded, plain


def test_the_seed_is_the_first_entry():
    head = _head(1)
    ctx, row, seed, seeded, plain = _pair(head)
    assert (seed.position, seed.token_id) == (len(PROMPT) - 1, FIRST)
    assert len(seed.topk_ids) == len(seed.topk_probs) == 4
    assert seed.topk_probs == sorted(seed.topk_probs, reverse=True)
    assert 0 < sum(seed.topk_probs) <= 1 + 1e-6
    assert tuple(seed.draft_hidden.shape) == (1, D)
    assert tuple(seed.draft_kv.shape) == (1, 2, 2, 1, 8)  # [layers, k/v, kv heads, 1, hd]
    # the first greedy draft is the seed's likeliest token
    assert plain.propose("r", ctx, 1) == seed.topk_ids[:1]
    assert EagleProposer.makes_prefill_seed and makes_prefill_seed("eagle")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chain_drafts_identical_with_one_forward_fewer(dtype):
    head = _head(2, dtype=dtype)
    ctx, row, seed, seeded, plain = _pair(head)
    a, b = seeded.propose("r", ctx, 5), plain.propose("r", ctx, 5)
    assert a == b and len(a) == 5
    assert seeded.num_draft_forwards == plain.num_draft_forwards - 1
    # the run-ahead continues, then a commit rolls back and brings true states: still equal
    for p in (seeded, plain):
        p.propose("r", ctx + a, 2)
        p.rollback("r", len(ctx) + 1)
        p.observe_seed_state("r", len(ctx) - 1, torch.ones(2, D, dtype=dtype) * 0.1)
    committed = ctx + a[:1] + [(a[1] + 1) % V]
    assert seeded.propose("r", committed, 4) == plain.propose("r", committed, 4)
    assert seeded.num_draft_forwards == plain.num_draft_forwards - 1


def test_sampled_and_batched_drafts_identical():
    head = _head(3)
    ctx, row, seed, seeded, plain = _pair(head)
    for p in (seeded, plain):  # a second request with no seed, drafted in the same batch
        p.open("s", ctx)
        p.observe_seed_state("s", len(ctx) - 2, row * 0.5)
    calls = [ProposeCall("r", ctx, 4), ProposeCall("s", ctx, 4)]
    assert seeded.propose_many(calls) == plain.propose_many(calls)


@pytest.mark.parametrize("topk,nodes", [(3, 7), (2, 4)])
def test_tree_drafts_identical_with_one_forward_fewer(topk, nodes):
    head = _head(4)
    ctx, row, seed, seeded, plain = _pair(head, topk=topk, tree_nodes=nodes)
    assert len(seed.topk_ids) == topk
    calls = [ProposeCall("r", ctx, 3)]
    (ta, pa, _), = seeded.propose_trees(calls)
    (tb, pb, _), = plain.propose_trees(calls)
    assert (ta, pa) == (tb, pb) and len(ta) > 1
    assert seeded.num_draft_forwards == plain.num_draft_forwards - 1


def test_two_module_head_drafts_identical_with_one_forward_fewer():
    head = _head(5, num_steps=2)
    ctx, row, seed, seeded, plain = _pair(head)
    assert tuple(seed.draft_kv.shape)[0] == head.config.num_layers  # module 0's entry
    a, b = seeded.propose("r", ctx, 4), plain.propose("r", ctx, 4)
    assert a == b and a
    assert seeded.num_draft_forwards == plain.num_draft_forwards - 1
    assert seeded.propose("r", ctx + a[:1], 1) == plain.propose("r", ctx + a[:1], 1)


def test_the_drafts_come_from_the_adopted_entry():
    # a seed made from another row fits (same position, token, shapes) and is adopted as is:
    # the drafts then follow it, so the drafter did not recompute the entry
    head = _head(10)
    ctx, row, _, _, plain = _pair(head)
    other = EagleProposer(head_module=head).make_prefill_seed("r", ctx, row * -3.0, topk=1)
    p = _opened(head, ctx, row)
    assert p.adopt_prefill_seed("r", ctx, other)
    assert p.propose("r", ctx, 4) != plain.propose("r", ctx, 4)


def _unchanged(p):
    st = p.states["r"]
    return st.kv.length == 0 and st.entry_tokens == [] and st.outs == []


def _bad_seeds(seed: DraftSeed):
    replace = msgspec.structs.replace
    h = buffer_to_tensor(seed.draft_hidden).clone()
    h[0, 3] = math.nan
    other = _head(6, hidden=16, dtype=torch.float64)
    alien = EagleProposer(head_module=other).make_prefill_seed(
        "r", PROMPT + [FIRST], torch.randn(1, 16, dtype=torch.float64), 2)
    kv = buffer_to_tensor(seed.draft_kv)
    return {
        "position": replace(seed, position=seed.position - 1),
        "token": replace(seed, token_id=(FIRST + 1) % V),
        "nan": replace(seed, draft_hidden=tensor_to_buffer(h)),
        "other head": alien,
        "float32 kv": replace(seed, draft_kv=tensor_to_buffer(kv.float())),
        "kv shape": replace(seed, draft_kv=tensor_to_buffer(kv[:, :, :1].clone())),
    }


@pytest.mark.parametrize("which", ["position", "token", "nan", "other head", "float32 kv",
                                   "kv shape"])
def test_a_seed_that_does_not_fit_is_refused_and_changes_nothing(which):
    head = _head(7)
    ctx, row, seed, _, plain = _pair(head)
    p = _opened(head, ctx, row)
    assert not p.adopt_prefill_seed("r", ctx, _bad_seeds(seed)[which])
    assert _unchanged(p) and p.num_prefill_seeds_adopted == 0
    assert p.propose("r", ctx, 3) == plain.propose("r", ctx, 3)


def test_refused_on_another_context_or_a_request_with_entries():
    head = _head(8)
    ctx, row, seed, seeded, _ = _pair(head)
    assert not seeded.adopt_prefill_seed("r", ctx, seed)  # it holds the entry already
    p = _opened(head, ctx + [5], torch.randn(2, D, dtype=torch.float64))
    assert not p.adopt_prefill_seed("r", ctx + [5], seed)  # its true states start earlier
    assert not p.adopt_prefill_seed("nobody", ctx, seed)
    assert _unchanged(p)


def test_topk_capped_and_short_context():
    head = _head(9)
    p = EagleProposer(head_module=head)
    row = torch.randn(1, D, dtype=torch.float64)
    seed = p.make_prefill_seed("r", PROMPT + [FIRST], row, topk=100)
    assert len(seed.topk_ids) == MAX_DRAFT_SEED_TOPK == len(set(seed.topk_ids))
    assert p.make_prefill_seed("r", [FIRST], row, topk=4) is None
    with pytest.raises(ValueError):
        p.make_prefill_seed("r", PROMPT + [FIRST], torch.randn(1, D + 1), topk=4)
    assert not p.states


def test_registry_refuses_a_seed_declaration_without_its_methods():
    class NoSeed(NullProposer):
        name = "no-seed-test"
        seed_state = "hidden"
        makes_prefill_seed = True

    with pytest.raises(TypeError, match="make_prefill_seed and adopt_prefill_seed"):
        register_proposer(NoSeed)
    NoSeed.seed_state = ""
    with pytest.raises(TypeError, match="without a seed_state"):
        register_proposer(NoSeed)
