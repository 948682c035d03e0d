"""Frozen-KV MTP end to end through the Ray cluster (`--drafter frozen-kv-mtp:PATH`: prefill,
verifier, drafter and gateway in their own processes on this node; the verifier's KV pool in
shared memory, mapped read-only by the drafter, each request's committed rows sent with its
commits) with an assistant trained on the tiny target by ``specmesh train-drafter --method
frozen-kv-mtp``: greedy chat output equals plain decode with drafts accepted, a seeded request
is the same with speculation on (drafts accepted) and off, and the drafter reports no draft KV
pool (issue 36 item 4)."""

from __future__ import annotations

import pytest

from helpers.frozen_kv import train_tiny_frozen_kv
from helpers.served_drafter import (
    greedy_equals_plain,
    seeded_on_equals_off,
    served_drafter_cluster,
)

pytestmark = pytest.mark.ray
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def assistant(tiny_model_dir, tmp_path_factory):
    return train_tiny_frozen_kv(tiny_model_dir, tmp_path_factory.mktemp("served-frozen-kv"))


@pytest.fixture(scope="module")
def frozen_kv_cluster(ray_session, tiny_model_dir, assistant):
    path, _ = assistant
    handle = served_drafter_cluster(tiny_model_dir, f"frozen-kv-mtp:{path}",
                                    "specmesh-test-frozen-kv")
    yield handle
    handle.stop()


def test_served_frozen_kv_greedy_equals_plain_and_seeded_on_equals_off(frozen_kv_cluster,
                                                                       tiny_model_dir,
                                                                       assistant):
    _, messages = assistant
    drafted, accepted = greedy_equals_plain(frozen_kv_cluster.url, tiny_model_dir, messages[:5],
                                            MAX_TOKENS)
    assert drafted > 0 and accepted > 0
    # sampled, close to the greedy path
    assert seeded_on_equals_off(frozen_kv_cluster.url, messages[:4], MAX_TOKENS, temperature=0.05,
                                first_seed=7) > 0
    # the drafter owns no draft KV pool; it reports its weights and what it did not allocate
    drafter = frozen_kv_cluster.stats()["drafter-0"]
    assert drafter["draft_kv_pool_bytes"] == 0
    assert drafter["draft_weights_bytes"] > 0
    assert drafter["draft_kv_bytes_per_token_avoided"] == 2 * 2 * 16 * 4  # h_kv 2, d_h 16, fp32
