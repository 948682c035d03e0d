"""EAGLE-2 trees from the EAGLE head shipped for SmolLM2-135M-Instruct (drafter/heads/):
float32 greedy output through the in-process workers equals plain decoding on held-out chat
and code prompts, and the trees accept more drafts per verify step than the head's chains."""

import pytest

from helpers.smollm2_heldout import smollm2_heldout
from specmesh.drafter.proposers.eagle import EagleProposer

pytestmark = pytest.mark.slow


def test_shipped_head_trees_equal_plain_decode_and_accept_more_per_step():
    held = smollm2_heldout()
    per_step = {}
    for topk in (1, 4):
        proposer = EagleProposer(model=None, topk=topk, tree_nodes=12)
        cluster = held.cluster(4, draft_method="eagle", proposer=proposer)
        spec = cluster.generate(held.prompts, held.sampling)
        assert [o.token_ids for o in spec] == held.plain
        accepted = sum(o.spec.num_accepted_tokens for o in spec)
        steps = sum(o.spec.num_verify_steps for o in spec)
        assert accepted > 0
        per_step[topk] = accepted / steps
        if topk > 1:
            assert cluster.verifier.stats.num_tree_verify_steps > 0
    assert per_step[4] > per_step[1], per_step
