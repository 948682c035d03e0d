"""Exactness (float64, tiny random Llama): speculative greedy == plain greedy, token for token,
through the three in-process workers with real encoded messages
(docs/architecture.md, 'Exactness')."""

import random

import pytest
import torch

from specmesh.cluster.inprocess import InProcessCluster
from helpers.models import hf_greedy, tiny_llama
from helpers.proposers import GarbageProposer, OracleProposer
from specmesh.protocol.messages import SamplingParams

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny():
    hf, model, cfg = tiny_llama(seed=1, dtype=torch.float64, vocab_size=96)
    rng = random.Random(0)
    prompts = [
        [5, 6, 7, 8, 9, 5, 6, 7],
        [1, 2, 3],
        [rng.randrange(96) for _ in range(37)],
        [11, 12, 11, 12, 11, 12, 11],
        [40],
    ]
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return model, cfg, prompts, refs


def _run(model, cfg, prompts, k, **kw):
    c = InProcessCluster(model, cfg, num_speculative_tokens=k, num_kv_blocks=128, block_size=4, **kw)
    # mixed batch: different max_tokens per request
    params = [SamplingParams(max_tokens=MAX_TOKENS - (i % 3)) for i in range(len(prompts))]
    return c, c.generate(prompts, params), params


def test_plain_decode_equals_hf_generate(tiny):
    model, cfg, prompts, refs = tiny
    _, res, params = _run(model, cfg, prompts, 0)
    for r, ref, sp in zip(res, refs, params):
        assert r.token_ids == ref[:sp.max_tokens]
        assert r.finish_reason == "length" and r.spec.num_draft_tokens == 0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_oracle_drafter_is_exact_and_accepts(tiny, k):
    model, cfg, prompts, refs = tiny
    c, res, params = _run(model, cfg, prompts, k, proposer=OracleProposer(prompts, refs))
    for r, ref, sp in zip(res, refs, params):
        assert r.token_ids == ref[:sp.max_tokens]
    st = c.verifier.stats
    assert st.num_accepted_tokens > 0
    # the oracle is always right: every verified draft is accepted
    assert st.num_accepted_tokens == st.num_draft_tokens
    assert st.mean_accept_len > 1 if k > 1 else st.mean_accept_len == 1
    assert st.num_accepted_tokens_per_pos[0] > 0


def test_garbage_drafter_changes_nothing(tiny):
    model, cfg, prompts, refs = tiny
    c, res, params = _run(model, cfg, prompts, 4, proposer=GarbageProposer(cfg.vocab_size))
    for r, ref, sp in zip(res, refs, params):
        assert r.token_ids == ref[:sp.max_tokens]
    assert c.verifier.stats.num_draft_tokens > 0


def test_ngram_drafter_is_exact(tiny):
    model, cfg, prompts, refs = tiny
    c, res, params = _run(model, cfg, prompts, 4)
    for r, ref, sp in zip(res, refs, params):
        assert r.token_ids == ref[:sp.max_tokens]
    assert c.drafter.stats.num_draft_tokens_sent > 0


def test_eos_ends_request_inside_an_accepted_block(tiny):
    model, cfg, prompts, refs = tiny
    # pretend the 6th output token of prompt 0 is EOS: the oracle drafts past it
    eos = refs[0][5]
    first = refs[0].index(eos)
    c = InProcessCluster(model, cfg, num_speculative_tokens=5, num_kv_blocks=128, block_size=4,
                         eos_token_ids=(eos,), proposer=OracleProposer(prompts, refs))
    (r,) = c.generate([prompts[0]], SamplingParams(max_tokens=MAX_TOKENS))
    assert r.token_ids == refs[0][:first + 1]
    assert r.finish_reason == "stop"
    (r,) = c.generate([prompts[0]], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert r.token_ids == refs[0][:MAX_TOKENS]


def test_max_tokens_inside_accepted_block_counts_exactly(tiny):
    model, cfg, prompts, refs = tiny
    c = InProcessCluster(model, cfg, num_speculative_tokens=5, num_kv_blocks=128, block_size=4,
                         proposer=OracleProposer(prompts, refs))
    for n in (1, 2, 3, 7):
        (r,) = c.generate([prompts[1]], SamplingParams(max_tokens=n))
        assert r.token_ids == refs[1][:n] and r.finish_reason == "length"
    # all blocks returned
    assert c.verifier.block_manager.num_free_blocks == 128
    assert c.prefill.block_manager.num_free_blocks == 128
