"""A completions request with a list of prompts (issue 33, item 2): one choice per prompt.

``prompt`` may be a string, a list of token ids, a list of strings or a list of token-id
lists (OpenAI). Each prompt is served as a request of its own (request id
``<response id>-<i>``), all concurrently, and the response has one choice per prompt with
``index`` = the prompt's index (vLLM, for n = 1), ``usage`` and ``spec_stats`` summed over the
prompts. A stream interleaves the prompts' chunks as they come, each chunk naming its choice
by ``index``; every chunk carries the response id. A prompt refused by the verifier (queue
full, invalid) or failing fails the whole request, as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response

from specmesh.gateway.choices import (
    ChoiceFormat, ChunkWriter, choice_chunks, sse, sse_response, sum_usage, usage_of,
)
from specmesh.gateway.generation import Finish, RequestRun, spec_stats_headers
from specmesh.gateway.schemas import bad_request
from specmesh.protocol.spec_stats import SpecStats

#: most prompts one request may list (each is a request of its own on the verifiers)
MAX_PROMPTS = 1024


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completions ``prompt`` field: one string or id list, or a list of them.

    Raises:
        GatewayError: 400 (param ``prompt``) for an empty list or more than MAX_PROMPTS.
    """
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}",
                          param="prompt")
    return list(prompt)


def prompt_text(tokenizer, prompt: str | list[int]) -> str:
    """The text ``echo`` puts first: the prompt string, or the decoded token ids."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)


def summed_stats(runs: list[RequestRun]) -> SpecStats:
    """The spec stats of all ``runs`` added (the response's)."""
    total = SpecStats(synthetic_acceptance=any(r.stats.synthetic_acceptance for r in runs))
    for r in runs:
        total.add(r.stats)
    return total


async def complete_batch(gw, runs: list[RequestRun], fmts: list[ChoiceFormat],
                         response_id: str) -> Response:
    """Non-streaming: every prompt's choice in one body (``gw``: the app's _Gateway)."""
    got = await asyncio.gather(*(gw.collect(r) for r in runs))
    for g in got:
        if g.finish is None or g.finish.is_error:
            return gw.error_response(g.finish or Finish("error", "no result", 500))
    choices = [gw.choice(r, f, g)[0] for r, f, g in zip(runs, fmts, got)]
    stats = summed_stats(runs)
    body = {"id": response_id, "object": "text_completion", "created": int(time.time()),
            "model": gw.model_name, "choices": choices,
            "usage": sum_usage([usage_of(r) for r in runs]), "spec_stats": stats.as_dict()}
    return JSONResponse(body, headers=spec_stats_headers(stats))


async def stream_batch(gw, runs: list[RequestRun], fmts: list[ChoiceFormat],
                       response_id: str) -> Response:
    """Streaming: the prompts' chunks interleaved (each names its choice by ``index``)."""
    streams = [r.events() for r in runs]
    firsts = []
    try:
        for events in streams:
            firsts.append(await events.__anext__())
    except BaseException:
        await _close(streams)
        raise
    for first in firsts:
        if isinstance(first, Finish) and first.is_error:
            await _close(streams)
            return gw.error_response(first)
    return sse_response(_merged(gw, runs, fmts, streams, firsts, response_id))


async def _close(streams: list[AsyncIterator]) -> None:
    for events in streams:
        await events.aclose()


async def _merged(gw, runs, fmts, streams, firsts, response_id: str) -> AsyncIterator[str]:
    created = int(time.time())
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(run, fmt, events, first) -> None:
        writer = ChunkWriter(fmt, gw.texts, run, gw.model_name, created, response_id)
        try:
            async for chunk in choice_chunks(writer, events, first):
                await queue.put(chunk)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(r, f, e, x))
             for r, f, e, x in zip(runs, fmts, streams, firsts)]
    try:
        left = len(tasks)
        failed = False
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
                continue
            if "error" in item:  # one prompt failed midway: the request ends here
                yield sse(item)
                failed = True
                break
            yield sse(item)
        if not failed and fmts[0].include_usage:
            yield sse({"id": response_id, "object": "text_completion", "created": created,
                        "model": gw.model_name, "choices": [],
                        "usage": sum_usage([usage_of(r) for r in runs]),
                        "spec_stats": summed_stats(runs).as_dict()})
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        await _close(streams)
