"""The frozen-KV MTP assistant shipped for SmolLM2-135M-Instruct
(drafter/heads/smollm2-135m-instruct-frozen-kv-mtp/): ``--drafter frozen-kv-mtp`` finds it, it
allocates no draft KV, and float32 greedy output through the in-process workers (the verifier's
KV pool in shared memory, read by the assistant) equals plain decoding on held-out chat and code
prompts with drafts accepted."""

import pytest

from helpers.smollm2_heldout import smollm2_heldout
from specmesh.cluster.drafter_option import parse_drafter
from specmesh.drafter.proposer import DraftTarget
from specmesh.drafter.proposers.frozen_kv_mtp import FrozenKVMTPProposer, shipped_assistant
from specmesh.engine.loader import SMOLLM2_NAME

pytestmark = pytest.mark.slow


def test_an_assistant_is_shipped_for_smollm2():
    path = shipped_assistant(SMOLLM2_NAME)
    assert path is not None
    assert sum(f.stat().st_size for f in path.iterdir()) <= 12 * 2**20
    assert parse_drafter("frozen-kv-mtp", None) == ("frozen_kv_mtp", {})


def test_shipped_assistant_greedy_equals_plain_decode_with_drafts_accepted():
    held = smollm2_heldout()
    proposer = FrozenKVMTPProposer.create({}, DraftTarget())
    spec = held.cluster(3, draft_method="frozen_kv_mtp", proposer=proposer)
    got = spec.generate(held.prompts, held.sampling)
    assert [o.token_ids for o in got] == held.plain
    drafted = sum(o.spec.num_draft_tokens for o in got)
    assert drafted > 0 and sum(o.spec.num_accepted_tokens for o in got) > 0.05 * drafted
    stats = proposer.draft_memory()
    assert stats["draft_kv_pool_bytes"] == 0 and stats["draft_kv_bytes_per_token_avoided"] > 0
