"""Bounds on what one HTTP client may send the gateway (issue 38): each refusal is a clear error
that names the limit, answered before the request costs the cluster anything, and nothing is
lost for other requests.

The bounds of a request, and where each lives:

- body size: :class:`InputBoundsMiddleware` here (413, ``code: request_too_large``): a
  generation request's body at most ``max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN *
  max_model_len)`` (a prompt of max_model_len tokens, a prediction of
  MAX_PREDICTION_CHARS_PER_TOKEN characters per token, both JSON-escaped, fit with room);
  the drafters' corpus routes (``/v1/specmesh/``) ``CORPUS_BODY_BYTES`` (MAX_CORPUS_TOKENS
  token ids as JSON);
- concurrent generation requests per client (its address): the same middleware (429,
  ``code: too_many_requests``), released when the response (a stream too) has been sent;
- stop strings (count, length) and ``stop_token_ids`` (count): :func:`check_stop_bounds` (400);
- prompt tokens (``max_model_len - 1``), ``max_tokens`` (prompt + max_tokens within
  max_model_len), the prediction (characters, then tokens): gateway/request_build.py,
  ``RequestBuilder.build`` and ``RequestBuilder.prediction_ids``; request ids:
  gateway/schemas.py (MAX_REQUEST_ID_LEN);
- corpora (tokens, name): gateway/corpus_api.py and protocol/messages.py (MAX_CORPUS_TOKENS,
  MAX_CORPUS_NAME_LEN);
- one message on a role-to-role socket: protocol/zmq_transport.py (ZMQ_MAXMSGSIZE, sized from
  the largest legitimate message).
"""

from __future__ import annotations

import logging
from collections import Counter as Tally

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from specmesh.gateway.api_errors import bad_request, error_body
from specmesh.protocol.messages import MAX_CORPUS_TOKENS

log = logging.getLogger(__name__)

#: a generation request's body may have this many bytes per token of max_model_len ...
BODY_BYTES_PER_TOKEN = 512
#: ... and at least this many
MIN_BODY_BYTES = 1 << 20
#: bytes a corpus route's body may have: MAX_CORPUS_TOKENS token ids as JSON (at most 10
#: digits and a comma each) with room for the rest
CORPUS_BODY_BYTES = 16 * MAX_CORPUS_TOKENS
#: path prefix of the drafters' corpus routes (gateway/corpus_api.py)
CORPUS_PREFIX = "/v1/specmesh/"
#: the routes that start a generation (counted per client)
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
#: stop strings a request may have, and characters per stop string (a longer stop is held
#: back from the stream for its length, gateway/detokenize.py)
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
#: ``stop_token_ids`` a request may have
MAX_STOP_TOKEN_IDS = 1024


def generation_body_limit(max_model_len: int) -> int:
    """Bytes a generation request's body may have on a server of ``max_model_len``."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


def check_stop_bounds(body) -> None:
    """Refuse a request with too many or too long stop strings or too many stop token ids.

    Raises:
        GatewayError: 400 naming the limit (param ``stop`` / ``stop_token_ids``).
    """
    stops = body.stop_list()
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop has {len(stops)} strings, more than this server takes "
                          f"({MAX_STOP_STRINGS})", param="stop")
    longest = max((len(s) for s in stops), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise bad_request(f"a stop string has {longest} characters, more than this server "
                          f"takes ({MAX_STOP_STRING_CHARS})", param="stop")
    ids = body.stop_token_ids or ()
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"stop_token_ids has {len(ids)} ids, more than this server takes "
                          f"({MAX_STOP_TOKEN_IDS})", param="stop_token_ids")


class _TooLarge(HTTPException):
    """The body grew past its limit while read (a chunked upload, or a lying Content-Length)."""


class InputBoundsMiddleware:
    """ASGI middleware: body size per route (413) and concurrent generation requests per
    client address (429; ``max_per_client`` 0: no limit).

    A body announced larger than its limit (``Content-Length``) is refused before a byte of
    it is read; one that turns out larger while read is cut there, and the route's body
    reading raises a 413 HTTPException (the app's handler answers it).
    """

    def __init__(self, app, max_model_len: int, max_per_client: int = 0) -> None:
        self.app = app
        self.generation_limit = generation_body_limit(max_model_len)
        self.max_per_client = max_per_client
        self.in_flight: Tally[str] = Tally()  # client address -> generation requests open
        self.num_refused_body = 0
        self.num_refused_busy = 0

    def body_limit(self, path: str) -> int:
        """Bytes a request to ``path`` may send."""
        return CORPUS_BODY_BYTES if path.startswith(CORPUS_PREFIX) else self.generation_limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        limit = self.body_limit(path)
        declared = _content_length(scope.get("headers") or [])
        if declared is not None and declared > limit:
            self.num_refused_body += 1
            await _refuse(scope, receive, send, 413, _too_large(declared, limit, "declares"),
                          "request_too_large")
            return
        receive = self._bounded(receive, limit)
        if not (self.max_per_client and path in GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        client = (scope.get("client") or ("unknown", 0))[0]
        if self.in_flight[client] >= self.max_per_client:
            self.num_refused_busy += 1
            log.warning("gateway: 429 for %s: %d requests in flight (the limit)", client,
                        self.in_flight[client])
            await _refuse(scope, receive, send, 429,
                          f"this client ({client}) has {self.in_flight[client]} requests in "
                          f"flight, the most this server takes per client "
                          f"(--max-requests-per-client {self.max_per_client}); retry when one "
                          "has finished", "too_many_requests")
            return
        self.in_flight[client] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[client] -= 1
            if self.in_flight[client] <= 0:
                del self.in_flight[client]

    def _bounded(self, receive, limit: int):
        seen = 0

        async def bounded_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    self.num_refused_body += 1
                    raise _TooLarge(413, _too_large(seen, limit, "sent at least"))
            return message

        return bounded_receive


def _too_large(size: int, limit: int, verb: str) -> str:
    return (f"the request body {verb} {size} bytes, more than this server takes on this route "
            f"({limit} bytes)")


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _refuse(scope, receive, send, status: int, message: str, code: str) -> None:
    kind = "rate_limit_error" if status == 429 else "invalid_request_error"
    await JSONResponse(error_body(message, kind, None, code), status_code=status)(
        scope, receive, send)


def add_input_bounds(app, max_model_len: int, max_per_client: int = 0) -> None:
    """Guard ``app`` with :class:`InputBoundsMiddleware`."""
    app.add_middleware(InputBoundsMiddleware, max_model_len=max_model_len,
                       max_per_client=max_per_client)
