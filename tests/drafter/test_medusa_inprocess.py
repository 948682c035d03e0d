"""Medusa drafting through the in-process workers (real messages: the seed state from prefill,
DraftSync and every VerifyCommit; trees verified by the tree rule) with heads trained by
``specmesh train-drafter --method medusa`` on the tiny target: greedy output equals plain
decode with tree drafts accepted, seeded output equals seeded plain decode, and heads trained
for another target are refused."""

import pytest
import torch

from helpers.medusa_heads import train_tiny_medusa
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.drafter.eagle.checkpoint import HeadMismatch
from specmesh.drafter.eagle.data import chat_token_ids
from specmesh.drafter.proposers.medusa import MedusaProposer, load_medusa_heads
from specmesh.engine.loader import load_model
from specmesh.protocol.messages import SamplingParams

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_medusa(tiny_model_dir, tmp_path_factory):
    return train_tiny_medusa(tiny_model_dir, tmp_path_factory.mktemp("tiny-medusa"))


def _clusters(lm, model_dir, heads_dir, kappa=3):
    eos = lm.config.eos_token_ids
    plain = InProcessCluster(lm.model, lm.config, num_speculative_tokens=0, eos_token_ids=eos)
    proposer = MedusaProposer(heads_dir, model_dir, dtype="float32")
    spec = InProcessCluster(lm.model, lm.config, num_speculative_tokens=kappa, eos_token_ids=eos,
                            draft_method="medusa", proposer=proposer)
    return plain, spec, proposer


def test_greedy_and_seeded_output_equal_plain_decode_with_tree_drafts_accepted(tiny_model_dir,
                                                                               tiny_medusa):
    heads_dir, messages = tiny_medusa
    lm = load_model(tiny_model_dir, "float32")
    prompts = chat_token_ids(lm.tokenizer, [{"messages": m} for m in messages[:6]])
    plain, spec, proposer = _clusters(lm, tiny_model_dir, heads_dir)
    sp = SamplingParams(max_tokens=MAX_TOKENS)
    want = [o.token_ids for o in plain.generate(prompts, sp)]
    got = spec.generate(prompts, sp)
    assert [o.token_ids for o in got] == want
    st = spec.verifier.stats
    assert sum(o.spec.num_draft_tokens for o in got) > 0
    assert sum(o.spec.num_accepted_tokens for o in got) > 0
    assert st.num_tree_verify_steps > 0 and proposer.num_head_rows > 0
    seeded = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=40 + i)
              for i in range(len(prompts))]
    want = [o.token_ids for o in plain.generate(prompts, seeded)]
    got = spec.generate(prompts, seeded)
    assert [o.token_ids for o in got] == want
    assert sum(o.spec.num_draft_tokens for o in got) > 0


def test_heads_for_another_target_are_refused_and_none_shipped_is_clear(tiny_model_dir,
                                                                         tiny_medusa, tmp_path):
    from helpers.models import tiny_llama
    from specmesh.engine.loader import load_tokenizer

    heads_dir, _ = tiny_medusa
    tok = load_tokenizer(None)
    other, _, _ = tiny_llama(seed=11, dtype=torch.float32, vocab_size=len(tok), hidden_size=64,
                             num_layers=2, num_heads=4, num_kv_heads=2, init_std=0.1,
                             eos_token_id=2, bos_token_id=1, max_position_embeddings=2048)
    other.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(HeadMismatch, match="other embedding weights"):
        load_medusa_heads(heads_dir, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="train-drafter --method medusa"):
        load_medusa_heads(None, tiny_model_dir)
