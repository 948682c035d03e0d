"""Model drafters and a request's penalties and token constraints (drafter/draft_sampling.py,
issue 33 item 3): draft logits are processed with the output before each draft (the history
given plus the call's earlier drafts), greedy requests included (their drafts no longer take
the proposers' plain argmax), for the EAGLE head's batched path and the draft model."""

from __future__ import annotations

import torch
from helpers.models import tiny_llama

from specmesh.drafter.draft_sampling import DraftSampling
from specmesh.drafter.eagle.head import EagleHead, EagleHeadConfig
from specmesh.drafter.proposer import ProposeCall
from specmesh.drafter.proposers.draft_model import DraftModelProposer
from specmesh.drafter.proposers.eagle import EagleProposer
from specmesh.protocol.messages import SamplingParams

V, D, DRAFT_V = 40, 32, 30


def test_choose_processes_with_the_history_and_the_calls_earlier_drafts() -> None:
    logits = torch.zeros(1, 8)
    logits[0, 5] = 1.0
    logits[0, 6] = 0.9
    how = DraftSampling(SamplingParams(presence_penalty=0.5), 3, prompt_token_ids=[1],
                        output_token_ids=[2])
    assert how.processes and how.choose(logits, 0) == (5, None)
    assert how.choose(logits, 1) == (6, None)  # 5 is in the output now: 0.5 < 0.9
    assert how.choose(logits, 2) == (5, None)  # both seen: 0.5 vs 0.4
    assert how.choose(logits, 0) == (5, None)  # a new call from index 0 forgets the others
    assert how.choose(logits, 1) == (6, None)
    seen = DraftSampling(SamplingParams(presence_penalty=0.5), 3, output_token_ids=[5])
    assert seen.choose(logits, 0) == (6, None)
    assert not DraftSampling(SamplingParams(), 0).processes


def _eagle() -> tuple[EagleProposer, list[int]]:
    torch.manual_seed(0)
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


def test_greedy_requests_with_constraints_leave_the_plain_argmax() -> None:
    """allowed_token_ids of one id the drafter can propose: every greedy draft is that id,
    through the EAGLE head's batched path and the draft model, where the plain argmax chain
    differs."""
    prop, ctx = _eagle()
    x = int(prop.head.draft_to_target[3])
    plain = prop.propose("r", ctx, 3)
    sp = SamplingParams(allowed_token_ids=[x])
    ((toks, rows),) = prop.propose_many([ProposeCall("r", ctx, 3, DraftSampling(
        sp, 5, prompt_token_ids=ctx[:3], output_token_ids=ctx[3:]))])
    assert toks == [x] * 3 and rows == [None] * 3 and plain != toks

    _, model, _ = tiny_llama(seed=2, dtype=torch.float64, vocab_size=24)
    dm = DraftModelProposer(dtype="float64", loaded=model, num_blocks=16, block_size=4,
                            target_vocab_size=24)
    dm.open("d", [1, 2, 3])
    plain = dm.propose("d", [1, 2, 3], 4)
    toks, rows = dm.propose_sampled("d", [1, 2, 3], 4, DraftSampling(
        SamplingParams(allowed_token_ids=[7]), 0, prompt_token_ids=[1, 2, 3]))
    assert toks == [7] * 4 and rows == [None] * 4 and plain != toks
