"""The step profile of the three workers (issue 10): every phase of a verify step is recorded,
forward time is split by whether drafts were carried, and the draft-supply counters add up."""

from __future__ import annotations

import pytest
import torch

from specmesh.cluster.inprocess import InProcessCluster
from helpers.models import hf_greedy, tiny_llama
from specmesh.protocol.messages import SamplingParams
from helpers.proposers import OracleProposer

MAX_TOKENS = 16


def test_profiles_of_an_in_process_run():
    hf, model, cfg = tiny_llama(seed=3, dtype=torch.float64, vocab_size=96)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23]]
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    c = InProcessCluster(model, cfg, num_speculative_tokens=3, block_size=4, num_kv_blocks=64,
                         proposer=OracleProposer(prompts, refs))
    out = c.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in out] == refs

    v = c.verifier.profile.as_dict()
    for phase in ("ingest", "admit", "plan", "forward", "verify", "commit", "send"):
        assert v["phases"][phase]["count"] > 0, phase
    n_steps = c.verifier.stats.num_steps
    assert v["phases"]["forward"]["count"] == v["counters"]["num_steps"] == n_steps
    split = v["phases"]["forward_with_drafts"]["count"] + \
        v["phases"].get("forward_plain", {"count": 0})["count"]
    assert split == n_steps
    cnt = v["counters"]
    assert 0 < cnt["num_request_steps_with_drafts"] <= cnt["num_request_steps_spec_eligible"] \
        <= cnt["num_request_steps"]
    assert cnt["num_steps_with_drafts"] == v["phases"]["forward_with_drafts"]["count"]
    # the oracle drafter's drafts are all accepted: steps carrying drafts verified them
    assert c.verifier.stats.num_accepted_tokens == c.verifier.stats.num_draft_tokens > 0

    d = c.drafter.profile.as_dict()
    assert d["phases"]["commit_to_tail"]["count"] > 0
    assert d["counters"]["num_segments"] == c.drafter.stats.num_segments_sent
    # the parts of each request's time to first token (docs/benchmarks.md, 'Time to first
    # token'): one observation per request, each part within the whole
    for phase in ("ttft_admission_wait", "ttft_prefill", "ttft", "kv_transfer", "kv_ingest"):
        assert v["phases"][phase]["count"] == len(prompts), phase
    assert v["phases"]["ttft_prefill"]["total_ms"] <= v["phases"]["ttft"]["total_ms"]
    assert v["phases"]["ttft"]["total_ms"] == \
        pytest.approx(c.verifier.stats.ttft_seconds_total * 1e3)
    p = c.prefill.profile.as_dict()
    assert p["phases"]["queue_wait"]["count"] == len(prompts)
    # one forward and one send per batch; the two prompts waited together: one batch
    assert p["phases"]["forward"]["count"] == p["phases"]["send_kv"]["count"] \
        == p["counters"]["num_batches"] == 1
    assert p["counters"]["num_batch_prompts"] == len(prompts)
