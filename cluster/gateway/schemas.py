"""Request bodies of the OpenAI-compatible endpoints and OpenAI-style errors.

Unknown fields are ignored (clients send many optional OpenAI fields); fields we cannot honour
(``n > 1``, ``logprobs``, ``echo``, ``best_of > 1``) are refused with HTTP 400 rather than
silently dropped.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field


#: longest client-supplied request id (body ``request_id`` or header ``X-Request-Id``)
MAX_REQUEST_ID_LEN = 256


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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _CommonRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM extension; 0 / -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    num_speculative_tokens: int | None = Field(default=None, ge=0)  # specmesh: this request's kappa
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    # vLLM extension: the client's request id (or header X-Request-Id); the response id is
    # ``cmpl-<id>`` / ``chatcmpl-<id>``; one already in flight is refused with HTTP 409
    request_id: str | None = Field(default=None, min_length=1, max_length=MAX_REQUEST_ID_LEN)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """Refuse options this gateway does not implement (HTTP 400)."""
        if self.n != 1:
            raise bad_request("only n=1 is supported", param="n")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              param="stream_options")


class CompletionRequest(_CommonRequest):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo is not supported", param="echo")
        if self.logprobs is not None:
            raise bad_request("logprobs are not supported", param="logprobs")
        if self.best_of not in (None, 1):
            raise bad_request("only best_of=1 is supported", param="best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix")


class ChatCompletionRequest(_CommonRequest):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise bad_request("logprobs are not supported", param="logprobs")

    def output_limit(self) -> int | None:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages for the chat template; text content parts are joined into one string."""
        out = []
        for i, m in enumerate(self.messages):
            if not isinstance(m.get("role"), str):
                raise bad_request(f"messages[{i}].role must be a string", param="messages")
            content = m.get("content")
            if isinstance(content, list):
                texts = []
                for part in content:
                    if not isinstance(part, dict) or part.get("type") != "text":
                        raise bad_request("only text content parts are supported",
                                          param="messages")
                    texts.append(str(part.get("text", "")))
                content = "".join(texts)
            elif content is None:
                content = ""
            elif not isinstance(content, str):
                raise bad_request(f"messages[{i}].content must be a string or a list of parts",
                                  param="messages")
            out.append({**m, "content": content})
        return out
