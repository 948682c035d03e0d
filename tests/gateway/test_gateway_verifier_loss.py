"""Issue 9 scenario 3: a verifier that dies, restarts or goes silent must not leave the
gateway waiting forever. The real GatewayHost (HTTP app, MailboxBackend, ZMQ mailbox) against
a fake verifier on a real ZMQ mailbox: a request whose verifier died fails with a clear error
once the grace period is over (SSE: an error event, then the end; JSON: a 5xx naming the
cause) and its pending entry is gone; a new incarnation (new HelloAck) fails the old one's
requests at once; a verifier that left the roster, or is alive but silent (stream idle
timeout), is bounded too.

Which bound ended a request shows in its error, never in how long it took (a busy machine
makes everything later); the grace period itself runs on a fake clock in
test_a_lost_verifiers_requests_fail_when_the_grace_is_over."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import zmq

from specmesh.cluster.config import ClusterConfig
from specmesh.gateway.backend import STREAM_IDLE_TIMEOUT_S, MailboxBackend
from specmesh.protocol.messages import Abort, GenerateRequest, SamplingParams, TokenStream
from specmesh.protocol.zmq_transport import ZmqMailbox

VERIFIER = "verifier-0"
#: seconds after which a wait for something that must happen fails as hung
HANG_S = 60.0
PREFILL_ENTRY = {"instance_id": "prefill-0", "role": "prefill", "endpoint": "tcp://127.0.0.1:9",
                 "incarnation": 1}


class FakeVerifier:
    """A verifier on a real ZMQ ROUTER: ``mode`` "hold" answers a GenerateRequest with one
    delta and then nothing, "finish" with a delta and the end, "silent" with nothing. It
    announces the gateway's model identity and draft method (``identity``, set by the
    ``gateway`` fixture): the gateway refuses a HelloAck that differs."""

    identity: tuple = (None, "")

    def __init__(self, token_ids: list[int], mode: str = "hold", port: int = 0,
                 incarnation: int | None = None) -> None:
        model, draft_method = self.identity
        deadline = time.monotonic() + 10
        while True:  # ZMQ frees a closed socket's port in its I/O thread, a little later
            try:
                self.mb = ZmqMailbox(VERIFIER, "verifier", port=port, incarnation=incarnation,
                                     model=model, draft_method=draft_method)
                break
            except zmq.ZMQError:
                if not port or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.token_ids, self.mode = token_ids, mode
        self.requests: list[GenerateRequest] = []
        self.aborts: list[Abort] = []
        self.answered = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.mb.endpoint.rsplit(":", 1)[1])

    def entry(self) -> dict:
        return {"instance_id": VERIFIER, "role": "verifier", "endpoint": self.mb.endpoint,
                "incarnation": self.mb.incarnation}

    def _run(self) -> None:
        while not self._stop.is_set():
            env = self.mb.recv(0.02)
            if env is None:
                continue
            msg = env.msg
            if isinstance(msg, Abort):
                self.aborts.append(msg)
            elif isinstance(msg, GenerateRequest):
                self.requests.append(msg)
                if self.mode != "silent":
                    self.mb.send(env.peer, TokenStream(request_id=msg.request_id,
                                                       token_ids=self.token_ids, offset=0))
                if self.mode == "finish":
                    self.mb.send(env.peer, TokenStream(
                        request_id=msg.request_id, token_ids=[], offset=len(self.token_ids),
                        finished=True, finish_reason="length"))
                self.answered.set()

    def kill(self) -> None:
        """The process dies: its sockets close."""
        self._stop.set()
        self._thread.join(2)
        self.mb.close()


@pytest.fixture(scope="module")
def gateway(tiny_model_dir):
    import torch

    from specmesh.cluster.hosts.gateway import GatewayHost

    threads = torch.get_num_threads()
    cfg = ClusterConfig(model=str(tiny_model_dir), port=0)
    host = GatewayHost("gateway-0", cfg)
    torch.set_num_threads(threads)  # the host set the gateway's plan for this process
    FakeVerifier.identity = (host.mailbox.model, host.mailbox.draft_method)
    client = httpx.Client(base_url=f"http://127.0.0.1:{host.port}", timeout=HANG_S)
    ids = host.tokenizer(" Hello there, general Kenobi")["input_ids"]
    yield host, client, ids
    client.close()
    host.stop()


def _connect(host, fake: FakeVerifier) -> None:
    host.update_roster([PREFILL_ENTRY, fake.entry()])
    _wait(lambda: host.mailbox.ready(VERIFIER) and not host.not_ready_reason(), "connected")


def _wait(cond, what: str, timeout_s: float = HANG_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not {what} within {timeout_s} s"
        time.sleep(0.01)


def _post_in_thread(client, body: dict) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def ask():
        out["r"] = client.post("/v1/completions", json=body)

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    return t, out


BODY = {"prompt": "Hello", "max_tokens": 50, "temperature": 0}


def _error_message(r: httpx.Response) -> str:
    assert r.status_code >= 500, r.text
    return r.json()["error"]["message"]


def test_verifier_killed_non_streaming_gets_a_5xx_after_the_grace(gateway):
    host, client, ids = gateway
    fake = FakeVerifier(ids)
    _connect(host, fake)
    t, out = _post_in_thread(client, BODY)
    assert fake.answered.wait(HANG_S)
    fake.kill()
    t.join(HANG_S)
    assert "r" in out, "the request still hangs"
    # ended by the lost connection's grace, not the stream idle timeout
    msg = _error_message(out["r"])
    assert VERIFIER in msg and "lost the connection" in msg
    assert host.backend.num_in_flight == 0


def test_verifier_killed_streaming_gets_an_sse_error_then_the_end(gateway):
    host, client, ids = gateway
    fake = FakeVerifier(ids)
    _connect(host, fake)
    events, killed = [], False
    with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if not killed and line != "data: [DONE]" and json.loads(line[6:])["choices"][0]["text"]:
                killed = True  # the client has text: now the verifier dies
                fake.kill()
    assert killed and events[-1] == "[DONE]"
    err = json.loads(events[-2])
    # ended by the lost connection's grace, not the stream idle timeout
    assert "error" in err and VERIFIER in err["error"]["message"], err
    assert "lost the connection" in err["error"]["message"], err
    assert host.backend.num_in_flight == 0


def test_a_new_incarnation_fails_the_old_ones_requests_at_once(gateway):
    host, client, ids = gateway
    host.backend.verifier_lost_grace_s = 60.0  # only the new Hello can end the wait in time
    try:
        fake = FakeVerifier(ids)
        _connect(host, fake)
        t, out = _post_in_thread(client, BODY)
        assert fake.answered.wait(HANG_S)
        old, port = fake.mb.incarnation, fake.port
        fake.kill()
        # Ray restarted it: same instance id (here the same port), a new incarnation
        fake = FakeVerifier(ids, mode="finish", port=port, incarnation=old + 1)
        t.join(HANG_S)
        assert "r" in out, "the request still hangs"
        # ended by the new incarnation's Hello, not the grace (that error says "lost the
        # connection ... within 60 s")
        msg = _error_message(out["r"])
        assert VERIFIER in msg and "restarted" in msg
        assert host.backend.num_in_flight == 0
        # and the gateway serves through the new incarnation
        _wait(lambda: host.mailbox.ready(VERIFIER), "reconnected")
        r = client.post("/v1/completions", json=BODY)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == len(ids)
        fake.kill()
    finally:
        host.backend.verifier_lost_grace_s = 2.0


def test_a_verifier_that_left_the_roster_fails_its_requests(gateway):
    host, client, ids = gateway
    fake = FakeVerifier(ids)
    _connect(host, fake)
    t, out = _post_in_thread(client, BODY)
    assert fake.answered.wait(HANG_S)
    host.update_roster([PREFILL_ENTRY])  # the controller deregistered it (dead or hung)
    t.join(HANG_S)
    assert "r" in out, "the request still hangs"
    assert "left the roster" in _error_message(out["r"])
    assert host.backend.num_in_flight == 0
    fake.kill()


def test_a_live_but_silent_verifier_is_bounded_by_the_stream_idle_timeout(gateway):
    host, client, ids = gateway
    assert host.backend.stream_timeout_s == host.cfg.stream_idle_timeout_s == \
        STREAM_IDLE_TIMEOUT_S  # on by default
    host.backend.stream_timeout_s = 1.0
    fake = FakeVerifier(ids, mode="silent")
    try:
        _connect(host, fake)
        t0 = time.monotonic()
        r = client.post("/v1/completions", json=BODY)
        assert time.monotonic() - t0 >= 1.0  # not before the timeout (later is no error)
        msg = _error_message(r)
        assert "stream idle timeout" in msg and VERIFIER in msg
        assert host.backend.num_in_flight == 0
        _wait(lambda: fake.aborts, "aborted on the verifier")  # it may free the request
    finally:
        host.backend.stream_timeout_s = STREAM_IDLE_TIMEOUT_S
        fake.kill()


def test_a_lost_verifiers_requests_fail_when_the_grace_is_over():
    """A verifier whose connection dropped has ``verifier_lost_grace_s`` on the backend's clock
    to come back: its request waits while the clock is short of it and fails, naming the lost
    connection, once it is over (a fake clock and mailbox: no sockets)."""
    import asyncio

    class Mailbox:
        def __init__(self) -> None:
            self.sent: list = []

        def recv(self, timeout_s=0.0):
            time.sleep(0.002)  # nothing arrives

        def wake(self):
            pass

        def send(self, peer, msg):
            self.sent.append((peer, msg))

    now = [50.0]
    mailbox = Mailbox()
    backend = MailboxBackend(mailbox, lambda: VERIFIER, recv_timeout_s=0.01,
                             stream_timeout_s=None, verifier_lost_grace_s=2.0,
                             clock=lambda: now[0])

    async def reader_turns(n: int) -> None:
        """Until the reader thread has gone round ``n`` more times (it checks the grace)."""
        start, deadline = backend.num_reader_turns, time.monotonic() + HANG_S
        while backend.num_reader_turns < start + n:
            assert time.monotonic() < deadline, "the reader thread stopped"
            await asyncio.sleep(0.002)

    async def scenario() -> list[TokenStream]:
        got: list[TokenStream] = []

        async def consume() -> None:
            req = GenerateRequest(request_id="r", prompt_token_ids=[1],
                                  sampling=SamplingParams())
            got.extend([m async for m in backend.generate(req)])

        task = asyncio.create_task(consume())
        while not mailbox.sent:
            await asyncio.sleep(0.002)
        backend.verifier_disconnected(VERIFIER)
        now[0] += 1.75  # within the grace: the request waits
        await reader_turns(3)
        assert not got and backend.num_in_flight == 1
        now[0] += 0.25  # the grace is over
        await asyncio.wait_for(task, HANG_S)
        return got

    try:
        (msg,) = asyncio.run(scenario())
    finally:
        backend.close()
    assert msg.finished and msg.finish_reason == "error"
    assert "lost the connection" in msg.error and "within 2 s" in msg.error
    assert backend.num_verifier_losses == 1 and backend.num_in_flight == 0


def test_stream_idle_timeout_is_a_cluster_option():
    import argparse

    from specmesh.cluster.options import add_cluster_options, cluster_config

    p = argparse.ArgumentParser()
    add_cluster_options(p)
    base = ["--device", "cpu", "--drafter", "ngram"]
    assert cluster_config(p.parse_args(base)).stream_idle_timeout_s == STREAM_IDLE_TIMEOUT_S
    cfg = cluster_config(p.parse_args(base + ["--stream-idle-timeout", "30"]))
    assert cfg.stream_idle_timeout_s == 30
    assert cluster_config(p.parse_args(base + ["--stream-idle-timeout", "0"])) \
        .stream_idle_timeout_s is None
    with pytest.raises(ValueError):
        ClusterConfig(stream_idle_timeout_s=-1)
