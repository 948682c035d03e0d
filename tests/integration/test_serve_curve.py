"""A served cluster with CurveZMQ between its roles and an API key at its gateway (issue 38), on
the tiny random Llama through Ray: the output over HTTP equals plain greedy decode's with
drafts accepted; a ZMQ peer whose key is not in the roster cannot deliver a single message to
the verifier (refused at the handshake, counted in its stats and metrics) while the
verifier's requests go on unchanged; a request without the key gets 401."""

from __future__ import annotations

import time

import httpx
import pytest
import ray
import zmq

from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.cluster.launcher import start_cluster
from specmesh.engine.loader import load_model
from specmesh.protocol.codec import encode
from specmesh.protocol.curve import CurveKeys
from specmesh.protocol.messages import Abort, GenerateRequest, SamplingParams
from specmesh.protocol.zmq_transport import ZmqMailbox

pytestmark = pytest.mark.ray

PROMPTS = ["The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12", "Count: 1, 2, 3, 4, 5,"]
MAX_TOKENS = 24
KEY = "curve-test-key-5b1e"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_model_dir):
    cfg = ClusterConfig.create(model=tiny_model_dir, dtype="float32", num_speculative_tokens=3,
                               kv_cache_mb=32, port=0, max_model_len=1024, transport="curve",
                               api_key=KEY, namespace="specmesh-curve-test")
    assert KEY not in repr(cfg)
    handle = start_cluster(cfg)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Plain greedy (kappa = 0) through the in-process workers: prompt -> (prompt ids,
    output ids)."""
    loaded = load_model(tiny_model_dir, dtype="float32")
    c = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=0,
                         eos_token_ids=loaded.config.eos_token_ids)

    def run(prompt: str) -> list[int]:
        ids = list(loaded.tokenizer(prompt)["input_ids"])
        (out,) = c.generate([ids], SamplingParams(max_tokens=MAX_TOKENS))
        return list(out.token_ids)

    return run


def _complete(url: str, prompt: str, headers: dict | None = AUTH) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=headers, timeout=120,
                      json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "return_token_ids": True})


def test_curve_cluster_equals_plain_greedy_with_drafts_accepted(cluster, reference):
    stats = cluster.stats()
    assert all(st["curve"] for st in stats.values()), {i: s["curve"] for i, s in stats.items()}
    roster = ray.get(cluster.controller.get_roster.remote())
    assert all(e["curve"] and len(e["curve_key"]) == 40 for e in roster)
    accepted = 0
    for prompt in PROMPTS:
        r = _complete(cluster.url, prompt)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["token_ids"] == reference(prompt), prompt
        accepted += body["spec_stats"]["num_accepted_tokens"]
    assert accepted > 0, "no draft accepted: the drafter link is broken"


def test_without_the_key_401(cluster):
    r = _complete(cluster.url, PROMPTS[0], headers=None)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = _complete(cluster.url, PROMPTS[0], headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and KEY not in r.text
    assert httpx.get(f"{cluster.url}/health", timeout=10).status_code == 200


def test_unknown_key_cannot_deliver_a_message_to_the_verifier(cluster, reference):
    roster = ray.get(cluster.controller.get_roster.remote())
    entry = next(e for e in roster if e["role"] == "verifier")
    iid = entry["instance_id"]
    before = cluster.stats()[iid]
    # an intruder that knows the verifier's public key (it is no secret) and speaks the
    # protocol, under the gateway's own name, with a key of its own
    intruder = ZmqMailbox("gateway-0", "gateway", keys=CurveKeys.generate())
    intruder.set_peer_keys({iid: entry["curve_key"].encode()})
    intruder.connect(iid, entry["endpoint"], "verifier")
    raw = zmq.Context.instance().socket(zmq.DEALER)  # and one in plain TCP
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt_string(zmq.IDENTITY, "rogue-plain")
    raw.connect(entry["endpoint"])
    forged = GenerateRequest(request_id="cmpl-forged", prompt_token_ids=[1, 2, 3],
                             sampling=SamplingParams(max_tokens=4))
    try:
        for _ in range(3):
            for msg in (forged, Abort(request_id="cmpl-forged")):
                try:
                    intruder.send(iid, msg)
                except ConnectionError:
                    pass  # refused already: its link is gone
                try:
                    raw.send_multipart(encode(msg), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # its plain-TCP handshake failed: ZMQ dropped the link
            intruder.recv(0.3)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            after = cluster.stats()[iid]
            if after["num_refused_peers"] > before["num_refused_peers"]:
                break
            time.sleep(0.2)
        assert after["num_refused_peers"] > before["num_refused_peers"]
        # not one message was decoded: no protocol error (a message before Hello would be
        # one), the forged request is unknown to the verifier
        time.sleep(1.0)
        after = cluster.stats()[iid]
        assert after["num_protocol_errors_transport"] == before["num_protocol_errors_transport"]
        assert after["num_protocol_errors"] == before["num_protocol_errors"]
        assert "cmpl-forged" not in str(after["requests"])
        assert not intruder.ready(iid)
        # the refusal is in the verifier's metrics (one gateway scrape carries every role's)
        text = httpx.get(f"{cluster.url}/metrics", timeout=30).text
        line = next(ln for ln in text.splitlines()
                    if ln.startswith("specmesh:transport_refused_peers_total")
                    and f'instance="{iid}"' in ln)
        assert float(line.split()[-1]) >= 1
        # the verifier's own requests are unaffected
        for prompt in PROMPTS[:2]:
            r = _complete(cluster.url, prompt)
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] \
                == reference(prompt)
    finally:
        raw.close(0)
        intruder.close()
