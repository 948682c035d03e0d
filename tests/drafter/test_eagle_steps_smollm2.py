"""The two-module EAGLE head shipped for SmolLM2-135M-Instruct
(drafter/heads/smollm2-135m-instruct-eagle-2step/): ``--drafter eagle:steps=2`` finds it, and
float32 greedy output through the in-process workers equals plain decoding on held-out chat and
code prompts with drafts accepted at depth 1 and at depth 2 (module 1's)."""

import pytest

from helpers.smollm2_heldout import smollm2_heldout
from specmesh.cluster.drafter_option import parse_drafter
from specmesh.drafter.eagle.checkpoint import read_head_config
from specmesh.drafter.proposer import DraftTarget
from specmesh.drafter.proposers.eagle import EagleProposer, shipped_head
from specmesh.engine.loader import SMOLLM2_NAME

pytestmark = pytest.mark.slow


def test_a_two_module_head_is_shipped_for_smollm2_and_steps_selects_it():
    path = shipped_head(SMOLLM2_NAME, 2)
    assert path is not None and path != shipped_head(SMOLLM2_NAME)
    cfg = read_head_config(path)
    assert cfg.num_steps == 2 and cfg.target["name"] == SMOLLM2_NAME
    assert cfg.feature_layers == read_head_config(shipped_head(SMOLLM2_NAME)).feature_layers
    assert sum(f.stat().st_size for f in path.iterdir()) <= 20 * 2**20
    assert parse_drafter("eagle:steps=2", None) == ("eagle", {"num_steps": 2})
    assert EagleProposer.seed_state_for({"num_steps": 2}) == cfg.seed_state
    with pytest.raises(FileNotFoundError, match="--num-steps 3"):
        EagleProposer(num_steps=3)


def test_shipped_two_module_head_greedy_equals_plain_with_depth_two_drafts_accepted():
    held = smollm2_heldout()
    proposer = EagleProposer.create({"num_steps": 2}, DraftTarget())
    assert proposer.head.config.num_steps == 2
    spec = held.cluster(3, draft_method="eagle", proposer=proposer)
    got = spec.generate(held.prompts, held.sampling)
    assert [o.token_ids for o in got] == held.plain
    drafted = sum(o.spec.num_draft_tokens for o in got)
    accepted = sum(o.spec.num_accepted_tokens for o in got)
    assert drafted > 0 and accepted > 0.1 * drafted
    per_pos = spec.verifier.stats.num_accepted_tokens_per_pos
    assert len(per_pos) > 1 and per_pos[1] > 0, per_pos  # module 1's drafts accepted
    assert proposer.draft_stats()["draft_step_forwards"][1] > 0
