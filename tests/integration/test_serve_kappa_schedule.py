"""The schedule policy served (``--speculative-policy schedule``): its schedule travels in the
cluster config to the verifier process, the output over HTTP equals plain greedy decode's with
drafts accepted, and the verifier's kappa gauge comes through the gateway's ``/metrics``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.cluster.launcher import start_cluster
from specmesh.decode.kappa_schedule import parse_schedule
from specmesh.engine.loader import load_model
from specmesh.protocol.messages import SamplingParams

pytestmark = pytest.mark.ray

#: plain greedy on the tiny model repeats itself after these (n-gram drafts accepted)
PROMPTS = ["1 2 3 4 5 6 7 8 9 10 11 12", "Count: 1, 2, 3, 4, 5,"]
MAX_TOKENS = 32
#: a quick schedule: decisions from the 3rd step of a slot on, every 2nd
SCHEDULE = {"1": [1, 3], "4": [0, 2], "warmup_batches": 2, "update_interval": 2}


def test_served_schedule_policy_is_exact_and_exports_kappa(ray_session, tiny_model_dir):
    cfg = ClusterConfig.create(model=tiny_model_dir, dtype="float32", num_speculative_tokens=3,
                               kv_cache_mb=32, port=0, max_model_len=1024,
                               speculative_policy="schedule",
                               speculative_schedule=parse_schedule(SCHEDULE))
    assert cfg.drafter.window == 6  # 2 x the schedule's largest kappa
    loaded = load_model(tiny_model_dir, dtype="float32")
    ref = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=0,
                           eos_token_ids=loaded.config.eos_token_ids)
    want = [list(o.token_ids) for o in ref.generate(
        [list(loaded.tokenizer(p)["input_ids"]) for p in PROMPTS],
        SamplingParams(max_tokens=MAX_TOKENS))]
    handle = start_cluster(cfg)
    try:
        def complete(prompt: str) -> dict:
            r = httpx.post(f"{handle.url}/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()

        outs = [complete(p) for p in PROMPTS]  # batch 1, one after the other
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # then side by side
            outs += list(pool.map(complete, PROMPTS))
        for out, ids in zip(outs, want + want):
            assert out["choices"][0]["token_ids"] == ids
        accepted = sum(o["spec_stats"]["num_accepted_tokens"] for o in outs)
        assert accepted > 0
        metrics = httpx.get(f"{handle.url}/metrics", timeout=30).text
        gauge = next(ln for ln in metrics.splitlines()
                     if ln.startswith("specmesh:spec_decode_kappa{"))
        assert float(gauge.split()[-1]) in (0.0, 1.0, 2.0, 3.0)
        assert "specmesh:spec_decode_kappa_changes_total{" in metrics
    finally:
        handle.stop()
