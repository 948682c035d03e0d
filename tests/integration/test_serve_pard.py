"""PARD drafting end to end through the Ray cluster (``--drafter pard:PATH``: prefill, verifier,
drafter and gateway in their own processes, ZMQ between them) on the tiny model, with a PARD
draft trained in the test by ``specmesh train-drafter --method pard`` for a few seconds: greedy
output token ids equal plain greedy decoding with drafts accepted, and a seeded request's
output is the same with speculation on and off (drafts accepted there too)."""

from __future__ import annotations

import pytest

from helpers.served_drafter import (
    TOPIC_MESSAGES,
    greedy_equals_plain,
    seeded_on_equals_off,
    served_drafter_cluster,
    train_tiny_drafter,
)
from specmesh.cluster.drafter_option import parse_drafter
from specmesh.drafter.pard_files import read_pard_config

pytestmark = pytest.mark.ray
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_pard(tiny_model_dir, tmp_path_factory):
    """A 1-layer PARD draft of the tiny model (block 4) trained on its
    greedy answers to the prompts (a few seconds of training)."""
    return train_tiny_drafter("pard", tiny_model_dir, tmp_path_factory.mktemp("tiny-pard"))


@pytest.fixture(scope="module")
def pard_cluster(ray_session, tiny_model_dir, tiny_pard):
    spec = f"pard:{tiny_pard}"
    assert parse_drafter(spec, tiny_model_dir) == ("pard", {"model": tiny_pard})
    # the verifier waits for tails in flight, so drafts reach it on a loaded machine too, and
    # verifies every draft (goodput off: these tests are about verifying them)
    handle = served_drafter_cluster(tiny_model_dir, spec, "specmesh-test-pard",
                                    tail_wait_fraction=20.0, drafter_silence_s=5.0,
                                    goodput_drafts=False)
    yield handle
    handle.stop()


def test_checkpoint_names_its_block_and_mask(tiny_pard):
    meta = read_pard_config(tiny_pard)
    assert meta["block"] == 4 and meta["num_layers"] == 1
    assert 0 <= meta["mask_token_id"] < meta["target"]["vocab_size"]


def test_served_pard_greedy_equals_plain_decode_with_drafts_accepted(
        pard_cluster, tiny_model_dir):
    drafted, accepted = greedy_equals_plain(pard_cluster.url, tiny_model_dir,
                                            TOPIC_MESSAGES[:6], MAX_TOKENS)
    assert drafted > 0 and accepted > 0, (drafted, accepted)


def test_served_pard_seeded_output_is_the_same_with_speculation_on_and_off(pard_cluster):
    assert seeded_on_equals_off(pard_cluster.url, TOPIC_MESSAGES[:4], MAX_TOKENS,
                                temperature=0.3, first_seed=11) > 0
