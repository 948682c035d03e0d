"""A multi-layer EAGLE head (2 modules, `--drafter eagle:PATH` of a head trained with
``specmesh train-drafter --num-steps 2``) end to end through the Ray cluster (prefill,
verifier, drafter and gateway in their own processes): greedy chat output equals plain decode
with drafts accepted, a seeded request is the same with speculation on (drafts accepted) and
off, and the drafter's stats report the head's weights, KV pool and per-module cost."""

from __future__ import annotations

from dataclasses import replace

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
def steps_cluster(ray_session, tiny_model_dir, tiny_eagle_steps_head):
    head_dir, _ = tiny_eagle_steps_head
    method, kwargs = parse_drafter(f"eagle:{head_dir}", tiny_model_dir)
    cfg = ClusterConfig.create(model=tiny_model_dir, dtype="float32", num_speculative_tokens=3,
                               kv_cache_mb=32, port=0, max_model_len=1024,
                               draft_method=method, drafter_method_kwargs=kwargs)
    handle = start_cluster(replace(cfg, namespace="specmesh-test-eagle-steps"))
    yield handle
    handle.stop()


def _chat(url: str, msgs: list, **fields) -> tuple[list[int], dict]:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "messages": msgs, "max_tokens": MAX_TOKENS, "return_token_ids": True, **fields})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["token_ids"], body["spec_stats"]


def test_served_two_module_head_greedy_equal_plain_and_seeded_on_equal_off(
        steps_cluster, tiny_model_dir, tiny_eagle_steps_head):
    _, messages = tiny_eagle_steps_head
    lm = load_model(tiny_model_dir, "float32")
    plain = InProcessCluster(lm.model, lm.config, num_speculative_tokens=0,
                             eos_token_ids=lm.config.eos_token_ids)
    drafted = accepted = 0
    for msgs in messages[:5]:
        (want,) = plain.generate(chat_token_ids(lm.tokenizer, [{"messages": msgs}]),
                                 SamplingParams(max_tokens=MAX_TOKENS))
        got, stats = _chat(steps_cluster.url, msgs, temperature=0)
        assert got == list(want.token_ids)
        drafted += stats["num_draft_tokens"]
        accepted += stats["num_accepted_tokens"]
    assert drafted > 0 and accepted > 0
    seeded_accepted = 0
    for i, msgs in enumerate(messages[:4]):
        fields = {"temperature": 0.05, "seed": 7 + i}  # sampled, close to the greedy path
        on, stats = _chat(steps_cluster.url, msgs, num_speculative_tokens=3, **fields)
        off, off_stats = _chat(steps_cluster.url, msgs, num_speculative_tokens=0, **fields)
        assert on == off
        assert off_stats["num_draft_tokens"] == 0
        seeded_accepted += stats["num_accepted_tokens"]
    assert seeded_accepted > 0
    st = steps_cluster.stats()["drafter-0"]
    assert st["draft_num_steps"] == 2 and st["draft_weights_bytes"] > 0
    assert len(st["draft_step_ms"]) == 2 and st["draft_step_forwards"][1] > 0
    assert "draft_kv_pool_bytes" in st
