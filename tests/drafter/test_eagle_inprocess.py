"""EAGLE drafting through the in-process workers (real messages: seed state from prefill,
DraftSync and every VerifyCommit): float64 greedy output equals plain decoding, drafts are
accepted, and a head trained for another target is refused."""

import pytest
import torch

from helpers.backends import backend
from specmesh.drafter.eagle.checkpoint import HeadMismatch, load_head, target_embeddings, target_identity
from specmesh.drafter.proposers.eagle import load_eagle_head
from specmesh.engine.loader import load_model
from tests.helpers.eagle_heads import assert_eagle_equals_plain_decode


@pytest.mark.parametrize("head_fixture", ["tiny_eagle_head", "tiny_fused_eagle_head"])
def test_float64_greedy_output_equals_plain_decode_with_drafts_accepted(tiny_model_dir,
                                                                       head_fixture, request):
    """Both head kinds: EAGLE-1 (final-norm state) and EAGLE-3 fused layers ("hidden:1,0")."""
    head_dir, messages = request.getfixturevalue(head_fixture)
    lm = load_model(tiny_model_dir, "float64")
    embed, lm_head = target_embeddings(tiny_model_dir)
    head = load_head(head_dir, embed, lm_head, target_identity(lm.name, lm.config, embed),
                     dtype=torch.float64)
    assert_eagle_equals_plain_decode(lm, head, messages)


def test_the_proposer_loads_only_embedding_and_lm_head_of_its_target(tiny_model_dir,
                                                                    tiny_eagle_head):
    """(With the Q8_0 rounding off: tests/drafter/test_eagle_quantize.py covers it.)"""
    head_dir, _ = tiny_eagle_head
    head = load_eagle_head(head_dir, tiny_model_dir, backend=backend(eagle_q8_0=False))
    lm = load_model(tiny_model_dir)
    torch.testing.assert_close(head.embed, lm.model.model.embed_tokens.weight)
    rows = lm.model.lm_head.weight[head.draft_to_target]
    torch.testing.assert_close(head.lm_head, rows)


def test_a_head_for_another_target_is_refused(tiny_model_dir, tiny_eagle_head, tmp_path):
    head_dir, _ = tiny_eagle_head
    from specmesh.engine.loader import load_tokenizer
    from helpers.models import tiny_llama

    tok = load_tokenizer(None)
    other, _, _ = tiny_llama(seed=11, dtype=torch.float32, vocab_size=len(tok), hidden_size=64,
                             num_layers=2, num_heads=4, num_kv_heads=2, init_std=0.1,
                             eos_token_id=2, bos_token_id=1, max_position_embeddings=2048)
    other.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(HeadMismatch, match="other embedding weights"):
        load_eagle_head(head_dir, str(tmp_path))


def test_no_head_shipped_for_a_target_is_a_clear_error(tiny_model_dir):
    with pytest.raises(FileNotFoundError, match="train-drafter"):
        load_eagle_head(None, tiny_model_dir)
