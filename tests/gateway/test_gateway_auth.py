"""The gateway's API key (gateway/auth.py) and its input bounds (gateway/limits.py), on the real
app and MailboxBackend against the fake verifier of test_gateway.py (no model, no Ray), over
raw HTTP and the ``openai`` client."""

from __future__ import annotations

import logging
import threading

import httpx
import pytest

from specmesh.gateway.app import create_app
from specmesh.gateway.backend import MailboxBackend
from specmesh.gateway.limits import (
    CORPUS_BODY_BYTES, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
    MIN_BODY_BYTES, generation_body_limit,
)
from specmesh.gateway.server import serve_gateway
from specmesh.protocol.transport import InProcHub
from test_gateway import MAX_MODEL_LEN, MODEL, SCRIPT, FakeVerifier

KEY = "sk-test-9f3c2a71d4e8b605"
PER_CLIENT = 2


def _serve(tokenizer, **app_kw):
    hub = InProcHub()
    script = tokenizer(SCRIPT)["input_ids"]
    fake = FakeVerifier(hub.mailbox("verifier-0"), script, tokenizer.eos_token_id)
    backend = MailboxBackend(hub.mailbox("gateway-0"), lambda: "verifier-0")
    app = create_app(backend, tokenizer, MODEL, MAX_MODEL_LEN, default_max_tokens=16, **app_kw)
    server, _, port = serve_gateway(app)
    return {"fake": fake, "backend": backend, "server": server, "port": port,
            "url": f"http://127.0.0.1:{port}", "script": script, "tok": tokenizer}


def _close(srv) -> None:
    srv["server"].stop()
    srv["backend"].close()
    srv["fake"].close()


@pytest.fixture(scope="module")
def keyed(smollm2_tokenizer):
    srv = _serve(smollm2_tokenizer, api_key=KEY, max_requests_per_client=PER_CLIENT)
    yield srv
    _close(srv)


@pytest.fixture(scope="module")
def guarded(smollm2_tokenizer):
    srv = _serve(smollm2_tokenizer, api_key=KEY, protect_metrics=True)
    yield srv
    _close(srv)


def _auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _is_401(resp: httpx.Response) -> None:
    assert resp.status_code == 401, resp.text
    assert resp.headers["www-authenticate"] == "Bearer"
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
    assert KEY not in resp.text


BODY = {"model": MODEL, "prompt": "Once", "max_tokens": 5}


def test_requests_without_or_with_a_wrong_key_get_401(keyed, caplog):
    caplog.set_level(logging.WARNING, logger="specmesh.gateway.auth")
    n_before = len(keyed["fake"].requests)
    with httpx.Client(base_url=keyed["url"], timeout=10) as c:
        _is_401(c.post("/v1/completions", json=BODY))
        for bad in ("wrong", KEY[:-1], KEY + "x", KEY.upper()):
            _is_401(c.post("/v1/completions", json=BODY, headers=_auth(bad)))
        _is_401(c.post("/v1/completions", json=BODY, headers={"Authorization": KEY}))  # no scheme
        _is_401(c.post("/v1/completions", json=BODY, headers={"Authorization": f"Basic {KEY}"}))
        _is_401(c.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                   "content": "hi"}]}))
        _is_401(c.get("/v1/models"))
        _is_401(c.get("/v1/specmesh/corpus"))
        _is_401(c.post("/v1/specmesh/drafters/clear_history", json={}))
        _is_401(c.get("/openapi.json"))
        # nothing reached the verifier
        assert len(keyed["fake"].requests) == n_before
        # the right key, the scheme in any case
        r = c.post("/v1/completions", json=BODY, headers=_auth())
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        r = c.post("/v1/completions", json=BODY, headers={"authorization": f"bearer {KEY}"})
        assert r.status_code == 200
        assert c.get("/v1/models", headers=_auth()).json()["data"][0]["id"] == MODEL
        # /health and /metrics stay open; the refusals are counted there
        assert c.get("/health").status_code == 200
        metrics = c.get("/metrics")
        assert metrics.status_code == 200
        line = next(ln for ln in metrics.text.splitlines()
                    if ln.startswith("specmesh:gateway_auth_refusals_total "))
        assert float(line.split()[-1]) >= 11
    assert len(keyed["fake"].requests) == n_before + 2
    logged = [r.getMessage() for r in caplog.records]
    assert any("401" in m and "127.0.0.1" in m for m in logged)
    assert not any(KEY in m for m in logged)


def test_openai_client_with_and_without_the_key(keyed):
    import openai

    base = f"{keyed['url']}/v1"
    for bad in ("wrong-key", KEY + "0"):
        client = openai.OpenAI(base_url=base, api_key=bad, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            client.completions.create(model=MODEL, prompt="Once", max_tokens=5)
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
    comp = client.completions.create(model=MODEL, prompt="Once", max_tokens=5)
    assert comp.choices[0].text == keyed["tok"].decode(keyed["script"][:5])
    stream = client.chat.completions.create(model=MODEL, max_tokens=5, stream=True,
                                            messages=[{"role": "user", "content": "Hi"}])
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) \
        == keyed["tok"].decode(keyed["script"][:5])


def test_protect_metrics_guards_health_and_metrics(guarded):
    with httpx.Client(base_url=guarded["url"], timeout=10) as c:
        _is_401(c.get("/health"))
        _is_401(c.get("/metrics"))
        assert c.get("/health", headers=_auth()).status_code == 200
        assert c.get("/metrics", headers=_auth()).status_code == 200


def test_an_open_server_takes_any_request(smollm2_tokenizer):
    srv = _serve(smollm2_tokenizer)
    try:
        r = httpx.post(f"{srv['url']}/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 200
        r = httpx.post(f"{srv['url']}/v1/completions", json=BODY, headers=_auth("any"),
                       timeout=10)
        assert r.status_code == 200
    finally:
        _close(srv)


# -- bounds ----------------------------------------------------------------------------------


def _err(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_body_size_limit_413_naming_the_limit(keyed):
    limit = generation_body_limit(MAX_MODEL_LEN)
    assert limit == MIN_BODY_BYTES and CORPUS_BODY_BYTES > limit
    big = {**BODY, "prompt": "x" * limit}
    with httpx.Client(base_url=keyed["url"], timeout=30, headers=_auth()) as c:
        err = _err(c.post("/v1/completions", json=big), 413)
        assert str(limit) in err["message"] and err["code"] == "request_too_large"

        def chunks():  # no Content-Length: counted while read
            yield b'{"prompt": "'
            for _ in range(limit // 65536 + 2):
                yield b"y" * 65536
            yield b'"}'

        err = _err(c.post("/v1/completions", content=chunks(),
                          headers={"content-type": "application/json"}), 413)
        assert str(limit) in err["message"]
        # nothing lost for the next request
        assert c.post("/v1/completions", json=BODY).status_code == 200


def test_stop_bounds_400_naming_the_limit(keyed):
    with httpx.Client(base_url=keyed["url"], timeout=10, headers=_auth()) as c:
        err = _err(c.post("/v1/completions", json={
            **BODY, "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}), 400)
        assert err["param"] == "stop" and str(MAX_STOP_STRINGS) in err["message"]
        err = _err(c.post("/v1/completions", json={
            **BODY, "stop": "z" * (MAX_STOP_STRING_CHARS + 1)}), 400)
        assert err["param"] == "stop" and str(MAX_STOP_STRING_CHARS) in err["message"]
        err = _err(c.post("/v1/completions", json={
            **BODY, "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}), 400)
        assert err["param"] == "stop_token_ids" and str(MAX_STOP_TOKEN_IDS) in err["message"]
        ok = c.post("/v1/completions", json={**BODY, "stop": ["s"] * MAX_STOP_STRINGS})
        assert ok.status_code == 200


def test_concurrent_requests_per_client_429_past_the_limit(keyed):
    """Two slow streams in flight (the limit): a third is 429 naming it, the two finish
    whole, and once they have a new request is served."""
    url = keyed["url"]
    slow = {**BODY, "max_tokens": 20, "seed": 999, "stream": True}  # ~0.1 s per delta
    started = threading.Barrier(PER_CLIENT + 1)
    texts: list[str] = []

    def one() -> None:
        with httpx.Client(base_url=url, timeout=30, headers=_auth()) as c, \
                c.stream("POST", "/v1/completions", json=slow) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            first = next(lines)
            started.wait()
            texts.append(first + "".join(lines))

    threads = [threading.Thread(target=one) for _ in range(PER_CLIENT)]
    for t in threads:
        t.start()
    started.wait(timeout=20)
    with httpx.Client(base_url=url, timeout=10, headers=_auth()) as c:
        err = _err(c.post("/v1/completions", json=BODY), 429)
        assert err["code"] == "too_many_requests" and str(PER_CLIENT) in err["message"]
        assert err["type"] == "rate_limit_error"
        assert c.get("/v1/models").status_code == 200  # not a generation: not counted
        for t in threads:
            t.join(30)
        assert len(texts) == PER_CLIENT and all("[DONE]" in t for t in texts)
        assert c.post("/v1/completions", json=BODY).status_code == 200
