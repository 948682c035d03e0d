"""Issue 9 scenarios 13 and 14 on the verifier: spec stats, per-position acceptance and the
spec_decode counters count only drafts up to the end of the output (EOS, stop token,
max_tokens, or the stop string cut the gateway reports with Abort.num_output_tokens)."""

import pytest
import torch

from specmesh.cluster.inprocess import VERIFIER, InProcessCluster
from helpers.models import hf_greedy, tiny_llama
from helpers.proposers import OracleProposer
from specmesh.protocol.messages import Abort, GenerateRequest, SamplingParams, TokenStream
from specmesh.protocol.spec_stats import SpecStats

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny():
    hf, model, cfg = tiny_llama(seed=1, dtype=torch.float64, vocab_size=96)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [1, 2, 3]]
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return model, cfg, prompts, refs


def _cluster(tiny, **kw):
    model, cfg, prompts, refs = tiny
    return InProcessCluster(model, cfg, num_speculative_tokens=8, num_kv_blocks=128,
                            block_size=4, proposer=OracleProposer(prompts, refs),
                            adaptive_drafts=False, **kw)


def _check_counts(c, r):
    """Every count is bounded by the output: at most one draft per output token after the
    first; the verifier's counters and per-position counts agree with the request's."""
    n_out = len(r.token_ids)
    s, st = r.spec, c.verifier.stats
    assert s.num_accepted_tokens <= s.num_draft_tokens <= n_out - 1
    assert s.num_accepted_tokens <= n_out - 1 - s.num_verify_steps + 1
    assert (st.num_draft_tokens, st.num_accepted_tokens, st.num_verify_steps) == (
        s.num_draft_tokens, s.num_accepted_tokens, s.num_verify_steps)
    assert sum(st.num_accepted_tokens_per_pos) == s.num_accepted_tokens
    assert 0 <= s.acceptance_rate <= 1


@pytest.mark.parametrize("eos_at", [2, 3, 5])
def test_eos_inside_an_accepted_block_cuts_the_spec_stats(tiny, eos_at):
    _, _, prompts, refs = tiny
    eos = refs[0][eos_at]
    first = refs[0].index(eos)
    c = _cluster(tiny, eos_token_ids=(eos,))
    (r,) = c.generate([prompts[0]], SamplingParams(max_tokens=MAX_TOKENS))
    assert r.token_ids == refs[0][:first + 1] and r.finish_reason == "stop"
    _check_counts(c, r)
    # the oracle drafts the true continuation: every draft up to the cut was accepted
    assert r.spec.num_accepted_tokens == r.spec.num_draft_tokens > 0


def test_stop_token_inside_an_accepted_block_cuts_the_spec_stats(tiny):
    _, _, prompts, refs = tiny
    c = _cluster(tiny)
    stop = refs[1][3]
    (r,) = c.generate([prompts[1]], SamplingParams(max_tokens=MAX_TOKENS,
                                                   stop_token_ids=[stop]))
    assert r.token_ids == refs[1][:refs[1].index(stop) + 1]
    _check_counts(c, r)


@pytest.mark.parametrize("n", [2, 5, 9])
def test_max_tokens_cut_counts_only_drafts_up_to_it(tiny, n):
    _, _, prompts, refs = tiny
    c = _cluster(tiny)
    (r,) = c.generate([prompts[1]], SamplingParams(max_tokens=n))
    assert r.token_ids == refs[1][:n]
    _check_counts(c, r)


def test_abort_with_the_kept_length_cuts_the_spec_stats(tiny):
    """A stop string ended the output after ``keep`` tokens (the gateway found it); the
    verifier had committed more: its counters count only drafts up to the cut."""
    _, _, prompts, refs = tiny
    c = _cluster(tiny)
    c.client.send(VERIFIER, GenerateRequest(request_id="s", prompt_token_ids=prompts[1],
                                           sampling=SamplingParams(max_tokens=MAX_TOKENS)))
    while len(c.verifier.requests.get("s").output_token_ids if "s" in c.verifier.requests
              else []) < 12:
        c.drafter.step()
        c.prefill.step()
        c.verifier.step()
    req = c.verifier.requests["s"]
    steps = list(req.spec_steps)
    assert steps and req.committed_len >= 12
    keep = 4
    c.client.send(VERIFIER, Abort(request_id="s", reason="stop string", num_output_tokens=keep))
    c.verifier.step()
    final = [e.msg for e in c.client.drain() if isinstance(e.msg, TokenStream)][-1]
    assert final.finished and final.finish_reason == "abort"
    want = SpecStats()
    for start, n, d, a in steps:
        if start < keep:
            want.observe(*SpecStats.cut_step(d, a, keep - start) if start + n > keep else (d, a))
    st = c.verifier.stats
    got = (final.num_draft_tokens, final.num_accepted_tokens, final.num_verify_steps)
    assert got == (want.num_draft_tokens, want.num_accepted_tokens, want.num_verify_steps)
    assert (st.num_draft_tokens, st.num_accepted_tokens, st.num_verify_steps) == got
    assert want.num_accepted_tokens <= keep - 1
    assert sum(st.num_accepted_tokens_per_pos) == want.num_accepted_tokens
