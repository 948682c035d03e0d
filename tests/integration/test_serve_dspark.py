"""DSpark drafting end to end through the Ray cluster (``--drafter dspark:PATH``: prefill,
verifier, drafter and gateway in their own processes, ZMQ between them) on the tiny model, with
a DSpark draft (gated Markov head) trained in the test by ``specmesh train-drafter --method
dspark`` for a few seconds: greedy output token ids equal plain greedy decoding with drafts
accepted, a seeded request's output is the same with speculation on and off (drafts accepted
there too), and the drafter role reports its weights and KV pool bytes."""

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
from specmesh.drafter.dspark_files import read_dspark_config

pytestmark = pytest.mark.ray
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_dspark(tiny_model_dir, tmp_path_factory):
    """A 1-layer DSpark draft of the tiny model (block 4, gated Markov head of rank 16)
    trained on its greedy answers to the prompts (a few seconds of training)."""
    return train_tiny_drafter("dspark", tiny_model_dir, tmp_path_factory.mktemp("tiny-dspark"),
                              "--markov", "gated", "--markov-rank", "16")


@pytest.fixture(scope="module")
def dspark_cluster(ray_session, tiny_model_dir, tiny_dspark):
    spec = f"dspark:{tiny_dspark}+markov=gated+markov_rank=16"
    assert parse_drafter(spec, tiny_model_dir) == (
        "dspark", {"model": tiny_dspark, "markov": "gated", "markov_rank": 16})
    # the verifier waits for tails in flight, so drafts reach it on a loaded machine too, and
    # verifies every draft (goodput off: these tests are about verifying them)
    handle = served_drafter_cluster(tiny_model_dir, spec, "specmesh-test-dspark",
                                    tail_wait_fraction=20.0, drafter_silence_s=5.0,
                                    goodput_drafts=False)
    yield handle
    handle.stop()


def test_checkpoint_names_its_markov_head(tiny_dspark):
    meta = read_dspark_config(tiny_dspark)
    assert (meta["markov"], meta["markov_rank"], meta["block"]) == ("gated", 16, 4)


def test_served_dspark_greedy_equals_plain_decode_with_drafts_accepted(
        dspark_cluster, tiny_model_dir):
    drafted, accepted = greedy_equals_plain(dspark_cluster.url, tiny_model_dir,
                                            TOPIC_MESSAGES[:6], MAX_TOKENS)
    assert drafted > 0 and accepted > 0, (drafted, accepted)


def test_served_dspark_seeded_output_is_the_same_with_speculation_on_and_off(dspark_cluster):
    assert seeded_on_equals_off(dspark_cluster.url, TOPIC_MESSAGES[:4], MAX_TOKENS,
                                temperature=0.3, first_seed=11) > 0


def test_drafter_role_reports_weights_and_kv_pool_bytes(dspark_cluster):
    drafters = [s for iid, s in dspark_cluster.stats().items() if "draft_weights_bytes" in s]
    assert drafters, list(dspark_cluster.stats())
    assert all(s["draft_weights_bytes"] > 0 and s["draft_kv_pool_bytes"] > 0 for s in drafters)
