"""Logprobs end to end through the Ray cluster (prefill, verifier, drafter, gateway in their own
processes, ZMQ between them) on the tiny random Llama (issue 33): with speculation on (drafts
accepted) a completion's logprobs equal plain decode's in process (speculation off) within
1e-5, streamed or not; an lm-evaluation-harness loglikelihood request (a list of token-id
prompts, ``echo``, ``logprobs: 1``, ``max_tokens: 1``) gets the prompt's logprobs; the
tokenizer endpoints answer."""

from __future__ import annotations

import json

import httpx
import pytest

from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.cluster.launcher import start_cluster
from specmesh.engine.loader import load_model
from specmesh.protocol.messages import SamplingParams, TokenLogprobs

pytestmark = pytest.mark.ray

#: plain greedy on the tiny model repeats itself on these (drafts accepted)
PROMPTS = ["1 2 3 4 5 6 7 8 9 10 11 12", "Count: 1, 2, 3, 4, 5,"]
MAX_TOKENS = 24
TOP = 3


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_model_dir):
    cfg = ClusterConfig.create(model=tiny_model_dir, dtype="float32", num_speculative_tokens=3,
                               kv_cache_mb=32, port=0, max_model_len=1024)
    handle = start_cluster(cfg)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    """Plain decode (kappa 0) in process, with logprobs: (tokenizer, run)."""
    loaded = load_model(tiny_model_dir, dtype="float32")
    c = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=0,
                         eos_token_ids=loaded.config.eos_token_ids)

    def run(prompt_ids: list[int]):
        (out,) = c.generate([prompt_ids], SamplingParams(max_tokens=MAX_TOKENS, logprobs=TOP,
                                                         prompt_logprobs=TOP))
        return out

    return loaded.tokenizer, run


def _close(a: list, b: list, tol: float = 1e-5) -> None:
    assert len(a) == len(b)
    assert all(abs(x - y) <= tol for x, y in zip(a, b)), (a, b)


def test_served_logprobs_equal_plain_decode(cluster, plain):
    tok, run = plain
    accepted = 0
    for prompt in PROMPTS:
        want = run(list(tok(prompt)["input_ids"]))
        want_lp = TokenLogprobs.concat(want.logprobs)
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": TOP,
                "return_token_ids": True}
        r = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        accepted += out["spec_stats"]["num_accepted_tokens"]
        assert choice["token_ids"] == want.token_ids
        _close(choice["logprobs"]["token_logprobs"], want_lp.token_logprobs)
        lps = []
        with httpx.stream("POST", f"{cluster.url}/v1/completions",
                          json={**body, "stream": True}, timeout=120) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for ch in json.loads(line[6:])["choices"]:
                        lps += (ch["logprobs"] or {}).get("token_logprobs", [])
        _close(lps, want_lp.token_logprobs)
    assert accepted > 0, "no draft accepted: speculation was off"


def test_served_loglikelihood_request(cluster, plain):
    tok, run = plain
    prompts = [list(tok(p)["input_ids"]) for p in PROMPTS]
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
        "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    for choice, ids in zip(choices, prompts):
        want = run(ids)
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(ids) + 1
        _close(lp["token_logprobs"][1:len(ids)], want.prompt_logprobs.token_logprobs)
        _close(lp["token_logprobs"][len(ids):], want.logprobs[0].token_logprobs[:1])
    info = httpx.get(f"{cluster.url}/tokenizer_info", timeout=30).json()
    assert info["tokenizer_class"] and info["eos_token"]
    r = httpx.post(f"{cluster.url}/tokenize", json={"prompt": PROMPTS[0]}, timeout=30).json()
    assert r["tokens"] == prompts[0] and r["count"] == len(prompts[0])


def _counter(url: str, name: str) -> float:
    """The sum of a counter over every role's series in the gateway's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_served_n_choices_prefill_once_and_equal_n1(cluster, plain):
    """``n`` through the Ray cluster: the four choices are siblings on one verifier, the prompt
    prefilled once (the prefill role's counter) and three forked from its KV, each equal to
    plain greedy decode, drafts accepted."""
    tok, run = plain
    prompt = PROMPTS[0]
    want = run(list(tok(prompt)["input_ids"]))
    prefills = _counter(cluster.url, "specmesh:prefill_requests_total")
    forks = _counter(cluster.url, "specmesh:sibling_forks_total")
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "n": 4,
            "return_token_ids": True}
    r = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [ch["index"] for ch in out["choices"]] == [0, 1, 2, 3]
    assert all(ch["token_ids"] == want.token_ids for ch in out["choices"])
    assert out["spec_stats"]["num_accepted_tokens"] > 0
    assert _counter(cluster.url, "specmesh:prefill_requests_total") == prefills + 1
    assert _counter(cluster.url, "specmesh:sibling_forks_total") == forks + 3
