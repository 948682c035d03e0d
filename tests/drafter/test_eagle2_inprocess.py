"""EAGLE-2 draft trees through the in-process workers (real messages: seed state from prefill,
DraftSync and every VerifyCommit; trees verified by the tree rule) with the head trained on
the tiny target: greedy output equals plain decode with tree drafts verified and accepted,
seeded output equals seeded plain decode (speculation on vs off), the seed state's bytes are
counted, and unseeded sampled requests get sampled trees verified with their rows."""

import torch

from specmesh.cluster.inprocess import InProcessCluster
from specmesh.drafter.eagle.checkpoint import load_head, target_embeddings, target_identity
from specmesh.drafter.eagle.data import chat_token_ids
from specmesh.drafter.proposers.eagle import EagleProposer
from specmesh.engine.loader import load_model
from specmesh.protocol.messages import SamplingParams

MAX_TOKENS = 24


def test_eagle2_trees_equal_plain_decode_greedy_and_seeded(tiny_model_dir, tiny_eagle_head):
    head_dir, messages = tiny_eagle_head
    lm = load_model(tiny_model_dir, "float32")
    embed, lm_head = target_embeddings(tiny_model_dir)
    head = load_head(head_dir, embed, lm_head, target_identity(lm.name, lm.config, embed),
                     dtype=torch.float32)
    prompts = chat_token_ids(lm.tokenizer, [{"messages": m} for m in messages[:6]])
    eos = lm.config.eos_token_ids
    plain = InProcessCluster(lm.model, lm.config, num_speculative_tokens=0, eos_token_ids=eos)
    proposer = EagleProposer(head_module=head, topk=3, tree_nodes=8)
    spec = InProcessCluster(lm.model, lm.config, num_speculative_tokens=3, eos_token_ids=eos,
                            draft_method="eagle", proposer=proposer)
    sp = SamplingParams(max_tokens=MAX_TOKENS)
    want = [o.token_ids for o in plain.generate(prompts, sp)]
    got = spec.generate(prompts, sp)
    assert [o.token_ids for o in got] == want
    assert sum(o.spec.num_draft_tokens for o in got) > 0
    assert sum(o.spec.num_accepted_tokens for o in got) > 0
    assert spec.verifier.stats.num_tree_verify_steps > 0 and proposer.num_tree_forwards > 0
    # the P/D seed: one float32 hidden row per request, counted in bytes
    st = spec.verifier.stats
    assert st.num_seed_states == len(prompts)
    assert st.seed_state_bytes == len(prompts) * lm.config.hidden_size * 4
    # sampled close to the greedy path, so drafts are accepted
    seeded = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.05, seed=40 + i)
              for i in range(len(prompts))]
    want = [o.token_ids for o in plain.generate(prompts, seeded)]
    got = spec.generate(prompts, seeded)
    assert [o.token_ids for o in got] == want
    assert sum(o.spec.num_accepted_tokens for o in got) > 0


def test_unseeded_sampled_requests_get_sampled_trees_verified_with_their_rows(
        tiny_model_dir, tiny_eagle_head, monkeypatch):
    """Unseeded sampled requests: the drafter sends sampled EAGLE-2 trees with a row per node,
    the verifier's tree rule judges them with those rows, and drafts are accepted."""
    from specmesh.decode.verification import TreeRule

    head_dir, messages = tiny_eagle_head
    lm = load_model(tiny_model_dir, "float32")
    embed, lm_head = target_embeddings(tiny_model_dir)
    head = load_head(head_dir, embed, lm_head, target_identity(lm.name, lm.config, embed),
                     dtype=torch.float32)
    with_rows = []
    verify_tree = TreeRule.verify_tree

    def spy(self, batch):  # noqa: ANN001, ANN202
        if batch.draft_probs is not None:
            with_rows.append(int(batch.cu_num_draft_tokens[-1]))
        return verify_tree(self, batch)

    monkeypatch.setattr(TreeRule, "verify_tree", spy)
    prompts = chat_token_ids(lm.tokenizer, [{"messages": m} for m in messages[:4]])
    spec = InProcessCluster(lm.model, lm.config, num_speculative_tokens=3,
                            eos_token_ids=lm.config.eos_token_ids, draft_method="eagle",
                            proposer=EagleProposer(head_module=head, topk=3, tree_nodes=8),
                            drafter_options={"seed": 5})
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.3, ignore_eos=True)
    got = spec.generate(prompts, [sp] * len(prompts))
    assert all(len(o.token_ids) == MAX_TOKENS for o in got)
    assert with_rows and spec.verifier.stats.num_tree_verify_steps > 0
    assert sum(o.spec.num_accepted_tokens for o in got) > 0
