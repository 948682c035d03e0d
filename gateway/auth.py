"""The gateway's API key (``--api-key`` or its environment variable, cluster/security_options.py;
as vLLM's and SGLang's ``--api-key``): every route but ``/health`` and ``/metrics`` (those too with
``--protect-metrics``) requires ``Authorization: Bearer <key>``; anything else is answered 401
in OpenAI's error shape (``{"error": {"type": "invalid_request_error", "code":
"invalid_api_key", ...}}``, with ``WWW-Authenticate: Bearer``) before the request reaches a
route, so no body is read or parsed for a client without the key.

The comparison is constant-time (:func:`hmac.compare_digest` of the presented token and the
key, as bytes). The key is never logged, echoed in an error, or shown in a config's repr
(ClusterConfig keeps it out of its repr); a refusal is counted (``specmesh:gateway_auth_
refusals``) and logged with the client's address only.

A pure ASGI middleware (not Starlette's ``BaseHTTPMiddleware``), so streamed responses pass
through untouched.
"""

from __future__ import annotations

import hmac
import logging
import time

from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter

from specmesh.gateway.api_errors import error_body

log = logging.getLogger(__name__)

#: refusals are logged at most this often, seconds (the rest are counted, then summed up)
LOG_EVERY_S = 1.0
#: routes open without the key unless ``protect_metrics`` (probes and scrapers carry none)
OPEN_PATHS = ("/health", "/metrics")


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the request's ``Authorization: Bearer <token>`` header (ASGI raw headers;
    the scheme is case-insensitive, RFC 6750); None without one."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


class ApiKeyMiddleware:
    """ASGI middleware answering 401 to an HTTP request without the key.

    Args:
        app: the ASGI app it guards.
        api_key: the key clients must present.
        protect_metrics: guard ``/health`` and ``/metrics`` too.
        refusals: counts the requests refused (None: not counted).
    """

    def __init__(self, app, api_key: str, protect_metrics: bool = False,
                 refusals: Counter | None = None) -> None:
        if not api_key:
            raise ValueError("ApiKeyMiddleware needs a non-empty key")
        self.app = app
        self._key = api_key.encode()
        self.open_paths = () if protect_metrics else OPEN_PATHS
        self.refusals = refusals
        self._logged_at = -LOG_EVERY_S  # monotonic time of the last refusal logged
        self._unlogged = 0

    def allowed(self, token: bytes | None) -> bool:
        """Whether ``token`` is the key (constant-time in the token's content)."""
        # compare_digest's time depends on the lengths only, never on where the bytes differ
        return token is not None and hmac.compare_digest(token, self._key)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") \
                or scope.get("path", "") in self.open_paths \
                or self.allowed(bearer_token(scope.get("headers") or [])):
            await self.app(scope, receive, send)
            return
        if self.refusals is not None:
            self.refusals.inc()
        self._log_refusal(scope)
        if scope["type"] == "websocket":  # no route takes one; refused like HTTP all the same
            await send({"type": "websocket.close", "code": 1008})
            return
        body = error_body("Incorrect or missing API key: send the header 'Authorization: "
                          "Bearer <key>' with this server's key", "invalid_request_error",
                          None, "invalid_api_key")
        resp = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await resp(scope, receive, send)


    def _log_refusal(self, scope) -> None:
        """Log a refusal with the client's address (never the token), at most once a
        second: a client hammering the port cannot flood the log."""
        now = time.monotonic()
        if now - self._logged_at < LOG_EVERY_S:
            self._unlogged += 1
            return
        client = scope.get("client") or ("?", 0)
        more = f" ({self._unlogged} more since the last one logged)" if self._unlogged else ""
        self._logged_at, self._unlogged = now, 0
        log.warning("gateway: 401 for %s %s from %s:%s (no or a wrong API key)%s",
                    scope.get("method", "WEBSOCKET"), scope.get("path"), client[0], client[1],
                    more)


def add_api_key(app, api_key: str | None, protect_metrics: bool = False,
                registry: CollectorRegistry | None = None) -> None:
    """Guard ``app`` with ``api_key`` (:class:`ApiKeyMiddleware`); None: nothing to do (an
    open server, the default on the loopback)."""
    if api_key is None:
        return
    refusals = Counter("specmesh:gateway_auth_refusals",
                       "HTTP requests refused with 401 (no or a wrong API key)",
                       registry=registry)
    app.add_middleware(ApiKeyMiddleware, api_key=api_key, protect_metrics=protect_metrics,
                       refusals=refusals)
