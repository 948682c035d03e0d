"""Frozen-KV MTP end to end through the Ray cluster (`--drafter frozen-kv-mtp:PATH`: prefill,
verifier, drafter and gateway in their own processes on this node; the verifier's KV pool in
shared memory, mapped read-only by the drafter, each request's committed rows sent with its
commits) with an assistant trained on the tiny target by ``specmesh train-drafter --method
frozen-kv-mtp``: greedy chat output equals plain decode with drafts accepted, a seeded request
is the same with speculation on (drafts accepted) and off, and the drafter reports no draft KV
pool (issue 36 item 4)."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest

from helpers.frozen_kv import train_tiny_frozen_kv
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
def assistant(tiny_model_dir, tmp_path_factory):
    return train_tiny_frozen_kv(tiny_model_dir, tmp_path_factory.mktemp("served-frozen-kv"))


@pytest.fixture(scope="module")
def frozen_kv_cluster(ray_session, tiny_model_dir, assistant):
    path, _ = assistant
    method, kwargs = parse_drafter(f"frozen-kv-mtp:{path}", tiny_model_dir)
    cfg = ClusterConfig.create(model=tiny_model_dir, dtype="float32", num_speculative_tokens=3,
                               kv_cache_mb=32, port=0, max_model_len=1024,
                               draft_method=method, drafter_method_kwargs=kwargs)
    handle = start_cluster(replace(cfg, namespace="specmesh-test-frozen-kv"))
    yield handle
    handle.stop()


def _chat(url: str, msgs: list, **fields) -> tuple[list[int], dict]:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "messages": msgs, "max_tokens": MAX_TOKENS, "return_token_ids": True, **fields})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["token_ids"], body["spec_stats"]


def test_served_frozen_kv_greedy_equals_plain_and_seeded_on_equals_off(frozen_kv_cluster,
                                                                       tiny_model_dir,
                                                                       assistant):
    _, messages = assistant
    lm = load_model(tiny_model_dir, "float32")
    plain = InProcessCluster(lm.model, lm.config, num_speculative_tokens=0,
                             eos_token_ids=lm.config.eos_token_ids)
    drafted = accepted = 0
    for msgs in messages[:5]:
        (want,) = plain.generate(chat_token_ids(lm.tokenizer, [{"messages": msgs}]),
                                 SamplingParams(max_tokens=MAX_TOKENS))
        got, stats = _chat(frozen_kv_cluster.url, msgs, temperature=0)
        assert got == list(want.token_ids)
        drafted += stats["num_draft_tokens"]
        accepted += stats["num_accepted_tokens"]
    assert drafted > 0 and accepted > 0
    seeded_accepted = 0
    for i, msgs in enumerate(messages[:4]):
        fields = {"temperature": 0.05, "seed": 7 + i}  # sampled, close to the greedy path
        on, stats = _chat(frozen_kv_cluster.url, msgs, num_speculative_tokens=3, **fields)
        off, off_stats = _chat(frozen_kv_cluster.url, msgs, num_speculative_tokens=0, **fields)
        assert on == off
        assert off_stats["num_draft_tokens"] == 0
        seeded_accepted += stats["num_accepted_tokens"]
    assert seeded_accepted > 0
    # the drafter owns no draft KV pool; it reports its weights and what it did not allocate
    drafter = frozen_kv_cluster.stats()["drafter-0"]
    assert drafter["draft_kv_pool_bytes"] == 0
    assert drafter["draft_weights_bytes"] > 0
    assert drafter["draft_kv_bytes_per_token_avoided"] == 2 * 2 * 16 * 4  # h_kv 2, d_h 16, fp32
