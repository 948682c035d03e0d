"""An in-process cluster driven by a thread behind the real gateway app on 127.0.0.1: what the
gateway tests of each request feature serve against (no Ray; the workers exchange encoded
messages through the in-process hub)."""

from __future__ import annotations

import threading
import time

import httpx

from specmesh.cluster.inprocess import VERIFIER, InProcessCluster
from specmesh.gateway.app import create_app
from specmesh.gateway.backend import MailboxBackend
from specmesh.gateway.server import serve_gateway
from specmesh.protocol.messages import GenerateRequest


class ServedGateway:
    """``loaded`` (engine.loader.load_model's result) served at kappa ``num_speculative_tokens``
    with ``proposer`` (None: n-gram) and, with ``tokenizer``, structured output on; a request
    may pick its own kappa. ``sent`` keeps every GenerateRequest the gateway put on the wire.
    ``client``: an httpx client on the gateway. Call :meth:`close` when done."""

    def __init__(self, loaded, *, num_speculative_tokens: int = 4, proposer=None,
                 tokenizer=None, max_model_len: int = 1024,
                 default_max_tokens: int = 16) -> None:
        self.cluster = InProcessCluster(loaded.model, loaded.config,
                                        num_speculative_tokens=num_speculative_tokens,
                                        eos_token_ids=(), proposer=proposer, tokenizer=tokenizer)
        self.sent: list[GenerateRequest] = []
        send = self.cluster.client.send

        def record(peer, msg):  # what the gateway put on the wire
            if isinstance(msg, GenerateRequest):
                self.sent.append(msg)
            return send(peer, msg)

        self.cluster.client.send = record  # type: ignore[method-assign]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drive, daemon=True)
        self._thread.start()
        self.backend = MailboxBackend(self.cluster.client, lambda: VERIFIER, recv_timeout_s=0.1)
        app = create_app(self.backend, loaded.tokenizer, "tiny", max_model_len,
                         default_max_tokens=default_max_tokens)
        self.server, _, port = serve_gateway(app)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)

    def _drive(self) -> None:
        c = self.cluster
        while not self._stop.is_set():
            c.drafter.step()
            c.prefill.step()
            c.verifier.step()
            time.sleep(0.001)

    def close(self) -> None:
        self.client.close()
        self.server.stop()
        self.backend.close()
        self._stop.set()
        self._thread.join(5)
