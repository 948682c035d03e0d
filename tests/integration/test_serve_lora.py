"""LoRA adapters served end to end through the Ray cluster (prefill, verifier, n-gram drafter and
gateway in their own processes) on the tiny random Llama (issue 37): ``--lora-modules`` loads
two adapters (made here with PEFT) into prefill and verifier, ``/v1/models`` lists them, and
one mixed batch of requests on the base and on each adapter, sent at once, gives with
speculation (k = 4, drafts from the base, accepted) exactly the tokens it gives without."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import pytest

from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.launcher import start_cluster
from helpers.lora import make_tiny_adapter

pytestmark = pytest.mark.ray

PROMPT = "1 2 3 4 5 6 7 8 9 10 11 12"
MAX_TOKENS = 24
MODELS = ("base", "mild", "strong")


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    root = tmp_path_factory.mktemp("served-lora")
    mild = make_tiny_adapter(hf, root / "mild", seed=1, std=0.05)
    strong = make_tiny_adapter(hf, root / "strong", seed=2, std=0.3,
                               targets=["q_proj", "v_proj", "down_proj", "lm_head"])
    cfg = ClusterConfig.create(model=tiny_model_dir, dtype="float32", num_speculative_tokens=4,
                               kv_cache_mb=32, port=0, max_model_len=1024,
                               lora_modules=(f"mild={mild}", f"strong={strong}"))
    handle = start_cluster(replace(cfg, namespace="specmesh-test-lora"))
    yield handle
    handle.stop()


def _complete(url: str, model: str, k: int) -> tuple[list[int], dict]:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "return_token_ids": True,
            "temperature": 0, "ignore_eos": True, "num_speculative_tokens": k}
    if model != "base":
        body["model"] = model
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["token_ids"], out["spec_stats"]


def test_models_lists_the_adapters_and_unknown_is_404(cluster):
    cards = httpx.get(f"{cluster.url}/v1/models", timeout=30).json()["data"]
    ids = [c["id"] for c in cards]
    assert ids[1:] == ["mild", "strong"]
    assert all(c["parent"] == ids[0] for c in cards[1:])
    r = httpx.post(f"{cluster.url}/v1/completions",
                   json={"prompt": PROMPT, "max_tokens": 2, "model": "nope"}, timeout=30)
    assert r.status_code == 404 and "nope" in r.text


def test_mixed_batch_speculation_equals_plain_per_adapter(cluster):
    off = {m: _complete(cluster.url, m, 0) for m in MODELS}
    assert all(stats["num_draft_tokens"] == 0 for _, stats in off.values())
    assert off["strong"][0] != off["base"][0], "the strong adapter changed nothing"
    accepted = dict.fromkeys(MODELS, 0)
    for _ in range(3):  # the drafter runs ahead on its own: on a loaded host it may miss
        with ThreadPoolExecutor(len(MODELS) * 2) as pool:  # one mixed batch, sent at once
            jobs = [(m, pool.submit(_complete, cluster.url, m, 4)) for m in MODELS * 2]
            for m, job in jobs:
                on, stats = job.result()
                assert on == off[m][0], m
                accepted[m] += stats["num_accepted_tokens"]
        if all(accepted.values()):
            break
    assert accepted["base"] > 0 and sum(accepted.values()) > accepted["base"], accepted
    # acceptance per adapter in Prometheus (the gateway's series, labelled lora_name)
    text = httpx.get(f"{cluster.url}/metrics", timeout=30).text
    drafted = {m: _sample(text, "specmesh:lora_spec_decode_num_draft_tokens_total", m)
               for m in MODELS}
    taken = {m: _sample(text, "specmesh:lora_spec_decode_num_accepted_tokens_total", m)
             for m in MODELS}
    assert all(drafted[m] > 0 for m in MODELS), drafted
    assert sum(taken.values()) >= sum(accepted.values()) and taken["base"] > 0, taken


def _sample(text: str, name: str, lora: str) -> float:
    """The value of series ``name{lora_name="lora"}`` in a Prometheus exposition (0: none)."""
    for line in text.splitlines():
        if line.startswith(f'{name}{{lora_name="{lora}"}}'):
            return float(line.split()[-1])
    return 0.0
