"""vLLM's run-time LoRA endpoints through the real gateway app and MailboxBackend over the
in-process workers (tiny model, no Ray; issue 37): ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` with vLLM's bodies, texts and errors, ``/v1/models`` following
them, a response's ``model`` naming the adapter (streamed and not), greedy speculation equal
to plain decoding on a loaded adapter with drafts accepted, and an unload while requests
stream on the adapter: none fails, each keeps plain decoding's tokens, and every KV block is
free afterwards. (The prefill and verifier here share one model; the Ray test
tests/integration/test_serve_lora_runtime.py runs them as separate processes.)"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specmesh.cluster.inprocess import VERIFIER, InProcessCluster
from specmesh.gateway.app import create_app
from specmesh.gateway.backend import MailboxBackend
from specmesh.gateway.lora_control import LoraControl
from specmesh.gateway.server import serve_gateway
from specmesh.gateway.tokens import completion_prompt_ids
from helpers.lora import make_tiny_adapter
from helpers.proposers import OracleProposer

MAX_TOKENS = 32
STEP_PAUSE_S = 0.01  # a stream must still run when the unload arrives
PROMPTS = {"base": "1 2 3 4 5 6 7 8", "a": "the cat sat on the mat", "b": "hello world again"}


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from specmesh.engine.loader import load_model

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    root = tmp_path_factory.mktemp("lora-runtime-gw")
    paths = {"a": make_tiny_adapter(hf, root / "a", seed=1, std=0.3),
             "b": make_tiny_adapter(hf, root / "b", seed=2, std=0.3)}
    loaded = load_model(tiny_model_dir, dtype="float32")
    oracle = OracleProposer([], [])
    c = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=4,
                         eos_token_ids=(), proposer=oracle, adaptive_drafts=False,
                         num_kv_blocks=128)
    stop = threading.Event()

    def drive():
        while not stop.is_set():
            c.drafter.step()
            c.prefill.step()
            c.verifier.step()
            time.sleep(STEP_PAUSE_S)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    backend = MailboxBackend(c.client, lambda: VERIFIER, recv_timeout_s=0.1)
    lora = LoraControl(backend.send, lambda: [VERIFIER], wait_s=60).attach(backend)
    app = create_app(backend, loaded.tokenizer, "tiny", 1024, default_max_tokens=MAX_TOKENS,
                     lora=lora)
    server, _, port = serve_gateway(app)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    yield {"client": client, "cluster": c, "paths": paths, "oracle": oracle,
           "tok": loaded.tokenizer}
    client.close()
    server.stop()
    backend.close()
    stop.set()
    thread.join(5)


def _body(model: str, k: int, stream: bool = False) -> dict:
    body = {"prompt": PROMPTS[model], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "num_speculative_tokens": k, "return_token_ids": True,
            "stream": stream}
    if model != "base":
        body["model"] = model
    return body


def _complete(client, model: str, k: int) -> dict:
    r = client.post("/v1/completions", json=_body(model, k))
    assert r.status_code == 200, r.text
    return r.json()


def _stream(client, model: str, k: int, started: threading.Event | None = None):
    """(token ids, the chunks' model fields, finish reason) of a streamed completion."""
    ids, models, finish = [], set(), None
    with client.stream("POST", "/v1/completions", json=_body(model, k, True)) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            models.add(event["model"])
            for ch in event["choices"]:
                ids.extend(ch.get("token_ids") or [])
                finish = ch["finish_reason"] or finish
            if ids and started is not None:
                started.set()
    return ids, models, finish


def _load(client, name: str, path: str):
    return client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def _models(client) -> list[str]:
    return [m["id"] for m in client.get("/v1/models").json()["data"]]


def _kv_free(c) -> bool:
    """Every KV block of both roles is free (the prefill's cached ones are unused)."""
    return (c.verifier.block_manager.num_free_blocks == c.verifier.block_manager.num_blocks
            and c.prefill.num_unused_blocks == c.prefill.block_manager.num_blocks)


def test_load_serve_and_unload_as_vllm_does(served):
    client, c, paths = served["client"], served["cluster"], served["paths"]
    r = _load(client, "a", paths["a"])
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a' added successfully."
    cards = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in cards] == ["tiny", "a"] and cards[1]["parent"] == "tiny"
    assert cards[1]["root"] == paths["a"]
    # vLLM's refusals
    r = _load(client, "a", paths["b"])
    assert r.status_code == 400 and "The lora adapter 'a' has already been loaded." in r.text
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400 and "Both 'lora_name' and 'lora_path'" in r.text
    r = _load(client, "x", paths["a"] + "-missing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError", r.text
    assert "x" not in _models(client) and "x" not in c.verifier.verify_step.runner.model.lora.names
    r = _load(client, "tiny", paths["a"])
    assert r.status_code == 400
    # greedy on the adapter: speculation equals plain decoding, drafts accepted; the
    # response's model names the adapter (the base's names the base)
    off = {m: _complete(client, m, 0) for m in ("base", "a")}
    ids = {m: off[m]["choices"][0]["token_ids"] for m in off}
    assert off["a"]["model"] == "a" and off["base"]["model"] == "tiny"
    served["oracle"].seqs.extend(
        completion_prompt_ids(served["tok"], PROMPTS[m]) + ids[m] for m in ids)
    for m in ("base", "a"):
        on = _complete(client, m, 4)
        assert on["choices"][0]["token_ids"] == ids[m], m
        assert on["spec_stats"]["num_accepted_tokens"] > 0, m
        got, models, finish = _stream(client, m, 4)
        assert got == ids[m] and finish == "length"
        assert models == {"a" if m == "a" else "tiny"}
    # unload: gone from the list, requests naming it are 404, a second unload too
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a' removed successfully."
    assert _models(client) == ["tiny"]
    r = client.post("/v1/completions", json=_body("a", 0))
    assert r.status_code == 404 and "`a` does not exist" in r.text
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert r.status_code == 404 and "The lora adapter 'a' cannot be found." in r.text
    r = client.post("/v1/unload_lora_adapter", json={})
    assert r.status_code == 400
    deadline = time.monotonic() + 30
    while not _kv_free(c) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _kv_free(c)
    assert "a" not in c.verifier.verify_step.runner.model.lora.names  # freed, not only hidden


def test_unload_while_requests_stream_fails_none_and_frees_all_kv(served):
    client, c, paths = served["client"], served["cluster"], served["paths"]
    assert _load(client, "b", paths["b"]).status_code == 200
    ref = {m: _complete(client, m, 0)["choices"][0]["token_ids"] for m in ("base", "b")}
    started = [threading.Event() for _ in range(4)]
    models = ["b", "base", "b", "base"]
    with ThreadPoolExecutor(len(models)) as pool:
        jobs = [pool.submit(_stream, client, m, 4, ev) for m, ev in zip(models, started)]
        assert all(ev.wait(60) for ev in started)
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert r.status_code == 200, r.text
        # the verifier answered while its requests on "b" still ran: it only marked it
        draining = "b" in c.verifier.lora.runtime.unloading
        results = [j.result() for j in jobs]
    assert draining, "the streams had finished before the unload: the test proves nothing"
    for m, (ids, names, finish) in zip(models, results):
        assert finish == "length" and ids == ref[m], m
        assert names == {"b" if m == "b" else "tiny"}
    assert "b" not in _models(client)
    deadline = time.monotonic() + 30
    while (not _kv_free(c) or c.verifier.lora.runtime.unloading) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _kv_free(c) and not c.verifier.lora.runtime.unloading
    assert "b" not in c.verifier.verify_step.runner.model.lora.names
