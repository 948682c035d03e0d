"""Suffix decoding served end to end through the Ray cluster (``specmesh serve --drafter
suffix``: the method resolved by the registry in the driver and in the role processes, the
drafter's history shared across requests): the output token ids over HTTP equal plain greedy
decoding's (kappa 0), and a prompt whose first answer has nothing to draft from gets drafts
accepted when asked again (drafted from the drafter's history of earlier outputs)."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest

from specmesh.cluster.cli import build_parser
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.cluster.launcher import start_cluster
from specmesh.cluster.options import cluster_config
from specmesh.engine.loader import load_model
from specmesh.gateway.tokens import completion_prompt_ids
from specmesh.protocol.messages import SamplingParams

pytestmark = pytest.mark.ray

#: plain greedy on the tiny model: the first two never repeat themselves within MAX_TOKENS
#: (no drafts from the request alone), the third does
PROMPTS = ["Tell me a story about a dragon.", "Why is the sky blue?",
           "1 2 3 4 5 6 7 8 9 10 11 12"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def suffix_cluster(ray_session, tiny_model_dir):
    args = build_parser().parse_args([
        "serve", "--model", tiny_model_dir, "--dtype", "float32", "--device", "cpu",
        "--num-speculative-tokens", "3", "--kv-cache-mb", "32", "--max-model-len", "1024",
        "--port", "0", "--drafter", "suffix"])
    cfg = replace(cluster_config(args), namespace="specmesh-test-suffix")
    assert (cfg.drafter.method, cfg.drafter.method_kwargs) == ("suffix", {})
    handle = start_cluster(cfg)
    yield handle
    handle.stop()


def _complete(url: str, prompt: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_served_suffix_equals_plain_greedy_and_drafts_from_earlier_outputs(
        suffix_cluster, tiny_model_dir):
    lm = load_model(tiny_model_dir, "float32")
    plain = InProcessCluster(lm.model, lm.config, num_speculative_tokens=0,
                             eos_token_ids=lm.config.eos_token_ids)
    accepted: dict[str, list[int]] = {p: [] for p in PROMPTS}
    for _ in range(2):  # the second round finds the first round's outputs in the history
        for prompt in PROMPTS:
            (want,) = plain.generate([completion_prompt_ids(lm.tokenizer, prompt)],
                                     SamplingParams(max_tokens=MAX_TOKENS))
            body = _complete(suffix_cluster.url, prompt)
            assert body["choices"][0]["token_ids"] == list(want.token_ids), prompt
            assert body["spec_stats"]["synthetic_acceptance"] is False
            accepted[prompt].append(body["spec_stats"]["num_accepted_tokens"])
    assert accepted[PROMPTS[2]][0] > 0  # drafted from the request itself
    for prompt in PROMPTS[:2]:  # nothing to draft the first time, the history the second
        first, second = accepted[prompt]
        assert second > first and second > 0, (prompt, accepted)
