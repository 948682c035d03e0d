"""The EAGLE head shipped for SmolLM2-135M-Instruct (drafter/heads/): float32 greedy output
through the in-process workers equals plain decoding on held-out chat and code prompts, with
drafts accepted; `--drafter auto` picks it for SmolLM2 where the cores allow."""

import pytest

from helpers.smollm2_heldout import smollm2_heldout
from specmesh.cluster.drafter_option import parse_drafter
from specmesh.drafter.eagle.checkpoint import read_head_config
from specmesh.drafter.proposers.eagle import EagleProposer, shipped_head
from specmesh.engine.loader import SMOLLM2_NAME

pytestmark = pytest.mark.slow


def test_a_head_is_shipped_for_smollm2_and_auto_picks_it_where_it_pays(monkeypatch):
    """``--drafter auto`` takes the shipped head where the thread plan leaves the verifier its
    cores (16 here), n-gram on 2 (cluster/auto.py)."""
    import os

    from specmesh.cluster.drafter_option import auto_drafter
    from specmesh.cluster.config import default_threads

    path = shipped_head(SMOLLM2_NAME)
    assert path is not None
    cfg = read_head_config(path)
    assert cfg.target["name"] == SMOLLM2_NAME and cfg.hidden_size == 576
    assert sum(f.stat().st_size for f in path.iterdir()) <= 20 * 2**20
    for cores, method in ((16, "eagle"), (2, "ngram")):
        monkeypatch.setattr(os, "cpu_count", lambda n=cores: n)
        plans = (default_threads(model_drafter=True), default_threads())
        assert auto_drafter(None, "cpu", plans)[0] == method
        assert parse_drafter("auto", None) == (method, {})


def test_shipped_head_greedy_equals_plain_decode_with_drafts_accepted():
    held = smollm2_heldout()
    spec = held.cluster(4, draft_method="eagle", proposer=EagleProposer(model=None)).generate(
        held.prompts, held.sampling)
    assert [o.token_ids for o in spec] == held.plain
    drafted = sum(o.spec.num_draft_tokens for o in spec)
    accepted = sum(o.spec.num_accepted_tokens for o in spec)
    assert drafted > 0 and accepted > 0.1 * drafted
