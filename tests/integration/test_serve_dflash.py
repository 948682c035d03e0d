"""DFlash drafting end to end through the Ray cluster (``--drafter dflash:PATH``: prefill,
verifier, drafter and gateway in their own processes, ZMQ between them) on the tiny model, with
a DFlash draft trained in the test by ``specmesh train-drafter --method dflash`` for a few
seconds on the outputs of the tiny model's layers 1 and 0: the prefill and verifier roles
learn the seed state ("hidden:1,0") from the checkpoint before the drafter starts and ship the
rows with every commit; greedy output token ids equal plain greedy decoding with drafts
accepted, and a seeded request's output is the same with speculation on and off (drafts
accepted there too)."""

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
from specmesh.drafter.dflash_files import read_dflash_config

pytestmark = pytest.mark.ray
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_dflash(tiny_model_dir, tmp_path_factory):
    """A 1-layer DFlash draft of the tiny model (block 4, context rows of layers 1 and 0)
    trained on its greedy answers to the prompts (a few seconds of training)."""
    return train_tiny_drafter("dflash", tiny_model_dir, tmp_path_factory.mktemp("tiny-dflash"),
                              "--feature-layers", "1,0")


@pytest.fixture(scope="module")
def dflash_cluster(ray_session, tiny_model_dir, tiny_dflash):
    spec = f"dflash:{tiny_dflash}"
    assert parse_drafter(spec, tiny_model_dir) == ("dflash", {"model": tiny_dflash})
    # the verifier waits for tails in flight, so drafts reach it on a loaded machine too, and
    # verifies every draft (goodput off: these tests are about verifying them)
    handle = served_drafter_cluster(tiny_model_dir, spec, "specmesh-test-dflash",
                                    tail_wait_fraction=20.0, drafter_silence_s=5.0,
                                    goodput_drafts=False)
    yield handle
    handle.stop()


def test_checkpoint_names_its_block_and_seed_state(tiny_dflash):
    cfg = read_dflash_config(tiny_dflash)
    assert cfg.block == 4 and cfg.num_layers == 1 and cfg.seed_state == "hidden:1,0"


def test_served_dflash_greedy_equals_plain_decode_with_drafts_accepted(
        dflash_cluster, tiny_model_dir):
    drafted, accepted = greedy_equals_plain(dflash_cluster.url, tiny_model_dir,
                                            TOPIC_MESSAGES[:6], MAX_TOKENS)
    assert drafted > 0 and accepted > 0, (drafted, accepted)


def test_served_dflash_seeded_output_is_the_same_with_speculation_on_and_off(dflash_cluster):
    assert seeded_on_equals_off(dflash_cluster.url, TOPIC_MESSAGES[:4], MAX_TOKENS,
                                temperature=0.3, first_seed=11) > 0
