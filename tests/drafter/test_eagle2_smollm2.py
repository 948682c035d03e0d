"""EAGLE-2 trees from the EAGLE head shipped for SmolLM2-135M-Instruct (drafter/heads/):
float32 greedy output through the in-process workers equals plain decoding on held-out chat
and code prompts, and the trees accept more drafts per verify step than the head's chains."""

import pytest

from specmesh.cluster.inprocess import InProcessCluster
from specmesh.data.prompts import load_prompts_file
from specmesh.drafter.eagle.data import chat_token_ids
from specmesh.drafter.proposers.eagle import EagleProposer
from specmesh.drafter.training.eagle import PROMPTS_DIR
from specmesh.engine.loader import load_model
from specmesh.protocol.messages import SamplingParams

pytestmark = pytest.mark.slow


def test_shipped_head_trees_equal_plain_decode_and_accept_more_per_step():
    lm = load_model(None, "float32")
    chat = load_prompts_file(str(PROMPTS_DIR / "drafter_heldout_chat.jsonl"))[:2]
    code = load_prompts_file(str(PROMPTS_DIR / "drafter_heldout_code.jsonl"))[:2]
    prompts = chat_token_ids(lm.tokenizer, chat + code)
    sp = SamplingParams(max_tokens=32)
    eos = lm.config.eos_token_ids
    plain = InProcessCluster(lm.model, lm.config, num_speculative_tokens=0,
                             eos_token_ids=eos).generate(prompts, sp)
    per_step = {}
    for topk in (1, 4):
        proposer = EagleProposer(model=None, topk=topk, tree_nodes=12)
        cluster = InProcessCluster(lm.model, lm.config, num_speculative_tokens=4,
                                   eos_token_ids=eos, draft_method="eagle", proposer=proposer)
        spec = cluster.generate(prompts, sp)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        accepted = sum(o.spec.num_accepted_tokens for o in spec)
        steps = sum(o.spec.num_verify_steps for o in spec)
        assert accepted > 0
        per_step[topk] = accepted / steps
        if topk > 1:
            assert cluster.verifier.stats.num_tree_verify_steps > 0
    assert per_step[4] > per_step[1], per_step
