"""The served cluster on CUDA (issue 10 item 6; skipped without a GPU, deselected in CI): model
and KV of prefill and verifier on the GPU, output equal to plain greedy decode on the CPU."""

from __future__ import annotations

import httpx
import pytest
import torch

from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.cluster.launcher import start_cluster
from specmesh.engine.loader import load_model
from specmesh.protocol.messages import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.ray,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = ["The capital of France is", "def fibonacci(n): return fibonacci(n - 1) +"]
MAX_TOKENS = 24


def test_cuda_cluster_equals_cpu_plain_decode(ray_session, tiny_model_dir):
    loaded = load_model(tiny_model_dir, dtype="float32")
    ref = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=0,
                           eos_token_ids=loaded.config.eos_token_ids)
    handle = start_cluster(ClusterConfig.create(model=tiny_model_dir, dtype="float32",
                                                device="cuda", num_speculative_tokens=3,
                                                kv_cache_mb=32, port=0, max_model_len=1024))
    try:
        accepted = 0
        for prompt in PROMPTS:
            ids = list(loaded.tokenizer(prompt)["input_ids"])
            (want,) = ref.generate([ids], SamplingParams(max_tokens=MAX_TOKENS))
            r = httpx.post(f"{handle.url}/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["token_ids"] == list(want.token_ids), prompt
            accepted += body["spec_stats"]["num_accepted_tokens"]
        assert accepted > 0, "no draft was accepted on the GPU cluster"
    finally:
        handle.stop()
