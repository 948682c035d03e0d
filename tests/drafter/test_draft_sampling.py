"""Drafting for the request's sampling (drafter/draft_sampling.py) with the EAGLE head and the
draft model: greedy drafts are the argmax chain (no rows); seeded drafts are the coupled rule's
Gumbel-max of the processed draft distribution at each output position (no rows); unseeded
sampled drafts come with the processed distribution they were drawn from, a float32 row over
the target's ids (zero outside the head's draft vocabulary), and follow it."""

from __future__ import annotations

import pytest
import torch
from helpers.models import tiny_llama

from specmesh.drafter.draft_sampling import DraftSampling, target_space_logits
from specmesh.drafter.eagle.head import EagleHead, EagleHeadConfig
from specmesh.drafter.proposers.draft_model import DraftModelProposer
from specmesh.drafter.proposers.eagle import EagleProposer
from specmesh.engine.sampling import processed_probs, seeds_tensor
from specmesh.kernels.coupled_sample import gumbel_sample
from specmesh.protocol.messages import SamplingParams

V, D, DRAFT_V = 40, 32, 30


def _eagle(seed: int = 0) -> tuple[EagleProposer, list[int]]:
    torch.manual_seed(seed)
    cfg = EagleHeadConfig(hidden_size=D, num_heads=4, num_kv_heads=2, head_dim=8,
                          intermediate_size=48, vocab_size=V, draft_vocab_size=DRAFT_V)
    head = EagleHead(cfg).double()
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    emb = torch.randn(V, D, dtype=torch.float64)
    head.set_target_weights(emb, emb.clone(), torch.randperm(V)[:DRAFT_V])
    prop = EagleProposer(head_module=head.eval())
    ctx = [3, 7, 1, 9, 4, 11]
    prop.open("r", ctx)
    prop.observe_seed_state("r", len(ctx) - 2, torch.randn(1, D, dtype=torch.float64))
    return prop, ctx


def test_eagle_greedy_and_seeded_drafts_carry_no_rows_and_follow_their_rule():
    prop, ctx = _eagle()
    greedy = prop.propose("r", ctx, 3)
    toks, rows = prop.propose_sampled("r", ctx, 3, DraftSampling(SamplingParams(), 5))
    assert toks == greedy and rows == [None] * 3
    sp = SamplingParams(temperature=0.9, top_k=12, seed=42)
    toks, rows = prop.propose_sampled("r", ctx, 1, DraftSampling(sp, 5))
    assert rows == [None]
    head = prop.head
    g = prop.states["r"].last_g  # the state the first draft came from
    full = target_space_logits(head.logits(g).reshape(1, -1), V, head.draft_to_target)
    want = gumbel_sample(processed_probs(full, [sp]).contiguous(), seeds_tensor([sp], "cpu"),
                         torch.tensor([5]))
    assert toks == [int(want[0])]


def test_eagle_sampled_drafts_come_with_their_distribution():
    prop, ctx = _eagle(1)
    sp = SamplingParams(temperature=1.0, top_p=0.9)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    row0 = None
    for _ in range(400):
        toks, rows = prop.propose_sampled("r", ctx, 1, DraftSampling(sp, 5, gen))
        (row,) = rows
        assert row.dtype == torch.float32 and row.shape == (V,)
        assert float(row[toks[0]]) > 0
        row0 = row if row0 is None else row0
        assert torch.equal(row, row0)  # same context, same distribution
        counts[toks[0]] += 1
    outside = torch.ones(V, dtype=torch.bool)
    outside[prop.head.draft_to_target] = False
    assert float(row0.sum()) == pytest.approx(1.0, abs=1e-5) and float(row0[outside].sum()) == 0.0
    # the samples follow the row: total variation well below what another row would give
    assert float((counts / 400 - row0).abs().sum()) / 2 < 0.15


def test_draft_model_rows_cover_the_target_vocabulary():
    _, model, _ = tiny_llama(seed=2, dtype=torch.float64, vocab_size=24)
    prop = DraftModelProposer(dtype="float64", loaded=model, num_blocks=16, block_size=4,
                              target_vocab_size=24)
    sp = SamplingParams(temperature=0.7, min_p=0.05)
    toks, rows = prop.propose_sampled("r", [1, 2, 3, 4], 3,
                                      DraftSampling(sp, 2, torch.Generator().manual_seed(1)))
    assert len(toks) == 3 and all(r is not None and r.shape == (24,) for r in rows)
    assert all(float(r[t]) > 0 for t, r in zip(toks, rows))
    off = DraftSampling(sp, 2, torch.Generator().manual_seed(1), with_probs=False)
    toks2, rows2 = prop.propose_sampled("r", [1, 2, 3, 4], 3, off)
    assert rows2 == [None] * 3 and toks2 == toks  # same generator state, same samples



def test_token_probs_is_the_softmax_at_the_token():
    from specmesh.drafter.draft_sampling import token_probs

    logits = torch.tensor([[0.0, 1.0, 2.0], [5.0, -1.0, 0.5]], dtype=torch.float64)
    ids = [2, 0]
    want = torch.softmax(logits, -1)[torch.arange(2), torch.tensor(ids)].tolist()
    assert token_probs(logits, ids) == pytest.approx(want, rel=1e-6)


def test_greedy_choice_with_token_probs_keeps_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    plain = DraftSampling(SamplingParams(max_tokens=4), 0)
    scored = DraftSampling(SamplingParams(max_tokens=4), 0, token_probs=True)
    assert plain.choose(logits, 0) == (1, None)
    tok, q = scored.choose(logits, 0)
    assert tok == 1 and q == pytest.approx(torch.softmax(logits[0], -1)[1].item())
