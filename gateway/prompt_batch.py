"""Requests that fan out to several choices (issue 33, item 2): a completions request with a
list of prompts (one choice per prompt), and ``n`` / ``best_of`` choices of each prompt
(gateway/n_choices.py), on completions and chat.

``prompt`` may be a string, a list of token ids, a list of strings or a list of token-id
lists (OpenAI). Each choice is served as a request of its own (request id
``<response id>-<k>``), all concurrently, and the response has one choice per prompt and ``n``
with ``index`` = ``prompt * n + choice`` (vLLM), ``usage`` summed (each prompt's tokens once)
and ``spec_stats`` summed. A stream interleaves the choices' chunks as they come, each chunk
naming its choice by ``index``; every chunk carries the response id. A choice refused by the
verifier (queue full, invalid) or failing fails the whole request, as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response

from specmesh.gateway.api_errors import bad_request
from specmesh.gateway.choices import (
    ChoiceFormat, ChunkWriter, choice_chunks, sse, sse_response, sum_usage, usage_of,
)
from specmesh.gateway.generation import Finish, RequestRun, spec_stats_headers
from specmesh.gateway.lora_models import response_model
from specmesh.gateway.n_choices import best_indices, mean_logprob
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


def batch_usage(runs: list[RequestRun], prompt_of: list[int]) -> dict:
    """The response's usage: every run's completion tokens, each prompt's tokens once (the
    ``n`` choices of a prompt share it, as OpenAI counts)."""
    seen: set[int] = set()
    usages = []
    for run, p in zip(runs, prompt_of):
        u = usage_of(run)
        if p in seen:
            u["total_tokens"] -= u["prompt_tokens"]
            u["prompt_tokens"] = 0
            u["prompt_tokens_details"] = {"cached_tokens": 0}
        seen.add(p)
        usages.append(u)
    return sum_usage(usages)


def _ranked(gw, runs, fmts, got, prompt_of: list[int], n: int):
    """(run, format, collected) of the choices to return: all of them, or with ``best_of``
    the ``n`` of each prompt with the highest log probability per token (gateway/n_choices.py),
    re-indexed ``prompt * n + rank``."""
    by_prompt: dict[int, list[int]] = {}
    for k, p in enumerate(prompt_of):
        by_prompt.setdefault(p, []).append(k)
    out = []
    for p, ks in by_prompt.items():
        if len(ks) > n:
            scores = [mean_logprob([x for part in got[k].logprobs if part is not None
                                    for x in part.token_logprobs]) for k in ks]
            ks = [ks[i] for i in best_indices(scores, n)]
            out.extend((runs[k], replace(fmts[k], index=p * n + rank), got[k])
                       for rank, k in enumerate(ks))
        else:
            out.extend((runs[k], fmts[k], got[k]) for k in ks)
    return out


async def complete_batch(gw, runs: list[RequestRun], fmts: list[ChoiceFormat],
                         response_id: str, prompt_of: list[int] | None = None,
                         n: int | None = None) -> Response:
    """Non-streaming: every choice in one body (``gw``: the app's _Gateway). ``prompt_of``:
    each run's prompt index (default: one run per prompt); ``n``: the choices returned per
    prompt (fewer than its runs: ``best_of``, the best ``n`` by log probability per token)."""
    prompt_of = prompt_of if prompt_of is not None else list(range(len(runs)))
    got = await asyncio.gather(*(gw.collect(r) for r in runs))
    for g in got:
        if g.finish is None or g.finish.is_error:
            return gw.error_response(g.finish or Finish("error", "no result", 500))
    chosen = _ranked(gw, runs, fmts, got, prompt_of, n or len(runs))
    choices = [gw.choice(r, f, g)[0] for r, f, g in chosen]
    stats = summed_stats(runs)
    chat = fmts[0].chat
    body = {"id": response_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": response_model(gw, runs[0]),
            "choices": choices,
            "usage": batch_usage(runs, prompt_of), "spec_stats": stats.as_dict()}
    if chat and fmts[0].return_token_ids:
        body["prompt_token_ids"] = list(runs[0].req.prompt_token_ids)
    return JSONResponse(body, headers=spec_stats_headers(stats))


async def stream_batch(gw, runs: list[RequestRun], fmts: list[ChoiceFormat],
                       response_id: str, prompt_of: list[int] | None = None) -> Response:
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
    prompt_of = prompt_of if prompt_of is not None else list(range(len(runs)))
    return sse_response(_merged(gw, runs, fmts, streams, firsts, response_id, prompt_of))


async def _close(streams: list[AsyncIterator]) -> None:
    for events in streams:
        await events.aclose()


async def _merged(gw, runs, fmts, streams, firsts, response_id: str,
                  prompt_of: list[int]) -> AsyncIterator[str]:
    created = int(time.time())
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(run, fmt, events, first) -> None:
        writer = ChunkWriter(fmt, gw.texts, run, response_model(gw, run), created,
                             response_id)
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
            obj = "chat.completion.chunk" if fmts[0].chat else "text_completion"
            yield sse({"id": response_id, "object": obj, "created": created,
                        "model": response_model(gw, runs[0]), "choices": [],
                        "usage": batch_usage(runs, prompt_of),
                        "spec_stats": summed_stats(runs).as_dict()})
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        await _close(streams)
