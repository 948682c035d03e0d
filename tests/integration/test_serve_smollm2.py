"""End to end through the Ray cluster on SmolLM2-135M-Instruct (float32): chat completions over
HTTP (openai client, streaming and not, vLLM's ``return_token_ids``) give the token ids of the
in-process plain greedy decode, with drafts accepted."""

from __future__ import annotations

import pytest

from cluster.gateway.tokens import chat_prompt_ids
from cluster.config import ClusterConfig
from cluster.demo import load_prompts
from cluster.launcher import start_cluster
from cluster.inprocess import InProcessCluster
from engine.loader import load_model
from protocol.messages import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def cluster(ray_session):
    handle = start_cluster(ClusterConfig.create(model=None, dtype="float32", num_speculative_tokens=4,
                                         kv_cache_mb=128, port=0))
    yield handle
    handle.stop()


def test_smollm2_http_equals_plain_greedy(cluster):
    from openai import OpenAI

    loaded = load_model(None, dtype="float32")
    tok = loaded.tokenizer
    plain = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=0,
                             eos_token_ids=loaded.config.eos_token_ids)
    client = OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0, timeout=300)
    prompts = load_prompts()[:3]
    refs = plain.generate([chat_prompt_ids(tok, p["messages"]) for p in prompts],
                          SamplingParams(max_tokens=MAX_TOKENS))
    ids = {"return_token_ids": True}
    accepted = 0
    for p, ref in zip(prompts, refs):
        want = list(ref.token_ids)
        resp = client.chat.completions.create(model="SmolLM2-135M-Instruct",
                                              messages=p["messages"], max_tokens=MAX_TOKENS,
                                              temperature=0, extra_body=ids)
        assert resp.choices[0].model_extra["token_ids"] == want, p["name"]
        assert resp.model_extra["prompt_token_ids"] == chat_prompt_ids(tok, p["messages"])
        assert resp.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
        assert resp.usage.completion_tokens == len(want)
        accepted += resp.model_extra["spec_stats"]["num_accepted_tokens"]
        stream = client.chat.completions.create(model="SmolLM2-135M-Instruct",
                                                messages=p["messages"], max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True, extra_body=ids)
        streamed = [t for ch in stream for c in ch.choices for t in c.model_extra["token_ids"]]
        assert streamed == want, p["name"]
    assert accepted > 0, "no draft accepted: the drafter link is broken"
