"""The corpus endpoints (gateway/corpus_api.py, gateway/corpora.py): over the in-process
workers on the tiny model (gateway app + MailboxBackend -> verifier -> drafter, no Ray) a
corpus is loaded, listed, drafted from and dropped, and the history cleared, each call answered
with every drafter's status; bad input, a method without corpora and a gateway without a
cluster get clear errors; a verifier that connects later gets the corpora on the list."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from specmesh.cluster.inprocess import VERIFIER, InProcessCluster
from specmesh.gateway.app import create_app
from specmesh.gateway.backend import MailboxBackend
from specmesh.gateway.corpora import CorpusControl, corpus_messages
from specmesh.gateway.server import serve_gateway
from specmesh.protocol.messages import (
    CORPUS_CHUNK_TOKENS,
    DrafterCorpus,
    DrafterCorpusRelayed,
    DrafterCorpusResult,
)

from helpers.proposers import OracleProposer

MAX_TOKENS = 24


def _serve(loaded, proposer=None, supported=True, verifiers=lambda: [VERIFIER]):
    """The app over a driven in-process cluster; returns (client, cluster, control, stop)."""
    c = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=3,
                         eos_token_ids=(), proposer=proposer)
    stop = threading.Event()

    def drive():
        while not stop.is_set():
            c.drafter.step(0.002)
            c.prefill.step()
            c.verifier.step(0.002)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    backend = MailboxBackend(c.client, lambda: VERIFIER, recv_timeout_s=0.05)
    control = CorpusControl(backend.send, verifiers, supported=supported,
                            method="ngram" if supported else "oracle-test").attach(backend)
    app = create_app(backend, loaded.tokenizer, "tiny", 1024, default_max_tokens=MAX_TOKENS,
                     corpus=control)
    server, _, port = serve_gateway(app)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)

    def close():
        client.close()
        server.stop()
        backend.close()
        stop.set()
        thread.join(5)

    return client, c, control, close


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from specmesh.engine.loader import load_model

    return load_model(tiny_model_dir, dtype="float32")


@pytest.fixture(scope="module")
def served(loaded):
    client, c, control, close = _serve(loaded)
    yield client, c, control
    close()


def _complete(client, prompt):
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS,
                                             "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_load_list_draft_drop(served, loaded):
    client, c, _ = served
    prompt = "Tell me a story about"
    first = _complete(client, prompt)
    out = first["choices"][0]["token_ids"]
    r = client.post("/v1/specmesh/corpus", json={"name": "story", "token_ids": out})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["num_tokens"] == len(out) and body["verifiers"] == [VERIFIER]
    assert body["drafters"] == {"drafter-0": {"status": "applied", "num_tokens": len(out),
                                              "error": ""}}
    assert not body["pending_drafters"] and not body["pending_verifiers"]
    assert c.drafter.proposer.corpora() == {"story": len(out)}
    listing = client.get("/v1/specmesh/corpus").json()
    assert listing["supported"] and listing["data"] == [{
        "name": "story", "num_tokens": len(out),
        "drafters": {"drafter-0": {"status": "applied", "num_tokens": len(out), "error": ""}}}]
    again = _complete(client, prompt)
    assert again["choices"][0]["token_ids"] == out  # exact, drafted from the corpus or not
    assert c.drafter.proposer.num_corpus_draft_tokens > 0
    r = client.delete("/v1/specmesh/corpus/story")
    assert r.status_code == 200 and r.json()["drafters"]["drafter-0"]["status"] == "applied"
    assert c.drafter.proposer.corpora() == {}
    assert client.get("/v1/specmesh/corpus").json()["data"] == []
    r = client.delete("/v1/specmesh/corpus/story")
    assert r.status_code == 404 and r.json()["error"]["code"] == "corpus_not_found"


def test_text_is_tokenized_without_special_tokens(served, loaded):
    client, c, _ = served
    text = "The quick brown fox jumps over the lazy dog. " * 3
    r = client.post("/v1/specmesh/corpus", json={"name": "fox.txt", "text": text,
                                                 "timeout": 30})
    assert r.status_code == 200, r.text
    want = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert r.json()["num_tokens"] == len(want) and c.drafter.proposer.corpora()["fox.txt"] \
        == len(want)
    # replaced under the same name, then cleaned up
    r = client.post("/v1/specmesh/corpus", json={"name": "fox.txt", "token_ids": [5, 6, 7]})
    assert r.status_code == 200 and c.drafter.proposer.corpora()["fox.txt"] == 3
    assert client.delete("/v1/specmesh/corpus/fox.txt").status_code == 200


def test_clear_history_reaches_every_drafter(served):
    client, c, _ = served
    r = client.post("/v1/specmesh/drafters/clear_history")
    assert r.status_code == 200, r.text
    assert r.json()["drafters"] == {"drafter-0": {"status": "applied", "num_tokens": 0,
                                                  "error": ""}}
    r = client.post("/v1/specmesh/drafters/clear_history", json={"timeout": 5})
    assert r.status_code == 200


@pytest.mark.parametrize("body,param,what", [
    ({"name": "a b", "token_ids": [1]}, "name", "may only hold"),
    ({"name": "x"}, "text", "exactly one of text and token_ids"),
    ({"name": "x", "text": "a", "token_ids": [1]}, "text", "exactly one"),
    ({"name": "x", "token_ids": []}, "token_ids", "empty"),
    ({"name": "x", "text": ""}, "text", "empty"),
    ({"name": "x", "token_ids": [1, 10**6]}, "token_ids", "out of range"),
    ({"name": "x", "token_ids": [-1]}, "token_ids.0", "greater than or equal to 0"),
    ({"name": "x", "token_ids": ["1"]}, "token_ids.0", "integer"),
    ({"name": "x", "token_ids": [1], "timeout": 0}, "timeout", "greater than 0"),
    ({"name": "x", "token_ids": [1], "extra": 1}, "extra", "Extra inputs"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_corpus_bodies_are_400(served, body, param, what):
    client, c, _ = served
    r = client.post("/v1/specmesh/corpus", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and what in err["message"]
    assert "x" not in c.drafter.proposer.corpora()


def test_a_corpus_over_the_limit_is_400(served, monkeypatch):
    client, _, _ = served
    from specmesh.gateway import corpus_api

    monkeypatch.setattr(corpus_api, "MAX_CORPUS_TOKENS", 3)
    r = client.post("/v1/specmesh/corpus", json={"name": "big", "token_ids": [1, 2, 3, 4]})
    assert r.status_code == 400 and "more than the limit of 3" in r.json()["error"]["message"]


def test_a_method_without_corpora_is_refused(loaded):
    client, c, control, close = _serve(loaded, proposer=OracleProposer([], []),
                                       supported=False)
    try:
        r = client.post("/v1/specmesh/corpus", json={"name": "x", "token_ids": [1, 2]})
        assert r.status_code == 400 and "oracle-test" in r.json()["error"]["message"]
        assert client.get("/v1/specmesh/corpus").json() == {"object": "list",
                                                            "supported": False, "data": []}
        # were the gateway not to know, the drafter's own refusal is a 400 too
        control.supported = True
        r = client.post("/v1/specmesh/corpus", json={"name": "x", "token_ids": [1, 2]})
        assert r.status_code == 400, r.text
        body = r.json()
        assert "no cross-request memory" in body["error"]["message"]
        assert body["operation"]["drafters"]["drafter-0"]["status"] == "unsupported"
        # clearing a history it does not keep is done at once
        assert client.post("/v1/specmesh/drafters/clear_history").status_code == 200
    finally:
        close()


def test_no_verifier_connected_keeps_the_corpus_for_later(loaded):
    up: list[str] = []
    client, c, control, close = _serve(loaded, verifiers=lambda: list(up))
    try:
        r = client.post("/v1/specmesh/corpus", json={"name": "later", "token_ids": [4, 5, 6]})
        assert r.status_code == 202 and r.json()["verifiers"] == []
        assert client.post("/v1/specmesh/drafters/clear_history").status_code == 503
        assert c.drafter.proposer.corpora() == {}
        up.append(VERIFIER)
        control.verifier_joined(VERIFIER)  # its first Hello: the list goes out
        deadline = time.monotonic() + 20
        while c.drafter.proposer.corpora() != {"later": 3}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        while control.listing()[0]["drafters"].get("drafter-0", {}).get("status") != "applied":
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        close()


def test_without_a_control_the_endpoints_are_501(loaded):
    app = create_app(MailboxBackend.__new__(MailboxBackend), loaded.tokenizer, "tiny", 1024)
    server, _, port = serve_gateway(app)
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/v1/specmesh/corpus")
        assert r.status_code == 501 and "no link to drafters" in r.json()["error"]["message"]
    finally:
        server.stop()


class FakeVerifiers:
    """Records what the control sends; answers like verifiers do when told."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def __call__(self, peer, msg):
        with self.lock:
            self.sent.append((peer, msg))


def test_an_operation_waits_for_every_verifier_and_drafter():
    import asyncio

    wire = FakeVerifiers()
    control = CorpusControl(wire, lambda: ["v0", "v1"])
    op = control.load("docs", list(range(CORPUS_CHUNK_TOKENS + 5)))
    chunks = [m for p, m in wire.sent if p == "v0"]
    assert [(m.chunk_index, m.num_chunks, len(m.token_ids)) for m in chunks] == [
        (0, 2, CORPUS_CHUNK_TOKENS), (1, 2, 5)]
    assert [m for p, m in wire.sent if p == "v1"] == chunks
    assert not op.done.is_set()

    def result(drafter, status="applied"):
        return DrafterCorpusResult(op="load", op_id=op.op_id, name="docs", drafter=drafter,
                                   status=status, num_tokens=CORPUS_CHUNK_TOKENS + 5)

    control.on_message("v0", DrafterCorpusRelayed(op="load", op_id=op.op_id, name="docs",
                                                  drafters=["d0", "d1"]))
    control.on_message("v0", result("d0"))
    control.on_message("v1", result("d0"))
    control.on_message("v1", DrafterCorpusRelayed(op="load", op_id=op.op_id, name="docs",
                                                  drafters=["d0", "d1"]))
    assert not op.done.is_set()
    summary = asyncio.run(control.wait(op, 0.05))  # d1 has not answered: reported pending
    assert summary["pending_drafters"] == ["d1"] and summary["pending_verifiers"] == []
    control.on_message("v1", result("d1"))  # late: the list still learns it
    assert control.listing()[0]["drafters"]["d1"]["status"] == "applied"
    # a new incarnation of a verifier gets the list again, chunks together, same op id
    wire.sent.clear()
    control.verifier_joined("v2")
    assert [m for _, m in wire.sent] == corpus_messages(op.op_id, "docs",
                                                        list(range(CORPUS_CHUNK_TOKENS + 5)))
    # operation ids grow
    assert control.drop("docs").op_id > op.op_id and control.drop("docs") is None
    assert control.clear_history().op_id > op.op_id


def test_corpus_messages_split_at_the_chunk_size():
    msgs = corpus_messages(3, "n", [1] * (2 * CORPUS_CHUNK_TOKENS))
    assert [(m.chunk_index, m.num_chunks, len(m.token_ids)) for m in msgs] == [
        (0, 2, CORPUS_CHUNK_TOKENS), (1, 2, CORPUS_CHUNK_TOKENS)]
    assert all(isinstance(m, DrafterCorpus) and m.op_id == 3 for m in msgs)

