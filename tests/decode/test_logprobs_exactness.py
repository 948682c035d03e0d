"""Logprobs through the three in-process workers (float32 tiny random Llama, real encoded
messages; issue 33 item 1): the verifier reports, for every output token, the float32
log_softmax of the target's logits at its position, and the prefill role those of the first
token and of the prompt. So with speculation on (k = 4 and 8, drafts accepted) they equal
speculation off within 1e-5, and both equal a reference forward (Hugging Face, the same
weights) over prompt + output: what makes a loglikelihood right."""

from __future__ import annotations

import pytest
import torch

from specmesh.cluster.inprocess import InProcessCluster
from helpers.models import hf_greedy, tiny_llama
from helpers.proposers import GarbageProposer, OracleProposer, TreeOracleProposer
from specmesh.protocol.messages import SamplingParams, TokenLogprobs

MAX_TOKENS = 20
TOP = 5


@pytest.fixture(scope="module")
def tiny():
    hf, model, cfg = tiny_llama(seed=3, dtype=torch.float32, vocab_size=96)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [1, 2, 3, 1, 2, 3, 1], [40, 41]]
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return hf, model, cfg, prompts, refs


def _run(tiny, k, proposer=None, **sampling):
    hf, model, cfg, prompts, refs = tiny
    c = InProcessCluster(model, cfg, num_speculative_tokens=k, num_kv_blocks=128, block_size=4,
                         proposer=proposer)
    sp = SamplingParams(max_tokens=MAX_TOKENS, logprobs=TOP, prompt_logprobs=TOP, **sampling)
    return c, c.generate(prompts, sp)


def _flat(res) -> TokenLogprobs:
    return TokenLogprobs.concat(res.logprobs)


def _reference(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """float32 log_softmax of HF's logits over prompt + output: row i predicts token i + 1."""
    x = torch.tensor([prompt + output])
    with torch.inference_mode():
        logits = hf(x).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("k", [4, 8])
def test_logprobs_spec_on_equal_spec_off_and_a_reference_forward(tiny, k):
    hf, _, _, prompts, refs = tiny
    _, off = _run(tiny, 0)
    c, on = _run(tiny, k, proposer=OracleProposer(prompts, refs))
    assert c.verifier.stats.num_accepted_tokens > 0  # speculation stayed on
    for p, a, b, ref in zip(prompts, off, on, refs):
        assert a.token_ids == b.token_ids == ref
        la, lb = _flat(a), _flat(b)
        assert len(la) == len(lb) == MAX_TOKENS
        torch.testing.assert_close(torch.tensor(la.token_logprobs),
                                   torch.tensor(lb.token_logprobs), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(la.top_logprobs), torch.tensor(lb.top_logprobs),
                                   atol=1e-5, rtol=0)
        assert la.top_token_ids == lb.top_token_ids
        # the reference forward over the same tokens
        lp = _reference(hf, p, a.token_ids)
        n = len(p)
        want = lp[torch.arange(n - 1, n - 1 + MAX_TOKENS), torch.tensor(a.token_ids)]
        torch.testing.assert_close(torch.tensor(lb.token_logprobs), want, atol=1e-4, rtol=0)
        top = lp[n - 1:n - 1 + MAX_TOKENS].topk(TOP, dim=-1)
        torch.testing.assert_close(torch.tensor(lb.top_logprobs), top.values, atol=1e-4, rtol=0)
        # greedy: the chosen token is the most likely one
        assert [t[0] for t in lb.top_token_ids] == a.token_ids
        # the prompt's, from the prefill role: positions 1 .. n-1
        for res in (a, b):
            pl = res.prompt_logprobs
            assert pl is not None and len(pl) == n - 1
            want = lp[torch.arange(n - 1), torch.tensor(p[1:])]
            torch.testing.assert_close(torch.tensor(pl.token_logprobs), want, atol=1e-4, rtol=0)
            assert len(pl.top_token_ids[0]) == TOP


def test_garbage_drafts_do_not_leak_into_logprobs(tiny):
    """A drafter whose drafts are rejected: the logprobs are still the target's (equal to
    speculation off), never the drafter's."""
    _, off = _run(tiny, 0)
    c, on = _run(tiny, 4, proposer=GarbageProposer(96, seed=1))
    assert c.verifier.stats.num_draft_tokens > 0
    for a, b in zip(off, on):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(_flat(a).token_logprobs),
                                   torch.tensor(_flat(b).token_logprobs), atol=1e-5, rtol=0)


def test_seeded_sampled_logprobs_spec_on_equal_spec_off(tiny):
    """A seeded sampled request: the same tokens and logprobs with speculation on or off;
    the logprobs are the raw model's (before temperature / top-k), so they equal the reference
    forward's on the sampled tokens."""
    hf, _, _, prompts, _ = tiny
    kw = {"temperature": 0.8, "top_k": 20, "seed": 11}
    _, off = _run(tiny, 0, **kw)
    # an oracle that drafts the seeded output: the coupled rule accepts it
    c, on = _run(tiny, 4, proposer=OracleProposer(prompts, [r.token_ids for r in off]), **kw)
    assert c.verifier.stats.num_accepted_tokens > 0
    for p, a, b in zip(prompts, off, on):
        assert a.token_ids == b.token_ids
        la, lb = _flat(a), _flat(b)
        torch.testing.assert_close(torch.tensor(la.token_logprobs),
                                   torch.tensor(lb.token_logprobs), atol=1e-5, rtol=0)
        lp = _reference(hf, p, a.token_ids)
        n = len(p)
        want = lp[torch.arange(n - 1, n - 1 + len(a.token_ids)), torch.tensor(a.token_ids)]
        torch.testing.assert_close(torch.tensor(lb.token_logprobs), want, atol=1e-4, rtol=0)


def test_requests_without_logprobs_get_none(tiny):
    _, model, cfg, prompts, _ = tiny
    c = InProcessCluster(model, cfg, num_speculative_tokens=4, num_kv_blocks=128, block_size=4)
    res = c.generate(prompts[:1], SamplingParams(max_tokens=8))
    assert res[0].logprobs == [] and res[0].prompt_logprobs is None
    assert len(res[0].token_ids) == 8


def test_logprobs_zero_reports_the_chosen_token_only(tiny):
    _, model, cfg, prompts, _ = tiny
    c = InProcessCluster(model, cfg, num_speculative_tokens=4, num_kv_blocks=128, block_size=4)
    res = c.generate(prompts[:1], SamplingParams(max_tokens=8, logprobs=0))
    lp = _flat(res[0])
    assert len(lp) == 8 and lp.top_token_ids == [[]] * 8
    assert all(x <= 0 for x in lp.token_logprobs)
    assert res[0].prompt_logprobs is None


def test_tree_drafts_take_the_accepted_nodes_rows(tiny):
    """Draft trees accepted through side branches: each token's logprob comes from the row
    of the node that chose it, so they equal speculation off."""
    _, off = _run(tiny, 0)
    _, _, _, prompts, refs = tiny
    c, on = _run(tiny, 3, proposer=TreeOracleProposer(prompts, refs, 96))
    st = c.verifier.stats
    assert st.num_tree_verify_steps > 0 and st.num_tree_side_branch_accepts > 0
    for a, b in zip(off, on):
        assert a.token_ids == b.token_ids
        la, lb = _flat(a), _flat(b)
        torch.testing.assert_close(torch.tensor(la.token_logprobs),
                                   torch.tensor(lb.token_logprobs), atol=1e-5, rtol=0)
        assert la.top_token_ids == lb.top_token_ids


def test_prompt_logprobs_with_prefix_caching(tiny):
    """A prompt whose blocks the prefill worker has cached still gets every prompt position's
    logprobs (it is run whole), equal to the first time's."""
    _, model, cfg, prompts, _ = tiny
    c = InProcessCluster(model, cfg, num_speculative_tokens=4, num_kv_blocks=128, block_size=4,
                         prefill_options={"enable_prefix_caching": True})
    prompt = prompts[0] * 2  # 16 tokens: 4 full blocks to cache
    sp = SamplingParams(max_tokens=4, prompt_logprobs=3)
    (first,) = c.generate([prompt], sp)
    plain = c.generate([prompt], SamplingParams(max_tokens=4))  # no prompt logprobs: reuses
    assert c.prefill.stats.prefix_cache_hits > 0
    (again,) = c.generate([prompt], sp)
    assert again.token_ids == first.token_ids == plain[0].token_ids
    assert len(again.prompt_logprobs) == len(prompt) - 1
    assert again.prompt_logprobs.token_logprobs == first.prompt_logprobs.token_logprobs


@pytest.mark.parametrize("chunk", [3, 5])
def test_prompt_logprobs_of_a_chunked_prefill(tiny, chunk):
    """A prompt longer than the prefill chunk: its logprobs are taken chunk by chunk and equal
    the reference forward's; the first token and its logprobs are the unchunked run's."""
    hf, model, cfg, prompts, _ = tiny
    prompt = prompts[0] + prompts[1]  # 15 tokens
    sp = SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=2)
    runs = [InProcessCluster(model, cfg, num_speculative_tokens=0, num_kv_blocks=128,
                             block_size=4, prefill_chunk_size=c).generate([prompt], sp)[0]
            for c in (chunk, 512)]
    assert runs[0].token_ids == runs[1].token_ids
    lp = _reference(hf, prompt, runs[0].token_ids)
    want = lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    for r in runs:
        assert len(r.prompt_logprobs) == len(prompt) - 1
        torch.testing.assert_close(torch.tensor(r.prompt_logprobs.token_logprobs), want,
                                   atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(runs[0].prompt_logprobs.token_logprobs),
                               torch.tensor(runs[1].prompt_logprobs.token_logprobs),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(_flat(runs[0]).token_logprobs),
                               torch.tensor(_flat(runs[1]).token_logprobs), atol=1e-5, rtol=0)
