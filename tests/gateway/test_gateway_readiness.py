"""Issue 9 scenario 12: ``/health`` says ready only when a request can be served end to end
(503 with the reason before), and a request that arrives while no verifier is connected waits
for one (bounded) instead of failing with 500 "no verifier is connected yet"."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from specmesh.gateway.app import create_app
from specmesh.gateway.backend import MailboxBackend
from specmesh.gateway.server import serve_gateway
from specmesh.gateway.tokens import completion_prompt_ids
from specmesh.cluster.hosts.gateway import GatewayHost
from specmesh.cluster.inprocess import VERIFIER, InProcessCluster
from specmesh.protocol.messages import SamplingParams

CONNECT_AFTER_S = 1.0


@pytest.fixture(scope="module")
def late_verifier(tiny_model_dir):
    """The real app over in-process workers whose verifier "connects" CONNECT_AFTER_S after
    the gateway starts."""
    from specmesh.engine.loader import load_model

    loaded = load_model(tiny_model_dir, dtype="float32")
    c = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=2)
    stop = threading.Event()
    connected = threading.Event()

    def drive():
        while not stop.is_set():
            c.drafter.step()
            c.prefill.step()
            c.verifier.step()
            time.sleep(0.005)

    def pick() -> str:
        if not connected.is_set():
            raise ConnectionError("no verifier is connected yet")
        return VERIFIER

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    backend = MailboxBackend(c.client, pick, recv_timeout_s=0.1, verifier_wait_s=20)
    app = create_app(backend, loaded.tokenizer, "tiny", 1024, default_max_tokens=8,
                     readiness=lambda: "" if connected.is_set() else "no verifier is connected yet")
    server, _, port = serve_gateway(app)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    yield SimpleNamespace(client=client, connected=connected, cluster=c, tok=loaded.tokenizer)
    client.close()
    server.stop()
    backend.close()
    stop.set()
    thread.join(5)


def test_health_is_503_until_a_request_can_be_served_and_early_requests_wait(late_verifier):
    s = late_verifier
    r = s.client.get("/health")
    assert r.status_code == 503 and "no verifier is connected" in r.json()["reason"]
    result = {}

    def ask():
        result["r"] = s.client.post("/v1/completions", json={
            "prompt": "Hello there", "max_tokens": 6, "temperature": 0, "return_token_ids": True})

    asker = threading.Thread(target=ask)
    t0 = time.monotonic()
    asker.start()
    time.sleep(CONNECT_AFTER_S)
    assert "r" not in result  # still waiting for a verifier, not failed
    s.connected.set()
    asker.join(30)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert time.monotonic() - t0 >= CONNECT_AFTER_S
    (want,) = InProcessCluster(s.cluster.verifier.verify_step.runner.model,
                               s.cluster.verifier.verify_step.runner.config,
                               num_speculative_tokens=0).generate(
        [completion_prompt_ids(s.tok, "Hello there")], SamplingParams(max_tokens=6))
    assert r.json()["usage"]["completion_tokens"] == len(want.token_ids)
    assert r.json()["choices"][0]["token_ids"] == list(want.token_ids)
    assert s.client.get("/health").status_code == 200


def test_no_verifier_within_the_bound_is_a_clear_error():
    """A request with no verifier to go to asks again every poll for ``verifier_wait_s`` on
    the backend's clock, then fails with an error saying so (a fake clock: each ask takes
    1/8 s of it)."""
    class Mailbox:
        def recv(self, timeout_s=0.0):
            time.sleep(timeout_s)

        def wake(self):
            pass

        def send(self, peer, msg):  # pragma: no cover - no verifier, nothing is sent
            raise AssertionError("sent without a verifier")

    now = [100.0]
    asked = []

    def pick():
        asked.append(now[0])
        now[0] += 0.125
        raise ConnectionError("no verifier is connected yet")

    import asyncio

    backend = MailboxBackend(Mailbox(), pick, recv_timeout_s=0.05, verifier_wait_s=0.5,
                             clock=lambda: now[0])

    async def one():
        from specmesh.protocol.messages import GenerateRequest

        req = GenerateRequest(request_id="r", prompt_token_ids=[1], sampling=SamplingParams())
        return [m async for m in backend.generate(req)]

    (msg,) = asyncio.run(one())
    # asked at 0, 1/8, 2/8 and 3/8 s into the wait; after the last ask the clock read 0.5 s
    assert asked == [100.0, 100.125, 100.25, 100.375]
    assert msg.finished and msg.finish_reason == "error"
    assert "no verifier" in msg.error and "waited 0.5 s" in msg.error
    assert backend.num_in_flight == 0
    backend.close()


def test_gateway_host_readiness_needs_prefill_verifier_and_a_connection():
    ready: set[str] = set()
    host = SimpleNamespace(prefills=[], verifiers=[],
                           mailbox=SimpleNamespace(ready=lambda p: p in ready))
    reason = lambda: GatewayHost.not_ready_reason(host)  # noqa: E731
    assert "prefill" in reason()
    host.prefills = ["prefill-0"]
    assert "verifier" in reason()
    host.verifiers = ["verifier-0"]
    assert "connected" in reason()
    ready.add("verifier-0")
    assert reason() == ""
