"""A multi-layer EAGLE head (2 modules, trained by ``specmesh train-drafter --num-steps 2`` on
the tiny target) through the in-process workers: greedy output equals plain decode with drafts
accepted (chains and EAGLE-2 trees, both with module i at depth i), seeded output is the same
with speculation on and off, and the drafter reports the head's weights, KV pool and
per-module cost."""

import torch

from specmesh.cluster.inprocess import InProcessCluster
from specmesh.drafter.eagle.checkpoint import load_head, target_embeddings, target_identity
from specmesh.drafter.eagle.data import chat_token_ids
from specmesh.drafter.proposers.eagle import EagleProposer
from specmesh.engine.loader import load_model
from specmesh.protocol.messages import SamplingParams

MAX_TOKENS = 24


def _setup(tiny_model_dir, head_dir, messages):  # noqa: ANN001, ANN202
    lm = load_model(tiny_model_dir, "float32")
    embed, lm_head = target_embeddings(tiny_model_dir)
    head = load_head(head_dir, embed, lm_head, target_identity(lm.name, lm.config, embed),
                     dtype=torch.float32)
    prompts = chat_token_ids(lm.tokenizer, [{"messages": m} for m in messages[:6]])
    plain = InProcessCluster(lm.model, lm.config, num_speculative_tokens=0,
                             eos_token_ids=lm.config.eos_token_ids)
    return lm, head, prompts, plain


def test_two_module_head_chains_and_trees_equal_plain_decode(tiny_model_dir,
                                                             tiny_eagle_steps_head):
    head_dir, messages = tiny_eagle_steps_head
    lm, head, prompts, plain = _setup(tiny_model_dir, head_dir, messages)
    assert head.config.num_steps == 2 and len(head.steps) == 1
    sp = SamplingParams(max_tokens=MAX_TOKENS)
    want = [o.token_ids for o in plain.generate(prompts, sp)]
    seeded = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.05, seed=40 + i)
              for i in range(len(prompts))]
    want_seeded = [o.token_ids for o in plain.generate(prompts, seeded)]
    for topk in (1, 3):  # chains, then EAGLE-2 trees
        proposer = EagleProposer(head_module=head, topk=topk, tree_nodes=8)
        spec = InProcessCluster(lm.model, lm.config, num_speculative_tokens=3,
                                eos_token_ids=lm.config.eos_token_ids, draft_method="eagle",
                                proposer=proposer)
        got = spec.generate(prompts, sp)
        assert [o.token_ids for o in got] == want, topk
        assert sum(o.spec.num_accepted_tokens for o in got) > 0, topk
        # drafts past depth 1 (module 1's) reached the verifier and some were accepted
        assert sum(o.spec.num_draft_tokens for o in got) \
            > sum(o.spec.num_verify_steps for o in got), topk
        per_pos = spec.verifier.stats.num_accepted_tokens_per_pos
        assert len(per_pos) > 1 and per_pos[1] > 0, (topk, per_pos)
        stats = proposer.draft_stats()
        assert stats["draft_num_steps"] == 2 and stats["draft_step_forwards"][1] > 0
        assert stats["draft_weights_bytes"] > 0
        if topk > 1:
            assert spec.verifier.stats.num_tree_verify_steps > 0
        got = spec.generate(prompts, seeded)
        assert [o.token_ids for o in got] == want_seeded, topk
        assert sum(o.spec.num_accepted_tokens for o in got) > 0, topk
