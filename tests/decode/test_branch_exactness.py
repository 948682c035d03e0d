"""DraftBranches end to end (in-process workers, float64 tiny model): a drafter whose path is
always wrong but whose branches hold the right next token gets drafts accepted only through
branches the verifier took at its commits, and the output stays plain greedy decoding."""

import random

import pytest
import torch
from helpers.models import hf_greedy, tiny_llama
from helpers.proposers import BranchOracleProposer

from cluster.inprocess import InProcessCluster
from protocol.messages import SamplingParams

MAX_TOKENS = 16
VOCAB = 96


@pytest.fixture(scope="module")
def tiny():
    hf, model, cfg = tiny_llama(seed=3, dtype=torch.float64, vocab_size=VOCAB)
    rng = random.Random(2)
    prompts = [[5, 6, 7, 8], [rng.randrange(VOCAB) for _ in range(19)], [1, 2, 3, 1, 2]]
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return model, cfg, prompts, refs


@pytest.mark.parametrize("num_branches", [0, 4])
def test_branch_drafts_are_exact_and_only_branches_are_accepted(tiny, num_branches):
    model, cfg, prompts, refs = tiny
    c = InProcessCluster(model, cfg, num_speculative_tokens=3, num_kv_blocks=128, block_size=4,
                         proposer=BranchOracleProposer(prompts, refs, VOCAB),
                         drafter_options={"num_branches": num_branches})
    res = c.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [r.token_ids for r in res] == refs
    st = c.verifier.stats
    if num_branches:
        assert st.num_branch_candidates > 0 and st.num_branch_hits > 0
        assert c.drafter.stats.num_branch_hits > 0
        assert st.num_accepted_tokens > 0  # the path's own drafts are all wrong
    else:
        assert st.num_branch_candidates == st.num_branch_hits == 0
        assert st.num_accepted_tokens == 0
    assert c.verifier.block_manager.num_free_blocks == 128
