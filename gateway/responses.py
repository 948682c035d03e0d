"""The gateway's answers to a generation request (docs/architecture.md, 'Life of a request'
step 5): a finished run as one JSON object, a streaming one as server-sent events (the chunks:
gateway/choices.py), and a refused or failed one as an OpenAI error with its HTTP status (429
queue full, 400 invalid, 409 duplicate id, else 5xx). A mixin of the app's ``_Gateway``
(gateway/app.py: its ``texts``, ``model_name`` and ``metrics``). A response's ``model`` names the
LoRA adapter its request ran with, else the base model (gateway/lora_models.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse, Response

from specmesh.gateway.api_errors import error_body
from specmesh.gateway.choices import (
    ChoiceFormat, ChunkWriter, choice_chunks, full_choice, sse as _sse, sse_response, usage_of,
)
from specmesh.gateway.generation import Finish, RequestRun, TextDelta, spec_stats_headers
from specmesh.gateway.lora_models import response_model
from specmesh.protocol.enums import FinishReason


@dataclass
class Collected:
    """A finished run's output: text parts, output ids, the logprob parts of its deltas (one
    per delta with tokens) and its finish."""

    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish: Finish | None = None


class GatewayResponses:
    """Turns a run's events into the HTTP response (see the module docstring)."""

    def usage(self, run: RequestRun) -> dict:
        """The OpenAI usage object of ``run`` (gateway/choices.py)."""
        return usage_of(run)

    def error_response(self, finish: Finish) -> JSONResponse:
        kind = {429: "rate_limit_error", 400: "invalid_request_error",
                409: "invalid_request_error"}.get(finish.status, "server_error")
        refused = (FinishReason.QUEUE_FULL, FinishReason.INVALID)
        code = finish.code or (finish.reason if finish.reason in refused else None)
        return JSONResponse(error_body(finish.error, kind, None, code), status_code=finish.status)

    async def collect(self, run: RequestRun) -> Collected:
        """Run ``run`` to its end and gather its text, output ids and logprob parts."""
        got = Collected()
        async for ev in run.events():
            if isinstance(ev, TextDelta):
                got.parts.append(ev.text)
                got.token_ids.extend(ev.token_ids)
                if ev.token_ids:
                    got.logprobs.append(ev.logprobs)
            else:
                got.finish = ev
        return got

    def choice(self, run: RequestRun, fmt: ChoiceFormat, got: Collected
               ) -> tuple[dict, list[int] | None]:
        """The choice of a finished, successful ``run`` (gateway/choices.py)."""
        return full_choice(fmt, self.texts, run, "".join(got.parts), got.token_ids,
                           got.logprobs, got.finish.reason)

    async def complete(self, run: RequestRun, fmt: ChoiceFormat) -> Response:
        """Non-streaming: gather all text, answer one JSON object (``fmt``: echo, logprobs,
        ``return_token_ids``: gateway/choices.py)."""
        got = await self.collect(run)
        if got.finish is None or got.finish.is_error:
            return self.error_response(got.finish or Finish(FinishReason.ERROR, "no result", 500))
        choice, top_prompt_ids = self.choice(run, fmt, got)
        body = {"id": run.request_id,
                "object": "chat.completion" if fmt.chat else "text_completion",
                "created": int(time.time()), "model": response_model(self, run),
                "choices": [choice],
                "usage": usage_of(run), "spec_stats": run.stats.as_dict()}
        if top_prompt_ids is not None:
            body["prompt_token_ids"] = top_prompt_ids
        return JSONResponse(body, headers=spec_stats_headers(run.stats))

    async def stream(self, run: RequestRun, fmt: ChoiceFormat) -> Response:
        """Streaming: wait for the first event (so a 429 / 400 is a real status), then SSE
        (chunks: gateway/choices.py)."""
        events = run.events()
        try:
            first = await events.__anext__()
        except BaseException:
            await events.aclose()
            raise
        if isinstance(first, Finish) and first.is_error:
            await events.aclose()
            return self.error_response(first)
        return sse_response(self._sse_body(run, events, first, fmt))

    async def _sse_body(self, run: RequestRun, events: AsyncIterator, first, fmt: ChoiceFormat
                        ) -> AsyncIterator[str]:
        created = int(time.time())
        writer = ChunkWriter(fmt, self.texts, run, response_model(self, run), created)
        try:
            async for chunk in choice_chunks(writer, events, first):
                t0 = time.perf_counter()
                data = _sse(chunk)
                self.metrics.profile.observe("sse", time.perf_counter() - t0)
                yield data
            if fmt.include_usage and run.finish is not None and not run.finish.is_error:
                yield _sse({"id": run.request_id, "object": writer.obj, "created": created,
                            "model": writer.model, "choices": [], "usage": usage_of(run),
                            "spec_stats": run.stats.as_dict()})
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()
