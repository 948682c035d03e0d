"""The DSpark proposer (drafter/proposers/dspark.py) on a tiny float64 Llama with a random
Markov head: one block forward, then the walk; drafts equal a reference built from a plain
causal forward over [context, MASK x (k-1)] walked by the head (and differ from PARD's
drafts: the correction is active); every row carries a confidence in [0, 1]; a greedy draft's
probability and a sampled draft's row are the softmax of the corrected logits (at the
request's temperature) given the drafts before it; batched proposes equal single ones; the
stats report the weights and KV pool bytes."""

from __future__ import annotations

import pytest
import torch

from specmesh.drafter.draft_sampling import DraftSampling
from specmesh.drafter.dspark_markov import MARKOV_KINDS, MarkovHead, markov_walk
from specmesh.drafter.head_confidences import WithConfidence, split_confidences
from specmesh.drafter.proposer import ProposeCall
from specmesh.drafter.proposers.dspark import DSparkProposer
from specmesh.drafter.proposers.pard import PardProposer
from specmesh.protocol.messages import SamplingParams
from helpers.models import tiny_llama

MASK = 126
BLOCK = 4
VOCAB = 128


@pytest.fixture(scope="module")
def models():
    return tiny_llama(seed=4, dtype=torch.float64, vocab_size=VOCAB)


def _head(kind: str = "gated", seed: int = 0) -> MarkovHead:
    torch.manual_seed(seed)
    head = MarkovHead(kind, 64, 8, VOCAB)
    with torch.no_grad():
        head.to_vocab.weight.normal_(0, 3.0)  # strong enough to change drafts
    return head


def _proposer(models, kind: str = "gated", **kw) -> DSparkProposer:
    _, ours, cfg = models
    return DSparkProposer(ours, cfg, _head(kind), MASK, BLOCK, num_blocks=64, block_size=4,
                          **kw)


def _reference(models, head: MarkovHead, ctx: list[int], n: int):
    """The walk over a plain causal forward's last n rows (mask logit -inf)."""
    hf, ours, _ = models
    with torch.no_grad():
        out = hf.model(input_ids=torch.tensor([ctx + [MASK] * (n - 1)]))
        hidden = out.last_hidden_state[:, -n:]
        logits = hf.lm_head(hidden).float()
    logits[..., MASK] = float("-inf")
    return markov_walk(head.float(), logits, hidden, ours.model.embed_tokens.weight,
                       torch.tensor([ctx[-1]]))


def _ctx(seed: int, n: int) -> list[int]:
    return torch.randint(0, 120, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", MARKOV_KINDS)
def test_greedy_drafts_are_the_walk_of_one_block_forward(models, kind):
    p = _proposer(models, kind)
    ctx = _ctx(0, 9)
    drafts, rows = p.propose_many([ProposeCall("r", ctx, 3)])[0]
    ref = _reference(models, p.head, ctx, 3)
    assert drafts == ref.tokens[0].tolist()
    assert p.stats.num_block_forwards == 1 and p.stats.num_forwards == 1
    assert p.stats.num_markov_steps == 3
    plain, conf = split_confidences(rows)
    assert plain == [None] * 3
    assert conf == pytest.approx(ref.confidences[0].tolist(), abs=1e-5)
    assert all(0.0 <= c <= 1.0 for c in conf)


def test_the_markov_correction_changes_drafts_against_pard(models):
    _, ours, cfg = models
    differ = 0
    for s in range(6):
        ctx = _ctx(20 + s, 8)
        pard = PardProposer(ours, cfg, MASK, BLOCK, num_blocks=64, block_size=4)
        differ += pard.propose("r", ctx, BLOCK) != _proposer(models).propose("r", ctx, BLOCK)
    assert differ > 0


def test_batched_proposes_equal_single_ones(models):
    p = _proposer(models, "rnn")
    ctxs = [_ctx(10 + i, 5 + 3 * i) for i in range(3)]
    out = p.propose_many([ProposeCall(f"r{i}", c, 2 + i) for i, c in enumerate(ctxs)])
    assert p.stats.num_block_forwards == 1
    for i, c in enumerate(ctxs):
        assert out[i][0] == _proposer(models, "rnn").propose(f"x{i}", c, 2 + i)
        assert len(split_confidences(out[i][1])[1]) == 2 + i


def test_greedy_token_probs_are_the_corrected_softmax(models):
    p = _proposer(models)
    ctx = _ctx(3, 7)
    how = DraftSampling(SamplingParams(temperature=0.0, max_tokens=8), first_position=0,
                        token_probs=True)
    drafts, rows = p.propose_sampled("r", ctx, BLOCK, how)
    ref = _reference(models, p.head, ctx, BLOCK)
    assert drafts == ref.tokens[0].tolist()
    q, conf = split_confidences(rows)
    want = torch.softmax(ref.logits[0], -1)[torch.arange(BLOCK), ref.tokens[0]]
    assert q == pytest.approx(want.tolist(), abs=1e-5)
    assert len(conf) == BLOCK


def test_sampled_rows_are_the_corrected_distribution_at_the_temperature(models):
    p = _proposer(models)
    ctx = _ctx(5, 6)
    how = DraftSampling(SamplingParams(temperature=0.7, max_tokens=8), first_position=0,
                        generator=torch.Generator().manual_seed(3), with_probs=True)
    drafts, rows = p.propose_sampled("r", ctx, 3, how)
    rows, conf = split_confidences(rows)
    assert len(drafts) == len(rows) == len(conf) == 3
    hf, ours, _ = models
    with torch.no_grad():
        out = hf.model(input_ids=torch.tensor([ctx + [MASK] * 2]))
        hidden = out.last_hidden_state[0, -3:]
        base = hf.lm_head(hidden).float()
    base[:, MASK] = float("-inf")
    prev, state = ctx[-1], None
    emb = ours.model.embed_tokens.weight
    for j, (d, row) in enumerate(zip(drafts, rows)):
        z, state = p.head.step(hidden[j:j + 1].float(), emb[prev][None].float(), state)
        corrected = base[j] + p.head.bias(z)[0]
        want = torch.softmax(corrected / 0.7, -1)
        assert row.shape == (VOCAB,) and row[d] > 0 and row[MASK] == 0
        assert torch.allclose(row, want, atol=1e-5)
        prev = d  # the next position is biased by the sampled draft


def test_confidences_can_be_turned_off(models):
    p = _proposer(models, confidence=False)
    drafts, rows = p.propose_many([ProposeCall("r", _ctx(1, 6), 3)])[0]
    assert len(drafts) == 3 and not any(isinstance(r, WithConfidence) for r in rows)
    assert not p.returns_draft_confidences


def test_stats_report_weights_and_kv_pool_bytes(models):
    p = _proposer(models)
    _, ours, _ = models
    params = {x.data_ptr(): x.numel() * x.element_size() for x in ours.parameters()}
    assert p.draft_weights_bytes >= sum(params.values()) + p.head.num_bytes()
    assert p.draft_kv_pool_bytes == p.kv_cache.data.numel() * 8  # float64
    assert p.draft_kv_pool_bytes > 0


def test_a_head_of_another_width_is_refused(models):
    _, ours, cfg = models
    with pytest.raises(ValueError, match="does not fit the draft"):
        DSparkProposer(ours, cfg, MarkovHead("vanilla", 32, 4, VOCAB), MASK, BLOCK,
                       num_blocks=4)
