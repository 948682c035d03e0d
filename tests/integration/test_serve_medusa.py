"""Medusa drafting end to end through the Ray cluster (`--drafter medusa:PATH`: prefill,
verifier, drafter and gateway in their own processes, the last hidden state as seed state over
ZMQ, trees verified by the tree rule) with heads trained on the tiny target by
``specmesh train-drafter --method medusa``: greedy chat output equals plain decode with drafts
accepted, and a seeded request is the same with speculation on (drafts accepted) and off."""

from __future__ import annotations

import pytest

from helpers.medusa_heads import train_tiny_medusa
from helpers.served_drafter import (
    greedy_equals_plain,
    seeded_on_equals_off,
    served_drafter_cluster,
)

pytestmark = pytest.mark.ray
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def medusa_heads(tiny_model_dir, tmp_path_factory):
    return train_tiny_medusa(tiny_model_dir, tmp_path_factory.mktemp("served-medusa"))


@pytest.fixture(scope="module")
def medusa_cluster(ray_session, tiny_model_dir, medusa_heads):
    heads_dir, _ = medusa_heads
    handle = served_drafter_cluster(tiny_model_dir, f"medusa:{heads_dir}",
                                    "specmesh-test-medusa")
    yield handle
    handle.stop()


def test_served_medusa_greedy_equals_plain_and_seeded_on_equals_off(medusa_cluster,
                                                                    tiny_model_dir,
                                                                    medusa_heads):
    _, messages = medusa_heads
    drafted, accepted = greedy_equals_plain(medusa_cluster.url, tiny_model_dir, messages[:5],
                                            MAX_TOKENS)
    assert drafted > 0 and accepted > 0
    # sampled, close to the greedy path
    assert seeded_on_equals_off(medusa_cluster.url, messages[:4], MAX_TOKENS, temperature=0.05,
                                first_seed=7) > 0
