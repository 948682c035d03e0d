"""The frozen-KV MTP assistant shipped for SmolLM2-135M-Instruct
(drafter/heads/smollm2-135m-instruct-frozen-kv-mtp/): ``--drafter frozen-kv-mtp`` finds it, it
allocates no draft KV, and float32 greedy output through the in-process workers (the verifier's
KV pool in shared memory, read by the assistant) equals plain decoding on held-out chat and code
prompts with drafts accepted."""

import pytest

from specmesh.cluster.drafter_option import parse_drafter
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.data.prompts import load_prompts_file
from specmesh.drafter.eagle.data import chat_token_ids
from specmesh.drafter.proposer import DraftTarget
from specmesh.drafter.proposers.frozen_kv_mtp import FrozenKVMTPProposer, shipped_assistant
from specmesh.drafter.training.eagle import PROMPTS_DIR
from specmesh.engine.loader import SMOLLM2_NAME, load_model
from specmesh.protocol.messages import SamplingParams

pytestmark = pytest.mark.slow


def test_an_assistant_is_shipped_for_smollm2():
    path = shipped_assistant(SMOLLM2_NAME)
    assert path is not None
    assert sum(f.stat().st_size for f in path.iterdir()) <= 12 * 2**20
    assert parse_drafter("frozen-kv-mtp", None) == ("frozen_kv_mtp", {})


def test_shipped_assistant_greedy_equals_plain_decode_with_drafts_accepted():
    lm = load_model(None, "float32")
    chat = load_prompts_file(str(PROMPTS_DIR / "drafter_heldout_chat.jsonl"))[:2]
    code = load_prompts_file(str(PROMPTS_DIR / "drafter_heldout_code.jsonl"))[:2]
    prompts = chat_token_ids(lm.tokenizer, chat + code)
    sp = SamplingParams(max_tokens=32)
    eos = lm.config.eos_token_ids
    plain = InProcessCluster(lm.model, lm.config, num_speculative_tokens=0,
                             eos_token_ids=eos).generate(prompts, sp)
    proposer = FrozenKVMTPProposer.create({}, DraftTarget())
    spec = InProcessCluster(lm.model, lm.config, num_speculative_tokens=3, eos_token_ids=eos,
                            draft_method="frozen_kv_mtp", proposer=proposer)
    got = spec.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    drafted = sum(o.spec.num_draft_tokens for o in got)
    assert drafted > 0 and sum(o.spec.num_accepted_tokens for o in got) > 0.05 * drafted
    stats = proposer.draft_memory()
    assert stats["draft_kv_pool_bytes"] == 0 and stats["draft_kv_bytes_per_token_avoided"] > 0
