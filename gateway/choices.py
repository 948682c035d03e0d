"""One choice of a response, whole or as stream chunks: text, echo, logprobs, token ids and
continuous usage, in OpenAI's and vLLM's shapes (issue 33; the logprobs objects in
gateway/logprobs.py).

- ``echo`` (completions): the prompt's text comes before the output (the first chunk of a
  stream carries it), and with ``logprobs`` the prompt's tokens and logprobs before the
  output's; ``max_tokens: 0`` with ``echo`` returns the prompt alone (vLLM: one token is
  generated and dropped).
- ``return_token_ids`` (vLLM): the output ids in each choice's (each chunk's) ``token_ids``,
  the prompt's in ``prompt_token_ids`` (the choice for completions, top level for chat; the
  first chunk of a stream).
- ``stream_options.continuous_usage_stats`` (vLLM, with ``include_usage``): every chunk carries
  the usage so far (``completion_tokens``: the output tokens committed up to that chunk).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from specmesh.gateway.api_errors import error_body
from specmesh.gateway.generation import Finish, RequestRun, TextDelta
from specmesh.gateway.logprobs import (
    TokenTexts, chat_logprobs, completion_logprobs, completion_text_length, vllm_prompt_logprobs,
)
from specmesh.gateway.structured import Structured, forced_tool_calls
from specmesh.protocol.messages import TokenLogprobs


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    """The event-stream response of ``body``."""
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@dataclass(frozen=True)
class ChoiceFormat:
    """How one choice is written. ``index``: its place in ``choices`` (the prompt's index for
    a list of prompts, vLLM); ``logprobs``: the request asked for logprobs; ``echo``: the
    prompt's text to put first (completions ``echo``; None: no echo); ``echo_only``: the
    generated tokens are dropped (``max_tokens: 0`` with echo); ``top``: the top logprobs
    per token the request asked (the prompt's may carry more, for ``prompt_logprobs``);
    ``prompt_logprobs``: vLLM's completions ``prompt_logprobs`` k (None: not asked)."""

    chat: bool
    index: int = 0
    logprobs: bool = False
    top: int = 0
    prompt_logprobs: int | None = None
    echo: str | None = None
    echo_only: bool = False
    return_token_ids: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    #: forced tool calls (chat ``tools`` with ``tool_choice`` "required" or a function,
    #: gateway/structured.py): the output is answered as ``tool_calls``; None: plain content
    tools: Structured | None = None


def usage_of(run: RequestRun) -> dict[str, Any]:
    """The OpenAI usage object of ``run`` so far; a request with a prediction also gets
    ``completion_tokens_details`` with its accepted / rejected prediction tokens (the
    verifier's count; ``completion_tokens`` stays the output's length, docs/operations.md,
    'Predicted Outputs'). ``prompt_tokens_details.cached_tokens``: the prompt tokens whose KV
    the prefill's prefix cache held (OpenAI's field; docs/operations.md, 'Prefix caching')."""
    usage: dict[str, Any] = {"prompt_tokens": run.num_prompt_tokens,
                             "completion_tokens": run.num_output_tokens,
                             "total_tokens": run.num_prompt_tokens + run.num_output_tokens,
                             "prompt_tokens_details": {"cached_tokens": run.num_cached_tokens}}
    if run.req.prediction_token_ids is not None:
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": run.num_accepted_prediction_tokens,
            "rejected_prediction_tokens": run.num_rejected_prediction_tokens}
    return usage


def sum_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """Usage objects added field by field (a list of prompts answers one usage)."""
    out: dict[str, Any] = {}
    for u in usages:
        for key, value in u.items():
            if isinstance(value, dict):
                inner = out.setdefault(key, {})
                for k, v in value.items():
                    inner[k] = inner.get(k, 0) + v
            else:
                out[key] = out.get(key, 0) + value
    return out


def _prompt_parts(run: RequestRun, top: int) -> list[TokenLogprobs | None]:
    """The echoed prompt's logprob parts: None for the first token, then the prefill's (their
    top lists cut to ``top``)."""
    parts: list[TokenLogprobs | None] = [None]
    lp = run.prompt_logprobs
    if lp is not None:
        parts.append(TokenLogprobs(token_logprobs=lp.token_logprobs,
                                   top_token_ids=[t[:top] for t in lp.top_token_ids],
                                   top_logprobs=[t[:top] for t in lp.top_logprobs]))
    return parts


def _logprobs_or_none(fmt: ChoiceFormat, texts: TokenTexts, token_ids: list[int],
                      parts: list[TokenLogprobs | None], offset: int = 0) -> dict | None:
    """The choice's (or chunk's) logprobs object, None when not asked. A None part is a token
    without logprobs (the echoed prompt's first)."""
    if not fmt.logprobs:
        return None
    if fmt.chat:
        return chat_logprobs(token_ids, [p for p in parts if p is not None], texts)
    return completion_logprobs(token_ids, parts, texts, offset)


def full_choice(fmt: ChoiceFormat, texts: TokenTexts, run: RequestRun, text: str,
                token_ids: list[int], logprobs: list[TokenLogprobs | None],
                finish_reason: str) -> tuple[dict[str, Any], list[int] | None]:
    """The choice of a non-streamed response (``logprobs``: the output's parts, one per
    delta), and the prompt ids a chat body carries at top level (``return_token_ids``; None
    otherwise)."""
    if fmt.echo_only:
        text, token_ids, logprobs = "", [], []
    if fmt.chat:
        choice: dict[str, Any] = {
            "index": fmt.index, "message": {"role": "assistant", "content": text},
            "logprobs": _logprobs_or_none(fmt, texts, token_ids, logprobs),
            "finish_reason": finish_reason}
        calls = forced_tool_calls(fmt.tools, text, finish_reason)
        if calls is not None:  # a forced tool call (gateway/structured.py)
            choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
            choice["finish_reason"] = "tool_calls"
    else:
        prompt = list(run.req.prompt_token_ids)
        ids = prompt + token_ids if fmt.echo is not None else token_ids
        parts = _prompt_parts(run, fmt.top) + logprobs if fmt.echo is not None else logprobs
        choice = {"index": fmt.index, "text": (fmt.echo or "") + text,
                  "logprobs": _logprobs_or_none(fmt, texts, ids, parts),
                  "finish_reason": finish_reason}
        if fmt.prompt_logprobs is not None:  # vLLM's extension
            choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt, run.prompt_logprobs, texts,
                                                             fmt.prompt_logprobs)
    top_prompt_ids = None
    if fmt.return_token_ids:
        choice["token_ids"] = token_ids
        if fmt.chat:
            top_prompt_ids = list(run.req.prompt_token_ids)
        else:
            choice["prompt_token_ids"] = list(run.req.prompt_token_ids)
    return choice, top_prompt_ids


class ChunkWriter:
    """The stream chunks of one choice, in order (keeps the text offset, whether the prompt
    ids and the echo went out)."""

    def __init__(self, fmt: ChoiceFormat, texts: TokenTexts, run: RequestRun, model: str,
                 created: int, response_id: str | None = None) -> None:
        self.fmt, self.texts, self.run = fmt, texts, run
        self.response_id = response_id or run.request_id
        self.model, self.created = model, created
        self.obj = "chat.completion.chunk" if fmt.chat else "text_completion"
        self._prompt_ids_sent = False
        self._offset = 0  # text_offset of the next token (completions logprobs)

    def chunk(self, text: str | None, finish_reason: str | None, role: bool = False,
              token_ids: tuple[int, ...] | list[int] = (),
              logprobs: list[TokenLogprobs | None] | None = None,
              echo: bool = False) -> dict[str, Any]:
        """One chunk; ``logprobs`` the parts of ``token_ids`` (``echo``: the prompt's tokens,
        which are not output ids)."""
        fmt = self.fmt
        lp = None
        if fmt.logprobs and logprobs is not None and token_ids:
            lp = _logprobs_or_none(fmt, self.texts, list(token_ids), logprobs, self._offset)
            if not fmt.chat:
                self._offset += completion_text_length(token_ids, self.texts)
        if fmt.chat:
            delta = {"role": "assistant", "content": ""} if role else (
                {} if text is None else {"content": text})
            choice: dict[str, Any] = {"index": fmt.index, "delta": delta, "logprobs": lp,
                                      "finish_reason": finish_reason}
        else:
            choice = {"index": fmt.index, "text": text or "", "logprobs": lp,
                      "finish_reason": finish_reason}
        out: dict[str, Any] = {"id": self.response_id, "object": self.obj,
                               "created": self.created, "model": self.model,
                               "choices": [choice]}
        if fmt.include_usage:
            out["usage"] = usage_of(self.run) if fmt.continuous_usage else None
        if fmt.return_token_ids:
            choice["token_ids"] = [] if echo else list(token_ids)
            if not self._prompt_ids_sent:
                self._prompt_ids_sent = True
                (out if fmt.chat else choice)["prompt_token_ids"] = list(
                    self.run.req.prompt_token_ids)
        return out

    def echo_chunk(self) -> dict[str, Any]:
        """The first chunk of an echoed completion: the prompt's text (and logprobs)."""
        prompt = list(self.run.req.prompt_token_ids)
        return self.chunk(self.fmt.echo, None, token_ids=prompt,
                          logprobs=_prompt_parts(self.run, self.fmt.top), echo=True)


async def choice_chunks(writer: ChunkWriter, events: AsyncIterator, first
                        ) -> AsyncIterator[dict[str, Any]]:
    """The chunks of one choice from its run's events (``first`` already taken): a role chunk
    (chat), the echo (completions with echo), one per text delta, the final one with the
    finish reason and spec stats; an error object (``{"error": ...}``) when the run failed
    midway."""
    fmt, run = writer.fmt, writer.run
    if fmt.chat:
        yield writer.chunk(None, None, role=True)
    ev = first
    echoed = fmt.echo is None
    held: list[TextDelta] = []  # a forced tool call goes out as one delta once complete
    while True:
        if not echoed and not (isinstance(ev, Finish) and ev.is_error):
            echoed = True
            yield writer.echo_chunk()
        if isinstance(ev, TextDelta):
            # echo with max_tokens 0 drops the generated token; an empty delta is not sent
            # unless its token ids or logprobs are asked for
            wanted = ev.text or ((fmt.return_token_ids or fmt.logprobs) and ev.token_ids)
            if fmt.tools is not None:
                held.append(ev)
            elif wanted and not fmt.echo_only:
                yield writer.chunk(ev.text, None, token_ids=ev.token_ids, logprobs=[ev.logprobs])
        elif ev.is_error:
            yield error_body(ev.error, "server_error", None, ev.reason)
            return
        else:
            reason = ev.reason
            if fmt.tools is not None:
                text = "".join(d.text for d in held)
                out = writer.chunk(text, None, token_ids=[t for d in held for t in d.token_ids],
                                   logprobs=[d.logprobs for d in held])
                calls = forced_tool_calls(fmt.tools, text, reason)
                if calls is not None:
                    reason = "tool_calls"
                    out["choices"][0]["delta"] = {"tool_calls": [
                        {"index": i, **c} for i, c in enumerate(calls)]}
                yield out
            final = writer.chunk(None, reason)
            final["spec_stats"] = run.stats.as_dict()
            yield final
            return
        ev = await events.__anext__()
