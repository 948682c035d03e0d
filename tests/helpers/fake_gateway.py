"""A stand-in for the specmesh gateway in the bench's tests (no model, no cluster): an
OpenAI-compatible HTTP server on 127.0.0.1 in a thread of the test process, recording every
request in order (``requests``: (path, JSON body)).

- ``POST /v1/chat/completions``: ``max_tokens`` tokens ``w0 w1 ...`` (``wI`` = the I-th word
  of the last message, cycled), streamed (one token a chunk, then a usage chunk) or as one
  object, with ``token_ids`` (vLLM's ``return_token_ids``) and ``spec_stats``. With a
  ``prediction`` of P words: ``usage.completion_tokens_details`` has min(P, max_tokens)
  accepted and the rest of the P rejected, and the spec stats count those P as drafted and the
  accepted ones as accepted; ``refuse_prediction``: HTTP 400 naming ``prediction``, as a
  gateway without Predicted Outputs answers.
- ``POST /v1/specmesh/drafters/clear_history``: HTTP ``clear_status`` (200: cleared; 404: a
  server without the endpoint).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeGateway:
    """Start on enter, stop on exit; ``url`` is its base URL (no ``/v1``)."""

    def __init__(self, clear_status: int = 200, refuse_prediction: bool = False) -> None:
        self.clear_status = clear_status
        self.refuse_prediction = refuse_prediction
        self.requests: list[tuple[str, dict]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self.url = f"http://127.0.0.1:{self._server.server_port}"

    def __enter__(self) -> FakeGateway:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def record(self, path: str, body: dict) -> None:
        with self._lock:
            self.requests.append((path, body))

    def paths(self) -> list[str]:
        with self._lock:
            return [p for p, _ in self.requests]


def _handler(gw: FakeGateway) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _json(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n) or b"{}")
            gw.record(self.path, body)
            if self.path == "/v1/specmesh/drafters/clear_history":
                if gw.clear_status == 200:
                    return self._json(200, {"cleared": True})
                return self._json(gw.clear_status, {"error": {"message": "Not Found"}
                                                    if gw.clear_status == 404 else
                                                    {"message": "drafter unreachable"}})
            if self.path != "/v1/chat/completions":
                return self._json(404, {"error": {"message": "Not Found"}})
            if body.get("prediction") is not None and gw.refuse_prediction:
                return self._json(400, {"error": {
                    "message": "prediction is not supported by this server",
                    "type": "invalid_request_error", "param": "prediction", "code": None}})
            self._complete(body)

        def _complete(self, body: dict) -> None:
            words = body["messages"][-1]["content"].split() or ["x"]
            n = int(body.get("max_tokens") or 8)
            tokens = [words[i % len(words)] + " " for i in range(n)]
            ids = [len(t) for t in tokens]
            usage: dict = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
            spec = {"num_draft_tokens": 0, "num_accepted_tokens": 0, "num_verify_steps": n}
            pred = body.get("prediction")
            if pred is not None:
                p = len(pred["content"].split())
                accepted = min(p, n)
                usage["completion_tokens_details"] = {
                    "accepted_prediction_tokens": accepted,
                    "rejected_prediction_tokens": p - accepted}
                spec = {"num_draft_tokens": p, "num_accepted_tokens": accepted,
                        "num_verify_steps": n - accepted + 1}
            base = {"id": "chatcmpl-fake", "created": 0, "model": body.get("model", "m")}
            if not body.get("stream"):
                return self._json(200, {**base, "object": "chat.completion", "choices": [{
                    "index": 0, "message": {"role": "assistant", "content": "".join(tokens)},
                    "finish_reason": "length", "token_ids": ids}], "usage": usage,
                    "spec_stats": spec})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            chunk = {**base, "object": "chat.completion.chunk"}

            def send(obj: dict) -> None:
                self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
                self.wfile.flush()

            for i, t in enumerate(tokens):
                send({**chunk, "choices": [{"index": 0, "finish_reason": None,
                                            "delta": {"content": t}, "token_ids": [ids[i]]}]})
            send({**chunk, "choices": [{"index": 0, "finish_reason": "length", "delta": {}}],
                  "spec_stats": spec})
            send({**chunk, "choices": [], "usage": usage})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    return Handler
