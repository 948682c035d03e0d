"""The Medusa heads shipped for SmolLM2-135M-Instruct (drafter/heads/smollm2-135m-instruct-
medusa/): ``--drafter medusa`` finds them, and float32 greedy output through the in-process
workers equals plain decoding on held-out chat prompts, with tree drafts accepted."""

import pytest

from specmesh.cluster.drafter_option import parse_drafter
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.data.prompts import load_prompts_file
from specmesh.drafter.eagle.data import chat_token_ids
from specmesh.drafter.medusa.checkpoint import read_config
from specmesh.drafter.proposer import DraftTarget
from specmesh.drafter.proposers.medusa import MedusaProposer, shipped_heads
from specmesh.drafter.training.eagle import PROMPTS_DIR
from specmesh.engine.loader import SMOLLM2_NAME, load_model
from specmesh.protocol.messages import SamplingParams

pytestmark = pytest.mark.slow


def test_heads_are_shipped_for_smollm2_with_their_tree():
    path = shipped_heads(SMOLLM2_NAME)
    assert path is not None
    cfg = read_config(path)
    assert cfg.target["name"] == SMOLLM2_NAME and cfg.hidden_size == 576
    assert cfg.num_heads == 4 and len(cfg.tree) > cfg.num_heads  # a tree, not a chain
    assert sum(f.stat().st_size for f in path.iterdir()) <= 4 * 2**20
    assert parse_drafter("medusa", None) == ("medusa", {})


def test_shipped_heads_greedy_equals_plain_decode_with_tree_drafts_accepted():
    lm = load_model(None, "float32")
    prompts = load_prompts_file(PROMPTS_DIR / "drafter_heldout_chat.jsonl")[:4]
    ids = chat_token_ids(lm.tokenizer, prompts)
    sp = SamplingParams(max_tokens=32)
    eos = lm.config.eos_token_ids
    plain = InProcessCluster(lm.model, lm.config, num_speculative_tokens=0, eos_token_ids=eos)
    proposer = MedusaProposer.create({}, DraftTarget())
    spec = InProcessCluster(lm.model, lm.config, num_speculative_tokens=4, eos_token_ids=eos,
                            draft_method="medusa", proposer=proposer)
    want = [o.token_ids for o in plain.generate(ids, sp)]
    got = spec.generate(ids, sp)
    assert [o.token_ids for o in got] == want
    assert sum(o.spec.num_accepted_tokens for o in got) > 0
    assert spec.verifier.stats.num_tree_verify_steps > 0
