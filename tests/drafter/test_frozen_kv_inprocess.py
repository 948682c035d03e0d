"""Frozen-KV MTP through the in-process workers (real messages: the seed state from prefill,
DraftSync and every VerifyCommit carrying the request's committed rows; the verifier's KV pool
in a shared-memory file the drafter maps read-only after checking the verifier's Hello) with an
assistant trained by ``specmesh train-drafter --method frozen-kv-mtp`` on the tiny target:
greedy and seeded output equal plain decode with drafts accepted, every draft step's RoPE
position is the anchor's, and the assistant reads only rows the verifier committed."""

import pytest

from helpers.frozen_kv import train_tiny_frozen_kv
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.drafter.eagle.checkpoint import HeadMismatch
from specmesh.drafter.eagle.data import chat_token_ids
from specmesh.drafter.proposers.frozen_kv_mtp import FrozenKVMTPProposer
from specmesh.engine.loader import load_model
from specmesh.protocol.messages import SamplingParams

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_frozen_kv(tiny_model_dir, tmp_path_factory):
    return train_tiny_frozen_kv(tiny_model_dir, tmp_path_factory.mktemp("tiny-frozen-kv"))


def test_greedy_and_seeded_output_equal_plain_decode_with_drafts_accepted(tiny_model_dir,
                                                                          tiny_frozen_kv):
    path, messages = tiny_frozen_kv
    lm = load_model(tiny_model_dir, "float32")
    eos = lm.config.eos_token_ids
    prompts = chat_token_ids(lm.tokenizer, [{"messages": m} for m in messages[:6]])
    plain = InProcessCluster(lm.model, lm.config, num_speculative_tokens=0, eos_token_ids=eos)
    proposer = FrozenKVMTPProposer(path, tiny_model_dir)
    spec = InProcessCluster(lm.model, lm.config, num_speculative_tokens=3, eos_token_ids=eos,
                            draft_method="frozen_kv_mtp", proposer=proposer)
    # every step's query position, and the rows each call gathered: the anchor's committed ones
    positions, reads = [], []
    rope, rows = proposer.model._rope, proposer.pools["verifier-0"].rows

    def spy_rope(q, pos):  # noqa: ANN001, ANN202
        positions.append(pos.tolist())
        return rope(q, pos)

    def spy_rows(layer, table, n):  # noqa: ANN001, ANN202
        reads.append(n)
        return rows(layer, table, n)

    proposer.model._rope = spy_rope
    proposer.pools["verifier-0"].rows = spy_rows
    sp = SamplingParams(max_tokens=MAX_TOKENS)
    want = [o.token_ids for o in plain.generate(prompts, sp)]
    got = spec.generate(prompts, sp)
    assert [o.token_ids for o in got] == want
    assert sum(o.spec.num_draft_tokens for o in got) > 0
    assert sum(o.spec.num_accepted_tokens for o in got) > 0
    assert positions and reads and proposer.num_steps > 0
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    assert all(0 < n < longest for n in reads)
    assert proposer.draft_memory()["draft_kv_pool_bytes"] == 0
    seeded = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.05, seed=40 + i)
              for i in range(len(prompts))]
    want = [o.token_ids for o in plain.generate(prompts, seeded)]
    got = spec.generate(prompts, seeded)
    assert [o.token_ids for o in got] == want
    assert sum(o.spec.num_accepted_tokens for o in got) > 0
    for _ in range(5):  # the last DraftClose may still be in flight
        spec.drafter.step(0.0)
    assert not proposer.requests  # every finished request was closed: never read again


def test_an_assistant_for_another_target_is_refused_and_none_shipped_is_clear(
        tiny_model_dir, tiny_frozen_kv, tmp_path):
    import torch

    from helpers.models import tiny_llama
    from specmesh.engine.loader import load_tokenizer

    path, _ = tiny_frozen_kv
    tok = load_tokenizer(None)
    other, _, _ = tiny_llama(seed=11, dtype=torch.float32, vocab_size=len(tok), hidden_size=64,
                             num_layers=2, num_heads=4, num_kv_heads=2, init_std=0.1,
                             eos_token_id=2, bos_token_id=1, max_position_embeddings=2048)
    other.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(HeadMismatch, match="other embedding weights"):
        FrozenKVMTPProposer(path, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="train-drafter --method frozen-kv-mtp"):
        FrozenKVMTPProposer(None, tiny_model_dir)
