"""Predicted Outputs through the three in-process workers (tiny random Llama, float64, real
encoded messages): the output equals plain decode whatever the prediction (greedy token for
token; seeded sampled requests equal their speculation-off output), and the verifier's
accepted + rejected prediction tokens are the prediction drafts it verified."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.models import tiny_llama
from helpers.proposers import OracleProposer
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.protocol.messages import SamplingParams

MAX_TOKENS = 40
VOCAB = 96


@pytest.fixture(scope="module")
def tiny():
    _, model, cfg = tiny_llama(seed=1, dtype=torch.float64, vocab_size=VOCAB)
    rng = random.Random(0)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [rng.randrange(VOCAB) for _ in range(21)], [40]]
    plain = InProcessCluster(model, cfg, num_speculative_tokens=0, num_kv_blocks=128,
                             block_size=4)
    refs = [r.token_ids for r in plain.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]
    return model, cfg, prompts, refs, plain


def _cluster(model, cfg, **kw) -> InProcessCluster:
    return InProcessCluster(model, cfg, num_speculative_tokens=8, num_kv_blocks=128,
                            block_size=4, **kw)


def _edited(ref: list[int], seed: int) -> list[int]:
    """``ref`` with a few edits: two tokens replaced, three inserted, two deleted."""
    rng = random.Random(seed)
    out = list(ref)
    for i in (8, 25):
        out[i] = (out[i] + 1 + rng.randrange(VOCAB - 1)) % VOCAB
    out[15:15] = [rng.randrange(VOCAB) for _ in range(3)]
    del out[32:34]
    return out


def test_a_prediction_equal_to_the_output_is_accepted_and_exact(tiny):
    model, cfg, prompts, refs, _ = tiny
    # the method drafts nothing: every verified draft is a prediction draft
    c = _cluster(model, cfg, proposer=OracleProposer([], []))
    res = c.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), predictions=refs)
    for r, ref in zip(res, refs):
        assert r.token_ids == ref
        assert r.num_accepted_prediction_tokens > len(ref) // 2
        assert r.num_rejected_prediction_tokens == 0  # nothing past the end is counted
        assert r.num_accepted_prediction_tokens == r.spec.num_accepted_tokens
        assert r.num_accepted_prediction_tokens + r.num_rejected_prediction_tokens \
            == r.spec.num_draft_tokens


def test_an_edited_prediction_keeps_the_output_and_counts_rejections(tiny):
    model, cfg, prompts, refs, _ = tiny
    c = _cluster(model, cfg, proposer=OracleProposer([], []))
    preds = [_edited(ref, i) for i, ref in enumerate(refs)]
    res = c.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), predictions=preds)
    for r, ref in zip(res, refs):
        assert r.token_ids == ref
        assert r.num_accepted_prediction_tokens > 0 and r.num_rejected_prediction_tokens > 0
        assert r.num_accepted_prediction_tokens == r.spec.num_accepted_tokens
        assert r.num_accepted_prediction_tokens + r.num_rejected_prediction_tokens \
            == r.spec.num_draft_tokens
    assert c.drafter.stats.num_prediction_tokens_sent >= sum(
        r.num_accepted_prediction_tokens + r.num_rejected_prediction_tokens for r in res)


def test_the_method_drafts_where_the_prediction_has_nothing(tiny):
    model, cfg, prompts, refs, _ = tiny
    # the prediction covers the first half only; ngram (trees included) drafts the rest
    c = _cluster(model, cfg)
    preds = [ref[:len(ref) // 2] for ref in refs]
    res = c.generate(prompts + prompts, SamplingParams(max_tokens=MAX_TOKENS),
                     predictions=preds + [None] * len(prompts))
    for r, ref in zip(res, refs + refs):
        assert r.token_ids == ref
    for r in res[:len(prompts)]:
        assert 0 < r.num_accepted_prediction_tokens <= r.spec.num_accepted_tokens
        assert r.num_accepted_prediction_tokens + r.num_rejected_prediction_tokens \
            <= r.spec.num_draft_tokens
    for r in res[len(prompts):]:  # no prediction: nothing counted
        assert r.num_accepted_prediction_tokens == r.num_rejected_prediction_tokens == 0


def test_sampled_requests_follow_the_target(tiny):
    model, cfg, prompts, refs, plain = tiny
    seeded = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=11 + i)
              for i in range(len(prompts))]
    want = [r.token_ids for r in plain.generate(prompts, seeded)]
    c = _cluster(model, cfg, proposer=OracleProposer([], []))
    # seeded (the coupled rule): speculation on equals speculation off, token for token
    res = c.generate(prompts, seeded, predictions=want)
    assert [r.token_ids for r in res] == want
    assert sum(r.num_accepted_prediction_tokens for r in res) > 0
    # unseeded sampled: prediction drafts go one-hot through the rejection rule
    unseeded = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8)
    res = c.generate(prompts, unseeded, predictions=want)
    for r in res:
        assert len(r.token_ids) == MAX_TOKENS
        assert r.num_accepted_prediction_tokens + r.num_rejected_prediction_tokens \
            == r.spec.num_draft_tokens


def test_a_prediction_outside_the_vocabulary_or_too_long_is_refused(tiny):
    model, cfg, prompts, _, _ = tiny
    c = _cluster(model, cfg)
    (bad,) = c.generate(prompts[:1], SamplingParams(max_tokens=4), predictions=[[1, VOCAB]])
    assert bad.finish_reason == "invalid" and "prediction token ids" in bad.error
    too_long = [1] * (c.verifier.config.max_model_len + 1)
    (bad,) = c.generate(prompts[:1], SamplingParams(max_tokens=4), predictions=[too_long])
    assert bad.finish_reason == "invalid" and "prediction has" in bad.error


@pytest.mark.parametrize("edited", [False, True])
def test_prediction_drafts_are_verified_past_kappa(tiny, edited):
    """kappa 2: a run of prediction drafts that keeps matching is verified up to
    num_prediction_tokens wide (an exact prediction: a mean accept length above kappa,
    impossible within it; an edited one: longer than with kappa, the width restarting at kappa
    after each edit's rejected draft); the output stays plain decode's and accepted + rejected
    = drafts."""
    model, cfg, prompts, refs, _ = tiny
    preds = [_edited(ref, i) if edited else ref for i, ref in enumerate(refs)]
    sp = SamplingParams(max_tokens=MAX_TOKENS)
    means = {}
    for width in (0, 12):
        c = InProcessCluster(model, cfg, num_speculative_tokens=2, num_kv_blocks=128,
                             block_size=4, proposer=OracleProposer([], []),
                             num_prediction_tokens=width)
        res = c.generate(prompts, sp, predictions=preds)
        for r, ref in zip(res, refs):
            assert r.token_ids == ref
            assert r.num_accepted_prediction_tokens + r.num_rejected_prediction_tokens \
                == r.spec.num_draft_tokens
        means[width] = sum(r.spec.num_accepted_tokens for r in res) / sum(
            r.spec.num_verify_steps for r in res)
    assert means[0] <= 2 and means[0] < means[12]
    assert edited or means[12] > 2
