"""EAGLE drafting end to end through the Ray cluster (`--drafter eagle:PATH`, prefill,
verifier, drafter and gateway in their own processes, seed state over ZMQ): chat output token
ids equal plain greedy decoding and drafts are accepted. The head is an EAGLE-3 fused one (it
reads decoder layers 1 and 0), so the prefill and verifier roles learn its seed state
("hidden:1,0") from the head's config before the drafter starts."""

from __future__ import annotations

import httpx
import pytest

from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.drafter_option import parse_drafter
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.cluster.launcher import start_cluster
from specmesh.drafter.eagle.data import chat_token_ids
from specmesh.engine.loader import load_model
from specmesh.protocol.messages import SamplingParams

pytestmark = pytest.mark.ray
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def eagle_cluster(ray_session, tiny_model_dir, tiny_fused_eagle_head):
    head_dir, _ = tiny_fused_eagle_head
    method, kwargs = parse_drafter(f"eagle:{head_dir}", tiny_model_dir)
    cfg = ClusterConfig.create(model=tiny_model_dir, dtype="float32", num_speculative_tokens=3,
                               kv_cache_mb=32, port=0, max_model_len=1024,
                               draft_method=method, drafter_method_kwargs=kwargs)
    handle = start_cluster(cfg)
    yield handle
    handle.stop()


def test_served_eagle_equals_plain_greedy_with_drafts_accepted(eagle_cluster, tiny_model_dir,
                                                               tiny_fused_eagle_head):
    _, messages = tiny_fused_eagle_head
    lm = load_model(tiny_model_dir, "float32")
    plain = InProcessCluster(lm.model, lm.config, num_speculative_tokens=0,
                             eos_token_ids=lm.config.eos_token_ids)
    accepted = drafted = 0
    for msgs in messages[:5]:
        (want,) = plain.generate(chat_token_ids(lm.tokenizer, [{"messages": msgs}]),
                                 SamplingParams(max_tokens=MAX_TOKENS))
        r = httpx.post(f"{eagle_cluster.url}/v1/chat/completions", timeout=120, json={
            "messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["token_ids"] == list(want.token_ids)
        assert body["usage"]["completion_tokens"] == len(want.token_ids)
        drafted += body["spec_stats"]["num_draft_tokens"]
        accepted += body["spec_stats"]["num_accepted_tokens"]
    assert drafted > 0 and accepted > 0
