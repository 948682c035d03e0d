"""HTTP endpoints of the drafters' corpora and history (docs/drafters.md, 'Corpora'), on the
gateway's app:

- ``POST /v1/specmesh/corpus`` ``{"name", "text" | "token_ids", "timeout"?}``: load a corpus
  (``text`` is tokenized with the model's tokenizer, no special tokens), replacing one of that
  name;
- ``DELETE /v1/specmesh/corpus/{name}``: drop it;
- ``GET /v1/specmesh/corpus``: the corpora, their tokens and each drafter's last answer;
- ``POST /v1/specmesh/drafters/clear_history`` ``{"timeout"?}``: every drafter forgets what
  earlier requests left in its cross-request memory (corpora stay); the bench calls it between
  repeats so that no request is drafted from its own earlier run.

A call waits (at most ``timeout`` seconds, default 60) for every drafter's answer
(gateway/corpora.py). Its answer carries them all: 200 when every drafter applied it; 202 when
some have not answered in time or no verifier is connected yet (a load is kept and sent as
verifiers connect); 400 for bad input or a drafting method that keeps no corpora; 404 for a
drop of a name not loaded; 409 when a newer operation on the name overtook it; 500 when a
drafter or verifier failed it (the message says which and why). Errors have OpenAI's shape,
with the operation's summary beside it.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr

from specmesh.gateway.api_errors import GatewayError, bad_request, error_body
from specmesh.gateway.corpora import DEFAULT_WAIT_S, CorpusControl
from specmesh.protocol.cross_checks import corpus_name_error
from specmesh.protocol.enums import CorpusStatus
from specmesh.protocol.messages import MAX_CORPUS_TOKENS

#: the longest wait a call may ask for, seconds
MAX_WAIT_S = 3600.0
Wait = Annotated[StrictFloat, Field(gt=0, le=MAX_WAIT_S)]


class CorpusBody(BaseModel):
    """``POST /v1/specmesh/corpus``: ``name`` and exactly one of ``text`` / ``token_ids``."""

    model_config = ConfigDict(extra="forbid")
    name: StrictStr
    text: StrictStr | None = None
    token_ids: list[Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]] | None = None
    timeout: Wait | None = None


class WaitBody(BaseModel):
    """``POST /v1/specmesh/drafters/clear_history``: how long to wait for the drafters."""

    model_config = ConfigDict(extra="forbid")
    timeout: Wait | None = None


def corpus_token_ids(tokenizer, text: str) -> list[int]:
    """``text`` tokenized as corpus content: no special tokens (a corpus is a passage, not a
    prompt)."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return [int(t) for t in ids]


def answer(summary: dict, **extra) -> JSONResponse:
    """The HTTP answer of an operation's ``summary`` (module docstring)."""
    body = {"object": "specmesh.corpus_operation", **summary, **extra}
    statuses = {d: r["status"] for d, r in summary["drafters"].items()}
    failed = {d: r["error"] or r["status"] for d, r in summary["drafters"].items()
              if r["status"] == CorpusStatus.ERROR}
    failed.update(summary["verifier_errors"])
    refused = [r["error"] for r in summary["drafters"].values()
               if r["status"] == CorpusStatus.UNSUPPORTED]
    if refused:
        return _error(400, refused[0], "invalid_request_error", body)
    if failed:
        what = "; ".join(f"{who}: {why}" for who, why in sorted(failed.items()))
        return _error(500, f"the operation failed on {what}", "server_error", body)
    if CorpusStatus.SUPERSEDED in statuses.values():
        return _error(409, f"a newer operation on {summary['name']!r} reached the drafters "
                           "first; this one was not applied", "invalid_request_error", body)
    if summary["pending_drafters"] or summary["pending_verifiers"] or not summary["verifiers"]:
        return JSONResponse(body, status_code=202)
    return JSONResponse(body)


def _error(status: int, message: str, kind: str, body: dict) -> JSONResponse:
    return JSONResponse({**error_body(message, kind), "operation": body}, status_code=status)


def add_corpus_routes(app: FastAPI, control: CorpusControl | None, tokenizer,
                      vocab_size: int | None = None) -> None:
    """Add the endpoints to ``app``. ``control`` None: the app has no link to drafters, and
    the endpoints answer 501. ``vocab_size``: token ids at or above it are refused (None:
    the tokenizer's size)."""
    vocab = vocab_size if vocab_size is not None else len(tokenizer)

    def ctl() -> CorpusControl:
        if control is None:
            raise GatewayError(501, "this gateway has no link to drafters", type="server_error")
        return control

    @app.post("/v1/specmesh/corpus")
    async def load_corpus(body: CorpusBody):
        c = ctl()
        why = c.unsupported_reason()
        if why:
            raise bad_request(why)
        why = corpus_name_error(body.name)
        if why:
            raise bad_request(why, param="name")
        if (body.text is None) == (body.token_ids is None):
            raise bad_request("give exactly one of text and token_ids", param="text")
        if body.text is not None:
            ids = await asyncio.get_running_loop().run_in_executor(
                None, corpus_token_ids, tokenizer, body.text)
        else:
            ids = body.token_ids
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise bad_request(f"token id {bad} is out of range [0, {vocab})",
                                  param="token_ids")
        param = "text" if body.text is not None else "token_ids"
        if not ids:
            raise bad_request("the corpus is empty", param=param)
        if len(ids) > MAX_CORPUS_TOKENS:
            raise bad_request(f"the corpus has {len(ids)} tokens, more than the limit of "
                              f"{MAX_CORPUS_TOKENS}", param=param)
        op = c.load(body.name, ids)
        summary = await c.wait(op, body.timeout or DEFAULT_WAIT_S)
        return answer(summary, num_tokens=len(ids))

    @app.delete("/v1/specmesh/corpus/{name}")
    async def drop_corpus(name: str,
                          timeout: Annotated[float, Field(gt=0, le=MAX_WAIT_S)] | None = None):
        c = ctl()
        op = c.drop(name)
        if op is None:
            raise GatewayError(404, f"no corpus named {name!r} is loaded", param="name",
                               code="corpus_not_found")
        return answer(await c.wait(op, timeout or DEFAULT_WAIT_S))

    @app.get("/v1/specmesh/corpus")
    async def list_corpora():
        c = ctl()
        return {"object": "list", "supported": not c.unsupported_reason(),
                "data": c.listing()}

    @app.post("/v1/specmesh/drafters/clear_history")
    async def clear_history(body: WaitBody | None = None):
        c = ctl()
        summary = await c.wait(c.clear_history(),
                               (body.timeout if body else None) or DEFAULT_WAIT_S)
        if not summary["verifiers"]:
            raise GatewayError(503, "no verifier is connected: no drafter to clear",
                               type="server_error")
        return answer(summary)
