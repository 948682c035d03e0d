"""Gateway tests: the real app and MailboxBackend over an InProcHub against a fake verifier.

The fake verifier owns mailbox ``decode-0`` and answers each GenerateRequest by streaming a
scripted token sequence (multi-byte UTF-8 included) in deltas of 1-3 tokens with spec stats.
The request's ``seed`` picks a behaviour: 429 -> queue_full, 400 -> invalid, 500 -> error after
a few tokens, 999 -> slow stream (for disconnects); anything else streams normally.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from specmesh.gateway.app import create_app
from specmesh.gateway.backend import MailboxBackend
from specmesh.gateway.server import serve_gateway
from specmesh.gateway.detokenize import IncrementalDetokenizer
from specmesh.protocol.messages import Abort, GenerateRequest, TokenStream
from specmesh.protocol.transport import InProcHub

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 256
SCRIPT = ("Hello wörld! Café naïve — 😀🎉 déjà vu. The quick brown fox jumps over the lazy "
          "dog 🦊 and Ünïcödé ☕ keeps flowing until the very end of this reply.")
SIZES = (1, 2, 3)


@pytest.fixture(scope="session")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


def deltas_of(ids: list[int]) -> list[list[int]]:
    """Split ``ids`` into deltas of 1, 2, 3, 1, 2, 3, ... tokens (as the fake streams them)."""
    out, i, k = [], 0, 0
    while i < len(ids):
        n = SIZES[k % len(SIZES)]
        out.append(ids[i:i + n])
        i, k = i + n, k + 1
    return out


class FakeVerifier:
    """Thread owning a mailbox; streams scripted tokens per GenerateRequest; records Aborts."""

    def __init__(self, mailbox, script_ids: list[int], eos_id: int, delay_s: float = 0.004):
        self.mb = mailbox
        self.script = script_ids
        self.eos = eos_id
        self.delay_s = delay_s
        self.requests: list[GenerateRequest] = []
        self.aborts: list[Abort] = []
        self._active: dict[str, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def aborts_for(self, rid: str) -> list[Abort]:
        return [a for a in self.aborts if a.request_id == rid]

    def wait_abort(self, rid: str, timeout_s: float = 5.0) -> list[Abort]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.aborts_for(rid):
            time.sleep(0.01)
        return self.aborts_for(rid)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def _on_request(self, peer: str, req: GenerateRequest) -> None:
        self.requests.append(req)
        seed, rid = req.sampling.seed, req.request_id
        if seed in (429, 400):
            reason = "queue_full" if seed == 429 else "invalid"
            self.mb.send(peer, TokenStream(request_id=rid, token_ids=[], finished=True,
                                           finish_reason=reason, error=f"fake {reason}"))
            return
        max_tokens = req.sampling.max_tokens
        if seed == 999:  # slow and long: the script repeated
            ids, reason, delay = (self.script * 8)[:max_tokens], "length", 0.1
        elif max_tokens < len(self.script) + 1:
            ids, reason, delay = self.script[:max_tokens], "length", self.delay_s
        else:
            ids, reason, delay = self.script + [self.eos], "stop", self.delay_s
        if seed == 500:
            ids, reason = ids[:4], "error"
        self._active[rid] = {"peer": peer, "deltas": deltas_of(ids), "reason": reason,
                             "delay": delay, "next": time.monotonic(), "sent": 0, "steps": 0,
                             "drafts": 0, "accepted": 0, "n_prompt": len(req.prompt_token_ids)}

    def _step(self, rid: str, st: dict) -> None:
        delta = st["deltas"][st["sent"]]
        st["offset"] = sum(len(d) for d in st["deltas"][:st["sent"]])
        st["sent"] += 1
        st["steps"] += 1
        st["drafts"] += 3
        st["accepted"] += len(delta) - 1
        last = st["sent"] == len(st["deltas"])
        error = "fake verifier failure" if last and st["reason"] == "error" else ""
        self.mb.send(st["peer"], TokenStream(
            request_id=rid, token_ids=delta, offset=st["offset"], finished=last,
            finish_reason=st["reason"] if last else None, num_prompt_tokens=st["n_prompt"],
            num_draft_tokens=st["drafts"], num_accepted_tokens=st["accepted"],
            num_verify_steps=st["steps"], error=error))
        st["next"] = time.monotonic() + st["delay"]
        if last:
            del self._active[rid]

    def _run(self) -> None:
        while not self._stop.is_set():
            env = self.mb.recv(0.002 if self._active else 0.02)
            while env is not None:
                if isinstance(env.msg, GenerateRequest):
                    self._on_request(env.peer, env.msg)
                elif isinstance(env.msg, Abort):
                    self.aborts.append(env.msg)
                    self._active.pop(env.msg.request_id, None)
                env = self.mb.recv(0.0)
            now = time.monotonic()
            for rid, st in list(self._active.items()):
                if st["next"] <= now:
                    self._step(rid, st)


@pytest.fixture(scope="module")
def cluster(tokenizer):
    """Hub, fake verifier, backend, app and a real uvicorn server on 127.0.0.1."""
    hub = InProcHub()
    gw_mb = hub.mailbox("gateway-0")
    script = tokenizer(SCRIPT)["input_ids"]
    fake = FakeVerifier(hub.mailbox("verifier-0"), script, tokenizer.eos_token_id)
    backend = MailboxBackend(gw_mb, lambda: "verifier-0")
    app = create_app(backend, tokenizer, MODEL, MAX_MODEL_LEN, default_max_tokens=64)
    server, thread, port = serve_gateway(app)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
    yield {"hub": hub, "fake": fake, "backend": backend, "app": app, "port": port,
           "client": client, "script": script, "tok": tokenizer}
    client.close()
    server.stop()
    backend.close()
    fake.close()


def sse_events(resp: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE response, in order."""
    return [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]


def post_stream(client, path: str, body: dict) -> tuple[int, list[str]]:
    with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            return resp.status_code, [resp.text]
        assert resp.headers["content-type"].startswith("text/event-stream")
        return 200, sse_events(resp)


def stream_text(events: list[str], chat: bool) -> tuple[list[str], list[dict]]:
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = []
    for c in chunks:
        for ch in c["choices"]:
            t = ch["delta"].get("content") if chat else ch["text"]
            if t:
                texts.append(t)
    return texts, chunks


# ------------------------------------------------------------------------------------------


def test_incremental_detokenizer_real_tokenizer(tokenizer):
    ids = tokenizer(SCRIPT)["input_ids"] + [tokenizer.eos_token_id]
    det = IncrementalDetokenizer(tokenizer, prompt_token_ids=tokenizer("Say hi:")["input_ids"])
    deltas = [det.add(d) for d in deltas_of(ids)] + [det.flush()]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == SCRIPT
    assert all("\ufffd" not in d for d in deltas)


def test_completion_non_streaming_and_streaming_agree(cluster):
    c, tok, script = cluster["client"], cluster["tok"], cluster["script"]
    body = {"model": MODEL, "prompt": "Tell me a story:", "max_tokens": 30, "temperature": 0}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    expected = tok.decode(script[:30], skip_special_tokens=True)
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion"
    assert out["model"] == MODEL
    choice = out["choices"][0]
    assert choice["text"] == expected and choice["finish_reason"] == "length"
    assert choice["logprobs"] is None
    n_prompt = len(tok("Tell me a story:")["input_ids"])
    assert out["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 30,
                            "total_tokens": n_prompt + 30,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    stats = out["spec_stats"]
    steps = len(deltas_of(script[:30]))
    assert stats["num_verify_steps"] == steps and stats["num_draft_tokens"] == 3 * steps
    assert stats["num_accepted_tokens"] == 30 - steps
    assert stats["mean_accept_len"] == pytest.approx((30 - steps) / steps)
    assert r.headers["x-specmesh-draft-tokens"] == str(3 * steps)
    assert r.headers["x-specmesh-accepted-tokens"] == str(30 - steps)
    assert float(r.headers["x-specmesh-mean-accept-len"]) == pytest.approx(
        (30 - steps) / steps, abs=1e-3)
    sent = cluster["fake"].requests[-1]
    assert sent.prompt_token_ids == tok("Tell me a story:")["input_ids"]
    assert sent.sampling.max_tokens == 30 and sent.sampling.temperature == 0.0
    assert sent.num_speculative_tokens is None

    status, events = post_stream(c, "/v1/completions", {
        **body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    texts, chunks = stream_text(events, chat=False)
    assert "".join(texts) == expected
    assert all("\ufffd" not in t for t in texts) and len(texts) > 5
    final, usage = chunks[-2], chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["spec_stats"]["num_verify_steps"] == steps
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 30
    assert usage["spec_stats"] == stats
    assert all(ch["object"] == "text_completion" for ch in chunks)


def test_chat_eos_finish_and_stream(cluster):
    c, tok, script = cluster["client"], cluster["tok"], cluster["script"]
    messages = [{"role": "user", "content": "Héllo, who are you? 🙂"}]
    r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                             "max_completion_tokens": 200})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion"
    msg = out["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": SCRIPT}  # EOS is a special token: skipped
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == len(script) + 1
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    assert cluster["fake"].requests[-1].prompt_token_ids == ids
    assert out["usage"]["prompt_tokens"] == len(ids)

    status, events = post_stream(c, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": 200, "stream": True})
    texts, chunks = stream_text(events, chat=True)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(texts) == SCRIPT
    assert all("\ufffd" not in t for t in texts)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "spec_stats" in chunks[-1] and "usage" not in chunks[-1]
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)


def _spanning_stop(tok, script) -> tuple[str, int]:
    """A stop string spanning two deltas, and how many tokens the output keeps: up to the
    token that completes it (not the rest of its delta), as if tokens came one at a time."""
    ds = deltas_of(script)
    for i in range(3, len(ds) - 10):
        left = tok.decode(sum(ds[:i + 1], []))
        right = tok.decode(sum(ds[:i + 2], []))[len(left):]
        stop = left[-2:] + right[:2]
        if stop.isascii() and stop.strip() == stop and SCRIPT.find(stop) == len(left) - 2:
            n = next(k for k in range(1, len(script) + 1) if stop in tok.decode(script[:k]))
            return stop, n
    raise AssertionError("no suitable stop string")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_spanning_deltas(cluster, stream):
    c, tok, script, fake = cluster["client"], cluster["tok"], cluster["script"], cluster["fake"]
    stop, n_tokens = _spanning_stop(tok, script)
    body = {"model": MODEL, "prompt": "Go:", "max_tokens": 100, "stop": ["NEVER", stop]}
    expected = SCRIPT[:SCRIPT.find(stop)]
    if stream:
        status, events = post_stream(c, "/v1/completions", {
            **body, "stream": True, "stream_options": {"include_usage": True}})
        texts, chunks = stream_text(events, chat=False)
        text, finish = "".join(texts), chunks[-2]["choices"][0]["finish_reason"]
        usage = chunks[-1]["usage"]
        assert all(stop not in t for t in texts)
    else:
        out = c.post("/v1/completions", json=body).json()
        text, finish = out["choices"][0]["text"], out["choices"][0]["finish_reason"]
        usage = out["usage"]
    assert text == expected and finish == "stop"
    assert usage["completion_tokens"] == n_tokens
    rid = fake.requests[-1].request_id
    aborts = fake.wait_abort(rid)
    assert aborts and aborts[0].reason == "stop string"
    assert aborts[0].num_output_tokens == n_tokens  # the verifier cuts its stats there


def test_errors_from_verifier(cluster):
    c = cluster["client"]
    for stream in (False, True):
        body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "seed": 429, "stream": stream}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        r = c.post("/v1/completions", json={**body, "seed": 400})
        assert r.status_code == 400 and r.json()["error"]["message"] == "fake invalid"
    r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "seed": 500})
    assert r.status_code == 500 and "failure" in r.json()["error"]["message"]
    status, events = post_stream(c, "/v1/completions", {"prompt": "x", "max_tokens": 8,
                                                        "seed": 500, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "fake verifier failure"


def test_bad_requests(cluster):
    c, tok = cluster["client"], cluster["tok"]

    def err(resp, status=400):
        assert resp.status_code == status, resp.text
        body = resp.json()["error"]
        assert set(body) == {"message", "type", "param", "code"}
        return body

    long_prompt = list(range(100, 100 + MAX_MODEL_LEN))
    assert err(c.post("/v1/completions", json={"prompt": long_prompt}))["param"] == "prompt"
    err(c.post("/v1/completions", json={"prompt": list(range(100, 300)), "max_tokens": 100}))
    assert err(c.post("/v1/completions", json={"prompt": "hi", "n": 0}))["param"] == "n"
    err(c.post("/v1/completions", content=b"{not json", headers={
        "content-type": "application/json"}))
    err(c.post("/v1/completions", json={"max_tokens": 3}))  # no prompt
    err(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1}))
    assert err(c.post("/v1/completions", json={"prompt": []}))["param"] == "prompt"
    assert err(c.post("/v1/completions", json={"prompt": [[100, 101], [len(tok) + 5]]}))[
        "param"] == "prompt"  # one bad prompt of a list refuses the request
    assert err(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0}))[
        "param"] == "max_tokens"  # 0 only with echo
    assert err(c.post("/v1/completions", json={"prompt": "hi", "logprobs": 21}))[
        "param"] == "logprobs"
    assert err(c.post("/v1/completions", json={"prompt": "hi", "logprobs": True}))[
        "param"] == "logprobs"
    assert err(c.post("/v1/completions", json={"prompt": "hi", "echo": 1}))["param"] == "echo"
    assert err(c.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}))[
        "param"] == "top_logprobs"  # without logprobs: true
    assert err(c.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
        "top_logprobs": -1}))["param"] == "top_logprobs"
    assert err(c.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "echo": True}))["param"] == "echo"
    err(c.post("/v1/completions", json={"prompt": [len(tok) + 5]}))
    err(c.post("/v1/chat/completions", json={"messages": []}))
    err(c.post("/v1/completions", json={"prompt": "hi", "model": "gpt-4"}), 404)
    # unknown fields and `user` are ignored; the default max_tokens applies
    r = c.post("/v1/completions", json={"prompt": [100, 200], "user": "u", "frobnicate": 1})
    assert r.status_code == 200
    assert cluster["fake"].requests[-1].sampling.max_tokens == 64


def test_client_disconnect_aborts(cluster):
    port, fake = cluster["port"], cluster["fake"]
    n_before = len(fake.requests)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
        with c.stream("POST", "/v1/completions", json={
                "prompt": "long", "max_tokens": 150, "seed": 999, "stream": True}) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"]
        # leaving the blocks closes the connection mid-stream
    rid = fake.requests[n_before].request_id
    aborts = fake.wait_abort(rid)
    assert aborts and aborts[0].reason == "client disconnected"

    # non-streaming: the client gives up (timeout) while the verifier is still generating
    n_before = len(fake.requests)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=0.3) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={"prompt": "long", "max_tokens": 150, "seed": 999})
    rid = fake.requests[n_before].request_id
    assert fake.wait_abort(rid)[0].reason == "client disconnected"
    deadline = time.monotonic() + 5
    while cluster["backend"].num_in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cluster["backend"].num_in_flight == 0


def test_openai_client(cluster):
    from openai import OpenAI

    tok, script = cluster["tok"], cluster["script"]
    client = OpenAI(base_url=f"http://127.0.0.1:{cluster['port']}/v1", api_key="x",
                    max_retries=0)
    comp = client.completions.create(model=MODEL, prompt="Once", max_tokens=25)
    expected = tok.decode(script[:25])
    assert comp.choices[0].text == expected and comp.choices[0].finish_reason == "length"
    assert comp.usage.completion_tokens == 25
    stream = client.completions.create(model=MODEL, prompt="Once", max_tokens=25, stream=True)
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == expected

    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200,
                                          temperature=0.0, seed=7)
    assert chat.choices[0].message.content == SCRIPT
    assert chat.choices[0].finish_reason == "stop"
    assert chat.model_extra["spec_stats"]["num_verify_steps"] > 0
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200,
                                            stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            parts.append(ch.choices[0].delta.content)
        if ch.usage is not None:
            usage = ch.usage
    assert "".join(parts) == SCRIPT and usage.completion_tokens == len(script) + 1
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_protocol_error_and_late_stream_do_not_break_backend(cluster):
    hub, c, backend = cluster["hub"], cluster["client"], cluster["backend"]
    errors, dropped = backend.num_protocol_errors, backend.num_dropped_streams
    intruder = hub.mailbox("intruder-0")
    intruder.send_frames("gateway-0", [b"\xc1garbage"])
    intruder.send("gateway-0", TokenStream(request_id="nobody", token_ids=[5]))
    deadline = time.monotonic() + 5
    while (backend.num_protocol_errors == errors or backend.num_dropped_streams == dropped) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend.num_protocol_errors == errors + 1
    assert backend.num_dropped_streams >= dropped + 1
    intruder.close()
    r = c.post("/v1/completions", json={"prompt": "still alive?", "max_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_models_health_metrics(cluster):
    c = cluster["client"]
    assert c.get("/health").json() == {"status": "ok"}
    models = c.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "seed": 429})
    c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
    r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text

    def value(name: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
        return float(line.split()[-1])

    assert value("specmesh:gateway_queue_full_total") >= 1
    assert value("specmesh:prompt_tokens_total") > 0
    assert value("specmesh:generation_tokens_total") >= 4
    assert value("specmesh:gateway_spec_decode_num_draft_tokens_total") > 0
    assert value("specmesh:gateway_spec_decode_num_accepted_tokens_total") > 0
    assert value("specmesh:time_to_first_token_seconds_count") >= 1
    assert value("specmesh:inter_token_latency_seconds_count") >= 1
    assert 'specmesh:gateway_requests_total{endpoint="completions",status="429"}' in text
    assert "specmesh:gateway_num_requests_in_flight" in text
    # a second app in the same process gets its own registry
    create_app(cluster["backend"], cluster["tok"], MODEL, MAX_MODEL_LEN)


def test_concurrent_streams_are_routed_per_request(cluster):
    import asyncio

    tok, script = cluster["tok"], cluster["script"]

    async def one(client: httpx.AsyncClient, n: int) -> str:
        parts = []
        async with client.stream("POST", "/v1/completions", json={
                "prompt": f"request {n}", "max_tokens": n, "stream": True}) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    parts += [ch["text"] for ch in json.loads(line[6:])["choices"]]
        return "".join(parts)

    async def main() -> list[str]:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{cluster['port']}",
                                     timeout=10) as client:
            return await asyncio.gather(*(one(client, n) for n in range(10, 40, 3)))

    texts = asyncio.run(main())
    assert texts == [tok.decode(script[:n]) for n in range(10, 40, 3)]


@pytest.mark.parametrize("how", ["body", "header"])
def test_client_request_id_in_flight_is_refused_409_and_the_first_is_untouched(cluster, how):
    """Issue 9 scenario 9: a client-supplied request id that is in flight is refused with 409;
    the request that holds it streams on to its end (it is not aborted nor mixed)."""
    c, fake = cluster["client"], cluster["fake"]
    cid = f"dup-{how}"
    extra = {"json": {"request_id": cid}} if how == "body" else {"headers": {"X-Request-Id": cid}}

    def body(**kw):
        b = {"model": MODEL, "prompt": "Go:", "max_tokens": 12, "seed": 999, **kw}
        return {**b, **extra["json"]} if how == "body" else b

    first: dict = {}

    def run_first():
        r = c.post("/v1/completions", json=body(), headers=extra.get("headers"))
        first["status"], first["body"] = r.status_code, r.json()

    t = threading.Thread(target=run_first)
    t.start()
    deadline = time.monotonic() + 5
    while not any(r.request_id == f"cmpl-{cid}" for r in fake.requests):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    dup = c.post("/v1/completions", json=body(max_tokens=3), headers=extra.get("headers"))
    assert dup.status_code == 409, dup.text
    assert dup.json()["error"]["code"] == "duplicate_request_id"
    t.join(10)
    assert first["status"] == 200
    out = first["body"]
    assert out["id"] == f"cmpl-{cid}" and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 12
    assert fake.aborts_for(f"cmpl-{cid}") == []
    assert sum(r.request_id == f"cmpl-{cid}" for r in fake.requests) == 1  # never sent twice
    # once it finished the id is free again
    again = c.post("/v1/completions", json=body(max_tokens=2, seed=1),
                   headers=extra.get("headers"))
    assert again.status_code == 200 and again.json()["id"] == f"cmpl-{cid}"


def test_bad_request_id_header_is_400(cluster):
    r = cluster["client"].post("/v1/completions", json={"prompt": "Go:", "max_tokens": 2},
                               headers={"X-Request-Id": "x" * 300})
    assert r.status_code == 400 and "X-Request-Id" in r.json()["error"]["message"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_return_token_ids_as_vllm(cluster, chat):
    """vLLM's ``return_token_ids``: the output ids in the choice's ``token_ids`` (per chunk in a
    stream: the delta's ids, even while its text is held back), the prompt ids in
    ``prompt_token_ids`` (in the choice for completions, top level for chat; in a stream only in
    the first chunk); without it neither field appears. A stop string keeps the ids up to the
    token that completes it (as usage counts them)."""
    c, tok, script, fake = cluster["client"], cluster["tok"], cluster["script"], cluster["fake"]
    url = "/v1/chat/completions" if chat else "/v1/completions"
    base = ({"messages": [{"role": "user", "content": "Ids, please 😀"}]} if chat
            else {"prompt": "Ids, please 😀"})
    body = {"model": MODEL, **base, "max_tokens": 40, "return_token_ids": True}

    def prompt_ids(out: dict) -> list[int]:
        return out["prompt_token_ids"] if chat else out["choices"][0]["prompt_token_ids"]

    r = c.post(url, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["token_ids"] == script[:40]
    assert prompt_ids(out) == fake.requests[-1].prompt_token_ids
    plain = c.post(url, json={**body, "return_token_ids": False}).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain
    assert "prompt_token_ids" not in plain["choices"][0]

    status, events = post_stream(c, url, {**body, "stream": True})
    assert status == 200
    texts, chunks = stream_text(events, chat)
    ids = [t for ch in chunks for t in ch["choices"][0]["token_ids"]]
    assert ids == script[:40] and "".join(texts) == tok.decode(script[:40])
    assert prompt_ids(chunks[0]) == fake.requests[-1].prompt_token_ids
    assert all("prompt_token_ids" not in ch and "prompt_token_ids" not in ch["choices"][0]
               for ch in chunks[1:])

    def text_of(choice: dict) -> str:
        return (choice["delta"].get("content") if chat else choice["text"]) or ""

    assert any(ch["choices"][0]["token_ids"] and not text_of(ch["choices"][0])
               for ch in chunks), "no chunk whose text was held back (multi-byte characters)"
    _, plain_events = post_stream(c, url, {**body, "stream": True, "return_token_ids": False})
    assert all("token_ids" not in json.loads(e)["choices"][0]
               for e in plain_events[:-1])

    if not chat:
        stop, n_tokens = _spanning_stop(tok, script)
        cut = {**body, "max_tokens": 100, "stop": [stop]}
        assert c.post(url, json=cut).json()["choices"][0]["token_ids"] == script[:n_tokens]
        _, events = post_stream(c, url, {**cut, "stream": True})
        _, chunks = stream_text(events, chat)
        assert [t for ch in chunks for t in ch["choices"][0]["token_ids"]] == script[:n_tokens]
