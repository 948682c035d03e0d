"""OpenAI-style errors of the gateway: ``{"error": {"message", "type", "param", "code"}}``
with an HTTP status, as OpenAI and vLLM answer them (a bad request is a 400 naming the field,
never a failure of a role)."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class GatewayError(Exception):
    """An error answered as ``{"error": {...}}`` with ``status_code``."""

    def __init__(self, status_code: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_value" if param else None)
