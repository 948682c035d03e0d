"""Issue 9 scenario 4: a TokenStream delta lost (a reconnect, a failed send) must not give the
client a 200 with tokens missing from the middle. Every TokenStream carries the output offset
of its first token (the verifier fills it); the gateway fails the request with a clear error on
a gap or an overlap, so nothing reaches a client that the verifier did not commit, in order."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from specmesh.gateway.app import create_app
from specmesh.gateway.backend import MailboxBackend
from specmesh.gateway.server import serve_gateway
from specmesh.gateway.tokens import completion_prompt_ids
from specmesh.cluster.inprocess import VERIFIER, InProcessCluster
from specmesh.protocol.messages import Abort, GenerateRequest, SamplingParams, TokenStream
from specmesh.protocol.transport import InProcHub, PeerUnavailable

PROMPT = "The old lighthouse keeper climbed the spiral stairs"
MAX_TOKENS = 12


class LossyLink:
    """Wraps the verifier mailbox's ``send``: records every TokenStream and, while armed, makes
    the send of the ``drop``-th non-empty unfinished delta fail (as a reconnect would lose it);
    the verifier has counted those tokens as streamed by then."""

    def __init__(self, mailbox) -> None:
        self.mailbox, self._send = mailbox, mailbox.send
        self.sent: list[TokenStream] = []
        self.drop: int | None = None
        self._n = 0
        mailbox.send = self.send

    def arm(self, drop: int) -> None:
        self.drop, self._n, self.sent = drop, 0, []

    def send(self, peer, msg) -> None:
        if isinstance(msg, TokenStream):
            if msg.token_ids and not msg.finished:
                self._n += 1
                if self._n == self.drop:
                    self.drop = None
                    raise PeerUnavailable(f"{peer}: connection reset (test)")
            self.sent.append(msg)
        self._send(peer, msg)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    from specmesh.engine.loader import load_model

    loaded = load_model(tiny_model_dir, dtype="float32")
    tok = loaded.tokenizer
    prompt_ids = completion_prompt_ids(tok, PROMPT)
    c = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=0, eos_token_ids=())
    (ref,) = c.generate([prompt_ids], SamplingParams(max_tokens=MAX_TOKENS))
    link = LossyLink(c.verifier.mailbox)
    stop = threading.Event()

    def drive():
        while not stop.is_set():
            c.drafter.step()
            c.prefill.step()
            c.verifier.step()
            time.sleep(0.005)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    backend = MailboxBackend(c.client, lambda: VERIFIER, recv_timeout_s=0.1)
    app = create_app(backend, tok, "tiny", 1024, default_max_tokens=MAX_TOKENS)
    server, _, port = serve_gateway(app)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    yield {"client": client, "cluster": c, "tok": tok, "ref": ref.token_ids, "link": link,
           "backend": backend, "prompt_ids": prompt_ids}
    client.close()
    server.stop()
    backend.close()
    stop.set()
    thread.join(5)


def _wait_verifier_idle(c, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while c.verifier.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not c.verifier.requests, "the verifier still holds the request"


def test_verifier_stamps_each_delta_with_the_offset_of_its_first_token(served):
    link, c = served["link"], served["cluster"]
    link.arm(drop=None)
    r = served["client"].post("/v1/completions", json={"prompt": PROMPT, "temperature": 0,
                                                      "max_tokens": MAX_TOKENS})
    assert r.status_code == 200, r.text
    streams = [m for m in link.sent if m.request_id == r.json()["id"]]
    assert len(streams) > 2
    n = 0
    for m in streams:
        assert m.offset == n, [(m.offset, m.token_ids) for m in streams]
        n += len(m.token_ids)
    assert n == MAX_TOKENS == r.json()["usage"]["completion_tokens"]
    _wait_verifier_idle(c)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_lost_delta_fails_the_request_instead_of_a_200_with_a_hole(served, stream):
    client, c, ref, link = (served[k] for k in ("client", "cluster", "ref", "link"))
    link.arm(drop=3)
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": stream,
            "return_token_ids": True}
    # the gap ends the request at once: its error names the gap (a stream idle timeout would
    # say so instead), and the client's 30 s timeout catches a hang
    if not stream:
        r = client.post("/v1/completions", json=body)
        assert r.status_code >= 500, r.text
        err = r.json()["error"]
        assert "gap" in err["message"] and VERIFIER in err["message"], err
    else:
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(ln[6:]) for ln in lines[:-1]]
        assert "error" in events[-1] and "gap" in events[-1]["error"]["message"], events[-1]
        ids = [t for e in events[:-1] for ch in e["choices"] for t in ch["token_ids"]]
        # what the client saw is exactly the committed output up to the hole, in order
        assert ids and ids == list(ref[:len(ids)])
        assert not any(ch.get("finish_reason") for e in events[:-1] for ch in e["choices"])
    assert served["backend"].num_in_flight == 0
    _wait_verifier_idle(c)  # the gateway aborted it on the verifier


class ScriptedVerifier:
    """Answers every GenerateRequest with the given (offset, token_ids) deltas, then a
    finished one; records Aborts."""

    def __init__(self, mailbox, deltas: list[tuple[int, list[int]]]) -> None:
        self.mb, self.deltas = mailbox, deltas
        self.aborts: list[Abort] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            env = self.mb.recv(0.02)
            if env is None:
                continue
            if isinstance(env.msg, Abort):
                self.aborts.append(env.msg)
            elif isinstance(env.msg, GenerateRequest):
                rid = env.msg.request_id
                for off, ids in self.deltas:
                    self.mb.send(env.peer, TokenStream(request_id=rid, token_ids=ids,
                                                       offset=off))
                end = self.deltas[-1][0] + len(self.deltas[-1][1])
                self.mb.send(env.peer, TokenStream(request_id=rid, token_ids=[], offset=end,
                                                   finished=True, finish_reason="length"))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)


def _run_backend(deltas):
    hub = InProcHub()
    fake = ScriptedVerifier(hub.mailbox("verifier-0"), deltas)
    backend = MailboxBackend(hub.mailbox("gateway-0"), lambda: "verifier-0",
                             recv_timeout_s=0.05)

    async def one():
        req = GenerateRequest(request_id="r", prompt_token_ids=[1, 2], sampling=SamplingParams())
        return [m async for m in backend.generate(req)]

    try:
        out = asyncio.run(asyncio.wait_for(one(), 10))
        deadline = time.monotonic() + 5
        while out[-1].finish_reason == "error" and not fake.aborts and \
                time.monotonic() < deadline:
            time.sleep(0.01)
        return out, fake.aborts, backend.num_in_flight
    finally:
        backend.close()
        fake.close()


@pytest.mark.parametrize("deltas,why", [
    ([(0, [5, 6]), (3, [8])], "gap"),          # token 2 never arrived
    ([(0, [5, 6]), (1, [6, 7])], "overlap"),   # token 1 sent twice
    ([(1, [5])], "gap"),                       # the first delta lost
], ids=["gap", "overlap", "first-lost"])
def test_backend_fails_on_a_gap_or_an_overlap(deltas, why):
    out, aborts, in_flight = _run_backend(deltas)
    assert out[-1].finished and out[-1].finish_reason == "error" and why in out[-1].error
    good = [t for m in out[:-1] for t in m.token_ids]
    assert good == [5, 6][:len(good)] and all(not m.finished for m in out[:-1])
    assert [a.request_id for a in aborts] == ["r"]  # the verifier is told to drop it
    assert in_flight == 0


def test_backend_passes_contiguous_deltas():
    out, aborts, in_flight = _run_backend([(0, [5, 6]), (2, []), (2, [7]), (3, [8, 9])])
    assert [t for m in out for t in m.token_ids] == [5, 6, 7, 8, 9]
    assert out[-1].finish_reason == "length" and not aborts and in_flight == 0
