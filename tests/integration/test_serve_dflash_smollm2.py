"""The DFlash draft shipped for SmolLM2-135M-Instruct (drafter/heads/smollm2-135m-instruct/
dflash/) served end to end through the Ray cluster with ``--drafter dflash`` (no path: the
shipped one; seed state "hidden:2,15,26" learned from its config): greedy chat output token ids
equal the in-process plain greedy decode with drafts made and accepted (its held-out acceptance
at position 1 is ~0.18: over three prompts' 32 tokens some are), and a seeded request gives
the same output with speculation on and off."""

from __future__ import annotations

import pytest

from helpers.served_drafter import (
    greedy_equals_plain,
    seeded_on_equals_off,
    served_drafter_cluster,
)
from specmesh.cluster.demo import load_prompts
from specmesh.drafter.dflash_files import read_dflash_config, shipped_dflash

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MAX_TOKENS = 32
SEA = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def cluster(ray_session):
    path = shipped_dflash("SmolLM2-135M-Instruct")
    assert path is not None and read_dflash_config(path).seed_state == "hidden:2,15,26"
    handle = served_drafter_cluster(None, "dflash", "specmesh-smollm2-dflash",
                                    num_speculative_tokens=4, tail_wait_fraction=20.0,
                                    drafter_silence_s=5.0, goodput_drafts=False)
    yield handle
    handle.stop()


def test_shipped_dflash_greedy_equals_plain_decode_with_drafts_accepted(cluster):
    drafted, accepted = greedy_equals_plain(
        cluster.url, None, [p["messages"] for p in load_prompts()[:3]], MAX_TOKENS)
    assert drafted > 0 and accepted > 0


def test_shipped_dflash_seeded_output_is_the_same_with_speculation_on_and_off(cluster):
    seeded_on_equals_off(cluster.url, [SEA], MAX_TOKENS, temperature=1.0,
                         first_seed=42, kappa=4)
