"""LoRA adapters loaded and unloaded at run time through the Ray cluster (prefill, verifier,
n-gram drafter and gateway in their own processes) on the tiny random Llama (issue 37):
``POST /v1/load_lora_adapter`` reaches the verifier and, through it, the prefill worker (each
its own model); requests on the adapter stream, with speculation exactly what they give
without (drafts accepted); an unload while requests on the adapter and on the base stream
fails none of them, and afterwards neither role holds a KV block; a prefill worker and a
verifier that restart afterwards serve the adapters loaded at run time."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import pytest
import ray

from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.launcher import start_cluster
from helpers.lora import make_tiny_adapter

pytestmark = pytest.mark.ray

PROMPT = "1 2 3 4 5 6 7 8 9 10 11 12"
MAX_TOKENS = 96  # long enough that the streams still run when the unload is answered


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    root = tmp_path_factory.mktemp("served-lora-runtime")
    path = make_tiny_adapter(hf, root / "late", seed=3, std=0.3)
    cfg = ClusterConfig.create(model=tiny_model_dir, dtype="float32", num_speculative_tokens=4,
                               kv_cache_mb=32, port=0, max_model_len=1024)
    handle = start_cluster(replace(cfg, namespace="specmesh-test-lora-runtime"))
    yield handle, path
    handle.stop()


def _body(model: str, k: int, stream: bool) -> dict:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "return_token_ids": True,
            "temperature": 0, "ignore_eos": True, "num_speculative_tokens": k,
            "stream": stream}
    if model != "base":
        body["model"] = model
    return body


def _complete(url: str, model: str, k: int) -> tuple[list[int], dict]:
    r = httpx.post(f"{url}/v1/completions", json=_body(model, k, False), timeout=180)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] != "late" or model == "late"
    return out["choices"][0]["token_ids"], out["spec_stats"]


def _stream(url: str, model: str, k: int, started: threading.Event) -> tuple[list[int], str]:
    ids, finish = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=_body(model, k, True),
                      timeout=180) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for ch in event["choices"]:
                ids.extend(ch.get("token_ids") or [])
                finish = ch["finish_reason"] or finish
            if ids:
                started.set()
    return ids, finish


def _kv_idle(handle) -> bool:
    """No KV block held on the verifier, none but unused cached ones on the prefill."""
    for iid, s in handle.stats().items():
        if iid.startswith("verifier") and s["kv_cache_usage"] != 0:
            return False
        if iid.startswith("prefill") and s["num_used_kv_blocks"] != s["num_evictable_kv_blocks"]:
            return False
    return True


def test_load_stream_and_unload_while_streaming(cluster):
    handle, path = cluster
    url = handle.url
    r = httpx.post(f"{url}/v1/load_lora_adapter",
                   json={"lora_name": "late", "lora_path": path}, timeout=180)
    assert r.status_code == 200, r.text
    assert "late" in [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
    off = {m: _complete(url, m, 0)[0] for m in ("base", "late")}
    assert off["late"] != off["base"], "the adapter changed nothing: the test proves nothing"
    accepted = 0
    for _ in range(3):  # the drafter runs ahead on its own: on a loaded host it may miss
        for m in ("base", "late"):
            on, stats = _complete(url, m, 4)
            assert on == off[m], m
            accepted += stats["num_accepted_tokens"]
        if accepted:
            break
    assert accepted > 0
    models = ["late", "base", "late", "base"]
    started = [threading.Event() for _ in models]
    with ThreadPoolExecutor(len(models)) as pool:
        jobs = [pool.submit(_stream, url, m, 4, ev) for m, ev in zip(models, started)]
        assert all(ev.wait(180) for ev in started)
        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"},
                       timeout=180)
        assert r.status_code == 200, r.text
        unfinished = [m for m, j in zip(models, jobs) if not j.done()]
        results = [j.result() for j in jobs]
    assert "late" in unfinished, "the adapter's streams ended before the unload: proves nothing"
    for m, (ids, finish) in zip(models, results):
        assert finish == "length" and ids == off[m], m
    assert "late" not in [m["id"] for m in
                          httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
    r = httpx.post(f"{url}/v1/completions", json=_body("late", 0, False), timeout=30)
    assert r.status_code == 404
    deadline = time.monotonic() + 60
    while not _kv_idle(handle) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _kv_idle(handle)
    # the name is free again on every role: loading it anew works
    r = httpx.post(f"{url}/v1/load_lora_adapter",
                   json={"lora_name": "late", "lora_path": path}, timeout=180)
    assert r.status_code == 200, r.text
    assert _complete(url, "late", 0)[0] == off["late"]


def _restart(handle, iid: str) -> int:
    """Kill role ``iid`` (Ray restarts it); its new incarnation."""
    old = ray.get(handle.actors[iid].info.remote())["incarnation"]
    ray.kill(handle.actors[iid], no_restart=False)

    def restarted():
        try:
            new = ray.get(handle.actors[iid].info.remote(), timeout=10)["incarnation"]
        except Exception:  # noqa: BLE001 - restarting
            return None
        return new if new != old else None
    return _wait_for(f"{iid}'s restart", restarted)


def _wait_for(what, check, timeout_s: float = 180.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_restarted_roles_serve_the_adapters_loaded_at_run_time(cluster):
    """A prefill worker, then a verifier, restarted after a run-time load serve the adapter
    again (synced by their verifier / the gateway), and its requests give the same tokens."""
    handle, path = cluster
    url = handle.url
    r = httpx.post(f"{url}/v1/load_lora_adapter",
                   json={"lora_name": "again", "lora_path": path}, timeout=180)
    assert r.status_code == 200, r.text
    want = _complete(url, "again", 0)[0]
    for iid in ("prefill-0", "verifier-0"):
        _restart(handle, iid)
        _wait_for(f"prefill and verifier serving it after {iid}'s restart", lambda: all(
            "again" in _adapters(handle, i) for i in ("prefill-0", "verifier-0")))
        _wait_for("the cluster to serve again", lambda: httpx.get(
            f"{url}/health", timeout=10).status_code == 200)
        assert _complete(url, "again", 0)[0] == want, iid


def _adapters(handle, iid: str) -> list[str]:
    """The LoRA adapters role ``iid`` serves now ([] while it restarts)."""
    try:
        return ray.get(handle.actors[iid].stats.remote(), timeout=10).get("lora_adapters", [])
    except Exception:  # noqa: BLE001 - restarting
        return []
