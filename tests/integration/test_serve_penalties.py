"""Penalties and token constraints end to end through the Ray cluster (prefill, verifier,
n-gram drafter and gateway in their own processes, ZMQ between them, HTTP in front) on the
tiny random Llama (issue 33 item 3): for each of ``frequency_penalty``, ``presence_penalty``,
``repetition_penalty``, ``logit_bias``, ``min_tokens``, ``bad_words`` and
``allowed_token_ids``, greedy and seeded, the output changes with the parameter and
speculation at k = 4 and k = 8 (drafts accepted > 0) equals speculation off token for token.

The tiny model repeats itself on a counting prompt, so the n-gram drafter's drafts are
accepted; the penalties are negative (favouring tokens already seen) to keep it repeating."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
from transformers import AutoTokenizer

from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.launcher import start_cluster
from specmesh.gateway.penalties import bad_words_token_ids

pytestmark = pytest.mark.ray

PROMPT = "1 2 3 4 5 6 7 8 9 10 11 12"
MAX_TOKENS = 32
#: seeded at a low temperature: sampled (coupled rule), yet repetitive enough for n-gram drafts
MODES = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.05, "seed": 5}}


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_model_dir):
    cfg = ClusterConfig.create(model=tiny_model_dir, dtype="float32", num_speculative_tokens=4,
                               kv_cache_mb=32, port=0, max_model_len=1024)
    handle = start_cluster(replace(cfg, namespace="specmesh-test-penalties"))
    yield handle
    handle.stop()


def _complete(url: str, k: int, **fields) -> tuple[list[int], dict]:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "return_token_ids": True,
            "num_speculative_tokens": k, **fields}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["token_ids"], out["spec_stats"]


def _cases(plain: list[int], tokenizer) -> dict[str, dict]:
    """Each parameter with a value that changes ``plain`` (the output without it)."""
    late = plain[MAX_TOKENS // 2]
    # a word of the output that the gateway tokenizes back to two of its tokens (vLLM's way)
    pairs = [plain[i:i + 2] for i in range(MAX_TOKENS // 2, len(plain) - 1)]
    word = next(w for w in (tokenizer.decode(p) for p in pairs)
                if any(t in pairs for t in bad_words_token_ids(tokenizer, [w], len(tokenizer))))
    return {
        "frequency_penalty": {"frequency_penalty": -1.0},
        "presence_penalty": {"presence_penalty": -1.5},
        "repetition_penalty": {"repetition_penalty": 0.7},
        "logit_bias": {"logit_bias": {str(late): -100}},
        "bad_words": {"bad_words": [word]},
        "allowed_token_ids": {"allowed_token_ids": sorted(set(plain) - {late})},
        "min_tokens": {"min_tokens": MAX_TOKENS, "stop_token_ids": [plain[3]],
                       "ignore_eos": False},
    }


@pytest.mark.parametrize("mode", list(MODES))
def test_each_parameter_speculation_on_equals_off(cluster, tiny_model_dir, mode) -> None:
    plain, _ = _complete(cluster.url, 0, ignore_eos=True, **MODES[mode])
    accepted: dict[str, int] = {}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for name, fields in _cases(plain, tokenizer).items():
        fields = {"ignore_eos": True, **MODES[mode], **fields}
        off, stats = _complete(cluster.url, 0, **fields)
        assert stats["num_draft_tokens"] == 0
        assert off != plain, f"{name} changes nothing"
        if name == "min_tokens":
            assert len(off) == MAX_TOKENS and plain[3] not in off
        accepted[name] = 0
        for k in (4, 8):
            # the drafter runs ahead on its own: on a loaded host its tails may miss every step
            # of one request; another try (each one exact) gives it the chance to be verified
            for _ in range(3):
                on, stats = _complete(cluster.url, k, **fields)
                assert on == off, (name, k)
                accepted[name] += stats["num_accepted_tokens"]
                if stats["num_accepted_tokens"]:
                    break
    assert all(accepted.values()), accepted
