"""End to end through the Ray cluster (prefill, verifier, drafter, gateway in their own
processes, ZMQ between them) on a tiny random Llama: the output token ids over HTTP
(``return_token_ids``) equal plain greedy decode's, with drafts accepted; clients that hang up
leave no state behind in any role."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray
import zmq

from specmesh.cluster.config import ClusterConfig
from specmesh.gateway.tokens import chat_prompt_ids
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.cluster.launcher import start_cluster
from specmesh.engine.loader import load_model
from specmesh.protocol.codec import encode
from specmesh.protocol.messages import PROTOCOL_VERSION, Abort, Hello, ModelIdentity, SamplingParams

pytestmark = pytest.mark.ray

#: plain greedy on the tiny model repeats itself after the second and third (drafts accepted)
PROMPTS = ["The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12", "Count: 1, 2, 3, 4, 5,"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_model_dir):
    cfg = ClusterConfig.create(model=tiny_model_dir, dtype="float32", num_speculative_tokens=3,
                        kv_cache_mb=32, port=0, max_model_len=1024)
    handle = start_cluster(cfg)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Plain greedy (kappa = 0) through the in-process workers."""
    loaded = load_model(tiny_model_dir, dtype="float32")
    c = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=0,
                         eos_token_ids=loaded.config.eos_token_ids)
    tok = loaded.tokenizer

    def run(prompt_ids: list[int]) -> list[int]:
        """Plain greedy's output token ids."""
        (out,) = c.generate([prompt_ids], SamplingParams(max_tokens=MAX_TOKENS))
        return list(out.token_ids)

    return tok, run


def _complete(url, prompt, stream=False, **extra):
    """One completion with ``return_token_ids``; streaming: ``{"ids", "text", "last"}`` (the
    ids of every chunk joined, the last chunk)."""
    body = {"model": extra.pop("model", None), "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": stream, "return_token_ids": True, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()
    ids, text, last = [], "", None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices", []):
                text += ch.get("text") or ""
                ids += ch.get("token_ids") or []
            last = ev
    return {"ids": ids, "text": text, "last": last}


def test_http_equals_plain_greedy_streaming_and_not(cluster, reference):
    tok, run = reference
    accepted = 0
    for prompt in PROMPTS:
        prompt_ids = list(tok(prompt)["input_ids"])
        want = run(prompt_ids)
        got = _complete(cluster.url, prompt)
        assert got["choices"][0]["token_ids"] == want, prompt
        assert got["choices"][0]["prompt_token_ids"] == prompt_ids
        assert got["usage"]["completion_tokens"] == len(want)
        accepted += got["spec_stats"]["num_accepted_tokens"]
        streamed = _complete(cluster.url, prompt, stream=True,
                             stream_options={"include_usage": True})
        assert streamed["ids"] == want, prompt
        accepted += streamed["last"]["spec_stats"]["num_accepted_tokens"]
    assert accepted > 0, "no draft accepted: the drafter link is broken"


def test_chat_equals_plain_greedy(cluster, reference):
    tok, run = reference
    messages = [{"role": "user", "content": "Name three colors."}]
    prompt_ids = chat_prompt_ids(tok, messages)
    r = httpx.post(f"{cluster.url}/v1/chat/completions", timeout=120,
                   json={"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
                         "return_token_ids": True})
    r.raise_for_status()
    body = r.json()
    assert body["prompt_token_ids"] == prompt_ids
    assert body["choices"][0]["token_ids"] == run(prompt_ids)


def test_roles_in_distinct_processes_and_no_ray_calls_per_token(cluster):
    before = cluster.stats()
    pids = {iid: s["pid"] for iid, s in before.items()}
    assert len(set(pids.values())) == 4, pids
    import os

    assert os.getpid() not in pids.values()
    for prompt in PROMPTS:
        _complete(cluster.url, prompt)
    after = cluster.stats()
    generated = after["verifier-0"]["num_generated_tokens"] - before["verifier-0"]["num_generated_tokens"]
    assert generated >= len(PROMPTS)
    for iid in before:  # the only Ray call in between is the stats() call itself
        assert after[iid]["num_ray_calls"] - before[iid]["num_ray_calls"] == 1, iid


def test_verifier_prometheus_metrics(cluster):
    _complete(cluster.url, PROMPTS[1])
    info = ray.get(cluster.actors["verifier-0"].info.remote())
    text = httpx.get(info["metrics_url"], timeout=10).text
    for name in ("specmesh:spec_decode_num_draft_tokens_total",
                 "specmesh:spec_decode_num_accepted_tokens_per_pos_total",
                 "specmesh:kv_transfer_bytes_total", "specmesh:kv_cache_usage_perc",
                 "specmesh:num_requests_running"):
        assert name in text, name
    assert 'position="0"' in text
    gw = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert "specmesh:time_to_first_token_seconds" in gw


def _samples(text: str) -> dict:
    """(sample name, sorted labels) -> value of a Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


#: series that stand still on an idle role (its step-phase timings move with every idle turn)
STILL_SERIES = ("specmesh:spec_decode_", "specmesh:kv_cache_usage_perc",
                "specmesh:protocol_errors", "specmesh:kv_transfer_bytes",
                "specmesh:num_requests_", "specmesh:stale_tail_tokens")


def test_one_gateway_scrape_carries_every_roles_series(cluster):
    """Issue 9: one GET of the gateway's /metrics has the verifier's KV usage and
    per-position acceptance, the prefill's and the drafter's series, each labelled by role and
    instance, with the values a direct scrape of the role's own endpoint (which stays) reads."""
    _complete(cluster.url, PROMPTS[1])
    roster = ray.get(cluster.controller.get_roster.remote())
    roles = {e["instance_id"]: (e["role"], e["metrics_url"]) for e in roster
             if e.get("metrics_url")}
    assert sorted(r for r, _ in roles.values()) == ["drafter", "prefill", "verifier"]
    gw = _samples(httpx.get(f"{cluster.url}/metrics", timeout=30).text)
    vl = (("instance", "verifier-0"), ("role", "verifier"))
    assert ("specmesh:kv_cache_usage_perc", vl) in gw
    per_pos = {dict(lb)["position"]: v for (n, lb), v in gw.items()
               if n == "specmesh:spec_decode_num_accepted_tokens_per_pos_total"
               and dict(lb)["role"] == "verifier"}
    assert {"0", "1", "2"} <= set(per_pos) and per_pos["0"] > 0, per_pos
    for iid, (role, url) in roles.items():
        mine = {k: v for k, v in gw.items() if ("instance", iid) in k[1]}
        assert mine and all(("role", role) in lb for _, lb in mine), (iid, mine)
        assert any(n.startswith("specmesh:step_phase_seconds") for n, _ in mine), iid
        assert ("specmesh:protocol_errors_total", (("instance", iid), ("role", role))) in mine
        direct = _samples(httpx.get(url, timeout=30).text)
        still = {k: v for k, v in direct.items() if k[0].startswith(STILL_SERIES)}
        assert still and all(mine[k] == v for k, v in still.items()), (iid, still)
    assert not any(n.startswith("specmesh:metrics_scrape_errors_total") and v
                   for (n, _), v in gw.items())


#: clients that hang up: how many, how many at once, and requests long enough (EOS ignored)
#: to be mid-generation when their client goes (prompt + max_tokens within max_model_len)
HANGUP_CLIENTS, HANGUP_CONCURRENCY, HANGUP_MAX_TOKENS = 200, 40, 400
#: how long every role may take to drop the state of requests whose client went away
LEFTOVER_BOUND_S = 20.0


def _leftovers(cluster) -> dict[str, float]:
    """What the roles still hold for requests: all zero on an idle cluster."""
    st = cluster.stats()
    v, d, g = st["verifier-0"], st["drafter-0"], st["gateway-0"]
    return {"verifier_kv_cache_usage": v["kv_cache_usage"],
            "verifier_requests": len(v["requests"]),
            "verifier_running": v["num_running"], "verifier_waiting": v["num_waiting"],
            "drafter_requests": d["num_requests"], "gateway_pending": g["num_in_flight"]}


def _wait_no_leftovers(cluster) -> tuple[dict[str, float], float]:
    """Poll until no role holds request state or LEFTOVER_BOUND_S passed: (last, seconds)."""
    t0 = time.monotonic()
    while True:
        left = _leftovers(cluster)
        if not any(left.values()) or time.monotonic() - t0 > LEFTOVER_BOUND_S:
            return left, time.monotonic() - t0
        time.sleep(0.2)


async def _hang_up_after_first_token(client: httpx.AsyncClient, i: int) -> bool:
    """Stream one request and close the connection right after its first content chunk;
    True when that chunk came."""
    body = {"prompt": f"{PROMPTS[i % len(PROMPTS)]} {i}", "max_tokens": HANGUP_MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return False
        async for line in r.aiter_lines():
            if (line.startswith("data: ") and line != "data: [DONE]"
                    and any(ch.get("text") for ch in json.loads(line[6:])["choices"])):
                return True  # leaving the block closes the connection mid-stream
    return False


def test_streaming_clients_that_hang_up_after_the_first_token_leave_nothing(cluster,
                                                                            reference):
    """Issue 9: 200 streaming requests closed by the client after their first token: verifier
    KV usage back to zero, no drafter state left, gateway pending table empty (within
    LEFTOVER_BOUND_S); the requests were really cut short; a new request is exact."""
    tok, run = reference
    assert not any(_leftovers(cluster).values()), _leftovers(cluster)
    generated = cluster.stats()["verifier-0"]["num_generated_tokens"]

    async def main() -> list[bool]:
        sem = asyncio.Semaphore(HANGUP_CONCURRENCY)
        limits = httpx.Limits(max_connections=HANGUP_CONCURRENCY)
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120, limits=limits) as c:
            async def one(i: int) -> bool:
                async with sem:
                    return await _hang_up_after_first_token(c, i)

            return await asyncio.gather(*(one(i) for i in range(HANGUP_CLIENTS)))

    got_first = asyncio.run(main())
    assert all(got_first), f"{got_first.count(False)} requests never streamed a token"
    left, waited = _wait_no_leftovers(cluster)
    assert not any(left.values()), f"after {waited:.1f} s the roles still hold: {left}"
    generated = cluster.stats()["verifier-0"]["num_generated_tokens"] - generated
    # aborted, not run to max_tokens (every request ran to the end would be 80,000)
    assert generated < HANGUP_CLIENTS * HANGUP_MAX_TOKENS // 4, generated
    print(f"200 hung-up streams: {generated} tokens generated, state gone {waited:.1f} s "
          "after the last client left")
    prompt_ids = list(tok(PROMPTS[1])["input_ids"])
    assert _complete(cluster.url, PROMPTS[1])["choices"][0]["token_ids"] == run(prompt_ids)


def test_non_streaming_clients_that_hang_up_leave_nothing(cluster, reference):
    """Issue 9: 20 non-streaming clients that give up before the response (read timeout; half
    of them after 50 ms, while their requests are still queued or prefilling): the gateway's
    pending table and the verifier's request table do not grow."""
    tok, run = reference
    n, max_tokens = 20, 900
    generated = cluster.stats()["verifier-0"]["num_generated_tokens"]

    def give_up(i: int) -> str:
        body = {"prompt": f"{PROMPTS[i % len(PROMPTS)]} {i}", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        try:
            r = httpx.post(f"{cluster.url}/v1/completions", json=body,
                           timeout=httpx.Timeout(10.0, read=0.05 if i % 2 else 1.0))
        except httpx.ReadTimeout:
            return "hung up"
        return f"answered {r.status_code}: {r.text[:200]}"

    with ThreadPoolExecutor(n) as pool:
        outcomes = list(pool.map(give_up, range(n)))
    assert outcomes == ["hung up"] * n
    left, waited = _wait_no_leftovers(cluster)
    assert not any(left.values()), f"after {waited:.1f} s the roles still hold: {left}"
    generated = cluster.stats()["verifier-0"]["num_generated_tokens"] - generated
    assert generated < n * max_tokens // 4, generated
    prompt_ids = list(tok(PROMPTS[2])["input_ids"])
    assert _complete(cluster.url, PROMPTS[2])["choices"][0]["token_ids"] == run(prompt_ids)


def _raw_dealer(endpoint: str, identity: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt_string(zmq.IDENTITY, identity)
    s.connect(endpoint)
    return s


def test_garbage_wrong_hello_and_early_messages_are_counted(cluster, reference):

    roster = ray.get(cluster.controller.get_roster.remote())
    before = cluster.stats()
    bad_model = ModelIdentity(name="other", vocab_size=7, dtype="float32", num_layers=1,
                              num_kv_heads=1, head_dim=2, block_size=16, kv_cache_dtype="float32")
    socks = []
    for entry in roster:
        s1 = _raw_dealer(entry["endpoint"], "rogue-garbage")
        s1.send_multipart([b"\xc1\x00garbage", b"more"])
        s2 = _raw_dealer(entry["endpoint"], "rogue-early")
        s2.send_multipart(encode(Abort(request_id="x")))
        s3 = _raw_dealer(entry["endpoint"], "rogue-hello")
        s3.send_multipart(encode(Hello(protocol_version=PROTOCOL_VERSION, role="drafter",
                                       instance_id="rogue-hello", incarnation=1,
                                       model=bad_model)))
        socks += [s1, s2, s3]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        after = cluster.stats()
        if all(after[e["instance_id"]]["num_protocol_errors"]
               - before[e["instance_id"]]["num_protocol_errors"] >= 3
               for e in roster):
            break
        time.sleep(0.2)
    assert {e["role"] for e in roster} == {"prefill", "verifier", "drafter", "gateway"}
    for e in roster:
        iid = e["instance_id"]
        assert after[iid]["num_protocol_errors"] - before[iid]["num_protocol_errors"] >= 3, iid
    for s in socks:
        s.close(0)
    # every role keeps serving
    tok, run = reference
    want = run(list(tok(PROMPTS[0])["input_ids"]))
    assert _complete(cluster.url, PROMPTS[0])["choices"][0]["token_ids"] == want
    health = {iid: ray.get(a.health.remote()) for iid, a in cluster.actors.items()}
    assert all(h["alive"] for h in health.values()), health


def test_requests_survive_a_drafter_restart(cluster, reference):
    """Kill the drafter actor mid-stream: Ray restarts it (new incarnation, new endpoint), it
    re-registers, the verifier reconnects and re-syncs; the output stays exact."""
    import threading

    tok, run = reference
    prompt = PROMPTS[2]
    want = run(list(tok(prompt)["input_ids"]))
    old = ray.get(cluster.actors["drafter-0"].info.remote())
    result = {}

    def request():
        result["got"] = _complete(cluster.url, prompt, stream=True)["ids"]

    t = threading.Thread(target=request)
    t.start()
    time.sleep(0.2)
    ray.kill(cluster.actors["drafter-0"], no_restart=False)
    t.join(timeout=120)
    assert result["got"] == want
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            new = ray.get(cluster.actors["drafter-0"].info.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - restarting
            time.sleep(0.5)
            continue
        if new["incarnation"] != old["incarnation"]:
            break
    assert new["incarnation"] != old["incarnation"] and new["endpoint"] != old["endpoint"]
    while time.monotonic() < deadline:  # re-registered, pushed, and the verifier reconnected
        roster = {r["instance_id"]: r for r in ray.get(cluster.controller.get_roster.remote())}
        st = cluster.stats()["verifier-0"]
        # (while Ray restarted it, the health check may have deregistered the old entry)
        if (roster.get("drafter-0", {}).get("incarnation") == new["incarnation"]
                and st["peer_incarnations"].get("drafter-0") == new["incarnation"]):
            break
        time.sleep(0.2)
    assert st["peer_incarnations"].get("drafter-0") == new["incarnation"]
    before = cluster.stats()["drafter-0"]["num_draft_tokens_sent"]
    accepted = 0
    for p in PROMPTS:
        want = run(list(tok(p)["input_ids"]))
        got = _complete(cluster.url, p)
        assert got["choices"][0]["token_ids"] == want, p
        accepted += got["spec_stats"]["num_accepted_tokens"]
    assert cluster.stats()["drafter-0"]["num_draft_tokens_sent"] > before  # drafting again
    assert accepted > 0  # and its drafts are accepted
