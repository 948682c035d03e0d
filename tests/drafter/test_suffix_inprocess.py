"""Suffix decoding through the in-process workers (real messages: DraftSync, every
VerifyCommit and DraftClose; trees through tree verification) on a float64 tiny Llama: a
request whose output repeats an earlier request's is drafted from the history and its drafts
are accepted, while every output equals plain decode (greedy and seeded)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.models import tiny_llama

from specmesh.cluster.inprocess import InProcessCluster
from specmesh.drafter.registry import create_proposer
from specmesh.protocol.messages import SamplingParams

VOCAB = 96
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny():
    _, model, cfg = tiny_llama(seed=1, dtype=torch.float64, vocab_size=VOCAB)
    rng = random.Random(0)
    # greedy on these never repeats itself within MAX_TOKENS: nothing to draft from the
    # request alone
    prompts = [[rng.randrange(3, VOCAB) for _ in range(12)] for _ in range(2)]
    return model, cfg, prompts


def _cluster(model, cfg, k, proposer=None):
    return InProcessCluster(model, cfg, num_speculative_tokens=k, num_kv_blocks=128,
                            block_size=4, proposer=proposer)


def test_a_repeated_output_is_drafted_from_the_history_and_equals_plain_greedy(tiny):
    model, cfg, prompts = tiny
    sp = SamplingParams(max_tokens=MAX_TOKENS)
    plain = _cluster(model, cfg, 0)
    want = [list(r.token_ids) for r in plain.generate(prompts, sp)]
    prop = create_proposer("suffix", {})
    c = _cluster(model, cfg, 3, prop)
    first = c.generate(prompts, sp)  # both at once: nothing in the history yet
    assert [r.token_ids for r in first] == want
    assert sum(r.spec.num_accepted_tokens for r in first) == 0
    assert prop.num_draft_tokens["history"] == 0
    # the same prompt again, and another prompt whose output is the rest of the first's
    again = prompts[0]
    longer = prompts[1] + want[1][:6]
    second = c.generate([again, longer], sp)
    assert second[0].token_ids == want[0]
    (tail,) = plain.generate([longer], sp)
    assert second[1].token_ids == tail.token_ids and tail.token_ids[:MAX_TOKENS - 6] == \
        want[1][6:]
    assert all(r.spec.num_accepted_tokens > 0 for r in second)
    assert prop.num_draft_tokens["history"] > 0
    # a cleared history drafts nothing again (the bench clears it between repeats), even for
    # the outputs of requests whose DraftClose the drafter has not handled yet
    pending = set(prop._requests)
    prop.clear_history()
    (cleared,) = c.generate([again], sp)
    assert cleared.token_ids == want[0] and cleared.spec.num_accepted_tokens == 0
    c.drafter.step()  # the last DraftClose
    assert pending and not prop._requests
    assert prop.index_stats()["history_requests"] == 1  # the request after the clear only


def test_seeded_sampling_equals_seeded_plain_decode(tiny):
    model, cfg, prompts = tiny
    sp = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=11 + i)
          for i in range(len(prompts))]
    want = [r.token_ids for r in _cluster(model, cfg, 0).generate(prompts, sp)]
    c = _cluster(model, cfg, 3, create_proposer("suffix", {"tree_width": 3}))
    for _ in range(2):  # the second pass drafts from the first's outputs
        got = c.generate(prompts, sp)
        assert [r.token_ids for r in got] == want
    assert sum(r.spec.num_accepted_tokens for r in got) > 0
