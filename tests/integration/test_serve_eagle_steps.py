"""A multi-layer EAGLE head (2 modules, `--drafter eagle:PATH` of a head trained with
``specmesh train-drafter --num-steps 2``) end to end through the Ray cluster (prefill,
verifier, drafter and gateway in their own processes): greedy chat output equals plain decode
with drafts accepted, a seeded request is the same with speculation on (drafts accepted) and
off, and the drafter's stats report the head's weights, KV pool and per-module cost."""

from __future__ import annotations

import pytest

from helpers.served_drafter import (
    greedy_equals_plain,
    seeded_on_equals_off,
    served_drafter_cluster,
)

pytestmark = pytest.mark.ray
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def steps_cluster(ray_session, tiny_model_dir, tiny_eagle_steps_head):
    head_dir, _ = tiny_eagle_steps_head
    handle = served_drafter_cluster(tiny_model_dir, f"eagle:{head_dir}",
                                    "specmesh-test-eagle-steps")
    yield handle
    handle.stop()


def test_served_two_module_head_greedy_equal_plain_and_seeded_on_equal_off(
        steps_cluster, tiny_model_dir, tiny_eagle_steps_head):
    _, messages = tiny_eagle_steps_head
    drafted, accepted = greedy_equals_plain(steps_cluster.url, tiny_model_dir, messages[:5],
                                            MAX_TOKENS)
    assert drafted > 0 and accepted > 0
    # sampled, close to the greedy path
    assert seeded_on_equals_off(steps_cluster.url, messages[:4], MAX_TOKENS, temperature=0.05,
                                first_seed=7) > 0
    st = steps_cluster.stats()["drafter-0"]
    assert st["draft_num_steps"] == 2 and st["draft_weights_bytes"] > 0
    assert len(st["draft_step_ms"]) == 2 and st["draft_step_forwards"][1] > 0
    assert "draft_kv_pool_bytes" in st
