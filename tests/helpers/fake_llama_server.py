"""A stand-in for llama.cpp's ``llama-server`` in tests (no llama.cpp needed): an
OpenAI-compatible HTTP server on ``--host``/``--port`` that ignores every other option.

- ``GET /health``: 503 for the first ``FAKE_LLAMA_LOADING`` polls (loading), then 200;
- ``POST /v1/chat/completions``: greedy "generation" of ``max_tokens`` tokens ``w0 w1 ...``
  (``wI`` = the I-th word of the last message, cycled), streamed as llama-server streams
  (a role chunk, content chunks of ``FAKE_LLAMA_TOKENS_PER_CHUNK`` tokens, a finish chunk, a
  usage chunk with ``timings``: ``draft_n`` = ``max_tokens``, ``draft_n_accepted`` = half)
  or as one JSON object; ``prompt_tokens`` = the words of all messages.

Environment: ``FAKE_LLAMA_ARGV`` (a file to write its command line to, one argument a
line), ``FAKE_LLAMA_EXIT`` (exit at once with that code), ``FAKE_LLAMA_IGNORE_TERM`` (ignore
SIGTERM: only SIGKILL stops it), ``FAKE_LLAMA_LOADING``, ``FAKE_LLAMA_TOKENS_PER_CHUNK``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _option(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv else default


class Handler(BaseHTTPRequestHandler):
    loading = int(os.environ.get("FAKE_LLAMA_LOADING", "0"))
    per_chunk = int(os.environ.get("FAKE_LLAMA_TOKENS_PER_CHUNK", "1"))

    def log_message(self, *args) -> None:  # quiet
        pass

    def _json(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path != "/health":
            return self._json(404, {"error": "not found"})
        if Handler.loading > 0:
            Handler.loading -= 1
            return self._json(503, {"error": {"message": "Loading model", "code": 503}})
        return self._json(200, {"status": "ok"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        words = body["messages"][-1]["content"].split() or ["x"]
        n = int(body.get("max_tokens") or 8)
        tokens = [words[i % len(words)] + " " for i in range(n)]
        prompt = sum(len(m["content"].split()) for m in body["messages"])
        usage = {"prompt_tokens": prompt, "completion_tokens": n,
                 "total_tokens": prompt + n}
        timings = {"draft_n": n, "draft_n_accepted": n // 2}
        base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0,
                "model": body.get("model", "fake")}
        if not body.get("stream"):
            return self._json(200, {**base, "object": "chat.completion", "choices": [{
                "index": 0, "message": {"role": "assistant", "content": "".join(tokens)},
                "finish_reason": "length"}], "usage": usage, "timings": timings})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()

        def send(obj: dict) -> None:
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

        send({**base, "choices": [{"index": 0, "finish_reason": None,
                                   "delta": {"role": "assistant", "content": None}}]})
        for i in range(0, n, self.per_chunk):
            send({**base, "choices": [{"index": 0, "finish_reason": None, "delta": {
                "content": "".join(tokens[i:i + self.per_chunk])}}]})
        send({**base, "choices": [{"index": 0, "finish_reason": "length", "delta": {}}]})
        send({**base, "choices": [], "usage": usage, "timings": timings})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True


def main(argv: list[str]) -> int:
    if os.environ.get("FAKE_LLAMA_ARGV"):
        with open(os.environ["FAKE_LLAMA_ARGV"], "w") as f:
            f.write("\n".join(argv) + "\n")
    if os.environ.get("FAKE_LLAMA_EXIT"):
        print("fake llama-server: failing at start as told", flush=True)
        return int(os.environ["FAKE_LLAMA_EXIT"])
    if os.environ.get("FAKE_LLAMA_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server = ThreadingHTTPServer((_option(argv, "--host", "127.0.0.1"),
                                  int(_option(argv, "--port", "8080"))), Handler)
    print(f"fake llama-server listening on port {server.server_port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
