"""Tree verification through the in-process cluster (float64 tiny Llama): drafts reach the
verifier as token trees (DraftTailStream.parents), the verify forward runs them with the tree
mask, the tree rule walks them, the accepted path's KV is compacted, and the output equals
plain decode token for token (greedy; seeded), with drafts accepted through side branches."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.models import hf_greedy, tiny_llama
from helpers.proposers import TreeOracleProposer

from specmesh.cluster.inprocess import InProcessCluster
from specmesh.drafter.proposers.ngram import NgramProposer
from specmesh.protocol.messages import SamplingParams

MAX_TOKENS = 20
VOCAB = 96


@pytest.fixture(scope="module")
def tiny():
    hf, model, cfg = tiny_llama(seed=1, dtype=torch.float64, vocab_size=VOCAB)
    rng = random.Random(0)
    prompts = [
        [5, 6, 7, 8, 9, 5, 6, 7],
        [1, 2, 3],
        [rng.randrange(VOCAB) for _ in range(23)],
        [11, 12, 11, 13, 11, 12, 11],
    ]
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return model, cfg, prompts, refs, hf


def _cluster(model, cfg, k, proposer=None, **kw):
    return InProcessCluster(model, cfg, num_speculative_tokens=k, num_kv_blocks=128,
                            block_size=4, proposer=proposer, **kw)


def test_greedy_tree_drafts_equal_plain_decode_through_side_branches(tiny):
    model, cfg, prompts, refs, _ = tiny
    c = _cluster(model, cfg, 3, TreeOracleProposer(prompts, refs, VOCAB))
    res = c.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    for r, ref in zip(res, refs):
        assert r.token_ids == ref
    st = c.verifier.stats
    assert st.num_tree_verify_steps > 0
    assert st.num_accepted_tokens > 0
    # branch 0 is always wrong: every accepted draft came through branch 1
    assert st.num_tree_side_branch_accepts > 0
    assert st.num_accepted_tokens_per_pos[1] > 0  # paths deeper than one node
    assert c.verifier.block_manager.num_free_blocks == 128


def test_seeded_tree_drafts_equal_seeded_plain_decode(tiny):
    model, cfg, prompts, _, _ = tiny
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=100 + i)
              for i in range(len(prompts))]
    plain = _cluster(model, cfg, 0).generate(prompts, params)
    seeded_refs = [r.token_ids for r in plain]
    c = _cluster(model, cfg, 3, TreeOracleProposer(prompts, seeded_refs, VOCAB))
    res = c.generate(prompts, params)
    assert [r.token_ids for r in res] == seeded_refs
    st = c.verifier.stats
    assert st.num_tree_verify_steps > 0 and st.num_tree_side_branch_accepts > 0


def test_ngram_trees_are_exact(tiny):
    """A long random prompt: every token recurs with several followers, so one-token suffix
    matches give the n-gram proposer trees of up to 3 branches."""
    model, cfg, prompts, refs, _ = tiny
    rng = random.Random(1)
    long_prompt = [rng.randrange(VOCAB) for _ in range(160)]
    hf = tiny[4]
    prompts = prompts + [long_prompt]
    refs = refs + [hf_greedy(hf, long_prompt, MAX_TOKENS)]
    c = _cluster(model, cfg, 4, NgramProposer(min_ngram=1, tree_width=3))
    res = c.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    for r, ref in zip(res, refs):
        assert r.token_ids == ref
    assert c.verifier.stats.num_tree_verify_steps > 0
    assert c.drafter.stats.num_draft_tokens_sent > 0


class _TopTokensTree(TreeOracleProposer):
    """Depth-1 trees of the target's 3 likeliest next tokens for any context (it runs the
    reference model): a sampled run always has trees to verify, and they pass often."""

    name = "top-tokens-tree-test"

    def __init__(self, hf):
        self.hf = hf

    def _top(self, ctx):
        with torch.no_grad():
            return self.hf(torch.tensor([ctx])).logits[0, -1].topk(3).indices.tolist()

    def propose(self, request_id, context_token_ids, num_tokens):
        return []

    def propose_tree(self, request_id, context_token_ids, num_tokens):
        return self._top(context_token_ids), [-1, -1, -1]


def test_unseeded_sampled_tree_run_is_exercised(tiny):
    """Unseeded sampled requests go through tree rejection sampling (its exactness is
    tests/kernels/test_tree_verify.py's chi-square)."""
    model, cfg, prompts, _, hf = tiny
    c = _cluster(model, cfg, 3, _TopTokensTree(hf))
    res = c.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7))
    assert all(len(r.token_ids) == MAX_TOKENS for r in res)
    assert all(0 <= t < VOCAB for r in res for t in r.token_ids)
    st = c.verifier.stats
    assert st.num_tree_verify_steps > 0 and st.num_accepted_tokens > 0


class _HiddenRecordingTreeOracle(TreeOracleProposer):
    """A tree oracle that takes the target's hidden states as seed state and records them by
    absolute position (what an EAGLE drafter would be fed)."""

    name = "tree-oracle-hidden-test"
    seed_state = "hidden"

    def __init__(self, *args):
        super().__init__(*args)
        self.rows = {}

    def observe_seed_state(self, request_id, start_position, hidden):
        for i, row in enumerate(hidden):
            self.rows[(request_id, start_position + i)] = row.clone()


def test_seed_state_rows_follow_the_accepted_path(tiny):
    """The verifier ships, for a tree step, the hidden rows of the root and of the accepted
    nodes (not the chunk's first rows): each equals the target's hidden state at that
    position of the final sequence."""
    from specmesh.engine.kv_cache import KVCache
    from specmesh.engine.runner import ModelRunner

    model, cfg, prompts, refs, _ = tiny
    prompts, refs = prompts[:2], refs[:2]
    oracle = _HiddenRecordingTreeOracle(prompts, refs, VOCAB)
    c = _cluster(model, cfg, 3, oracle)
    res = c.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [r.token_ids for r in res] == refs
    assert c.verifier.stats.num_tree_side_branch_accepts > 0
    runner = ModelRunner(model, cfg, KVCache(cfg, 32, 4, torch.float64))
    checked = 0
    for r, prompt, ref in zip(res, prompts, refs):
        seq = prompt + ref
        _, hidden = runner.prefill(seq, list(range(32)), return_hidden=True)
        for (rid, pos), row in oracle.rows.items():
            if rid == r.request_id and pos >= len(prompt):
                torch.testing.assert_close(row, hidden[pos], atol=1e-9, rtol=0)
                checked += 1
    assert checked >= sum(len(ref) for ref in refs) // 2
