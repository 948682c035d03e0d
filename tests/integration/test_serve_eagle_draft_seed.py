"""The EAGLE draft seed across P/D end to end through the Ray cluster (prefill, verifier,
drafter and gateway in their own processes, `--prefill-draft-seed on`, the default): the
prefill role builds the drafter's proposer from the same `--drafter eagle:PATH` spec and ships
the head's first step with PrefillDone; greedy chat output equals plain decode with drafts
accepted, the drafter adopted the seeds and the verifier counted their bytes."""

from __future__ import annotations

import pytest

from helpers.served_drafter import greedy_equals_plain, served_drafter_cluster

pytestmark = pytest.mark.ray
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def seed_cluster(ray_session, tiny_model_dir, tiny_eagle_head):
    head_dir, _ = tiny_eagle_head
    # the gate off: the test asserts drafts (a measured gate may turn a head off)
    handle = served_drafter_cluster(tiny_model_dir, f"eagle:{head_dir}",
                                    "specmesh-test-eagle-draft-seed",
                                    speculation_gate_mode="off")
    yield handle
    handle.stop()


def test_served_draft_seed_adopted_and_greedy_output_equals_plain(seed_cluster, tiny_model_dir,
                                                                  tiny_eagle_head):
    _, messages = tiny_eagle_head
    drafted, accepted = greedy_equals_plain(seed_cluster.url, tiny_model_dir, messages[:4],
                                            MAX_TOKENS)
    assert drafted > 0 and accepted > 0
    stats = seed_cluster.stats()
    v, d = stats["verifier-0"], stats["drafter-0"]
    assert v["draft_seed_bytes"] > 0 and v["num_draft_seeds_sent"] > 0
    assert v["num_bad_draft_seeds"] == 0
    assert d["num_prefill_seeds_adopted"] > 0 and d["num_draft_seeds_refused"] == 0
    assert stats["prefill-0"]["num_draft_seeds"] >= v["num_draft_seeds"] > 0
