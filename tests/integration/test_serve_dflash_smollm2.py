"""The DFlash draft shipped for SmolLM2-135M-Instruct (drafter/heads/smollm2-135m-instruct/
dflash/) served end to end through the Ray cluster with ``--drafter dflash`` (no path: the
shipped one; seed state "hidden:2,15,26" learned from its config): greedy chat output token ids
equal the in-process plain greedy decode with drafts made, and a seeded request gives the same
output with speculation on and off. (The shipped draft is a bounded first run whose held-out
acceptance is ~1% at position 1: drafts are checked to be made and verified, not accepted.)"""

from __future__ import annotations

import pytest

from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.demo import load_prompts
from specmesh.cluster.drafter_option import parse_drafter
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.cluster.launcher import start_cluster
from specmesh.drafter.dflash_files import read_dflash_config, shipped_dflash
from specmesh.engine.loader import load_model
from specmesh.gateway.tokens import chat_prompt_ids
from specmesh.protocol.messages import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def cluster(ray_session):
    path = shipped_dflash("SmolLM2-135M-Instruct")
    assert path is not None and read_dflash_config(path).seed_state == "hidden:2,15,26"
    method, kwargs = parse_drafter("dflash", None)
    handle = start_cluster(ClusterConfig.create(
        model=None, dtype="float32", num_speculative_tokens=4, kv_cache_mb=128, port=0,
        draft_method=method, drafter_method_kwargs=kwargs, tail_wait_fraction=20.0,
        drafter_silence_s=5.0, goodput_drafts=False, namespace="specmesh-smollm2-dflash"))
    yield handle
    handle.stop()


def _client(handle):
    from openai import OpenAI

    return OpenAI(base_url=f"{handle.url}/v1", api_key="x", max_retries=0, timeout=300)


def test_shipped_dflash_greedy_equals_plain_decode_with_drafts_made(cluster):
    loaded = load_model(None, dtype="float32")
    plain = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=0,
                             eos_token_ids=loaded.config.eos_token_ids)
    prompts = load_prompts()[:3]
    refs = plain.generate([chat_prompt_ids(loaded.tokenizer, p["messages"]) for p in prompts],
                          SamplingParams(max_tokens=MAX_TOKENS))
    client = _client(cluster)
    drafted = 0
    for p, ref in zip(prompts, refs):
        resp = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=p["messages"], max_tokens=MAX_TOKENS,
            temperature=0, extra_body={"return_token_ids": True})
        assert resp.choices[0].model_extra["token_ids"] == list(ref.token_ids), p["name"]
        drafted += resp.model_extra["spec_stats"]["num_draft_tokens"]
    assert drafted > 0


def test_shipped_dflash_seeded_output_is_the_same_with_speculation_on_and_off(cluster):
    client = _client(cluster)
    msgs = [{"role": "user", "content": "Write one sentence about the sea."}]
    out = {}
    for k in (0, 4):
        resp = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=MAX_TOKENS,
            temperature=1.0, seed=42,
            extra_body={"return_token_ids": True, "num_speculative_tokens": k})
        out[k] = resp.choices[0].model_extra["token_ids"]
    assert out[0] == out[4] and len(out[0]) == MAX_TOKENS
