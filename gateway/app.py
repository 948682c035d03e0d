"""The OpenAI-compatible HTTP app: /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics (docs/architecture.md, 'Life of a request' steps 1 and 5), and the drafters' corpora
under /v1/specmesh/ (gateway/corpus_api.py).

Tokenization follows docs/architecture.md, 'Life of a request' step 1:
``tokenizer(prompt)["input_ids"]`` for completions
and ``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` for chat; a
``prediction`` (OpenAI Predicted Outputs) is tokenized without special tokens or template.
The routes build the wire request (gateway/request_build.py) and answer with the run's
response (gateway/responses.py; several prompts or choices: gateway/prompt_batch.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException

from specmesh.gateway.api_errors import GatewayError, bad_request, error_body
from specmesh.gateway.auth import add_api_key
from specmesh.gateway.choices import ChoiceFormat
from specmesh.gateway.corpus_api import add_corpus_routes
from specmesh.gateway.generation import RequestRun
from specmesh.gateway.limits import add_input_bounds, check_stop_bounds
from specmesh.gateway.logprobs import TokenTexts
from specmesh.gateway.lora_admin import add_lora_routes
from specmesh.gateway.lora_models import lora_model_cards
from specmesh.gateway.metrics import GatewayMetrics
from specmesh.gateway.n_choices import MAX_CHOICES, choice_request
from specmesh.gateway.prompt_batch import (
    complete_batch, completion_prompts, prompt_text, stream_batch,
)
from specmesh.gateway.request_build import RequestBuilder, client_request_id
from specmesh.gateway.responses import GatewayResponses
from specmesh.gateway.schemas import ChatCompletionRequest, CompletionRequest
from specmesh.gateway.tokenize_api import add_tokenize_routes
from specmesh.gateway.tokens import chat_prompt_ids, completion_prompt_ids

log = logging.getLogger(__name__)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg', '')}", None
    param = ".".join(loc) or None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


class _Gateway(RequestBuilder, GatewayResponses):
    """State shared by the routes of one app (request building: gateway/request_build.py;
    responses: gateway/responses.py)."""

    def __init__(self, backend, tokenizer, model_name: str, max_model_len: int,
                 default_max_tokens: int, default_temperature: float,
                 metrics: GatewayMetrics, vocab_size: int | None = None,
                 synthetic_acceptance: bool = False) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.default_temperature = default_temperature
        self.metrics = metrics
        self.vocab_size = vocab_size
        self.synthetic_acceptance = synthetic_acceptance
        self.created = int(time.time())
        self.texts = TokenTexts(tokenizer)  # logprobs' token strings (gateway/logprobs.py)
        self._grammars = None  # engine.grammar.GrammarCompiler, built on first use
        self.lora_modules: dict[str, str] = {}  # LoRA adapters: name -> path (lora_models.py)


def create_app(backend, tokenizer, model_name: str, max_model_len: int,
               default_max_tokens: int = 256, metrics_registry: CollectorRegistry | None = None,
               default_temperature: float = 1.0, vocab_size: int | None = None,
               readiness: Callable[[], str] | None = None,
               synthetic_acceptance: bool = False, corpus=None, api_key: str | None = None,
               protect_metrics: bool = False, max_requests_per_client: int = 0,
               lora_modules: dict[str, str] | None = None, lora=None) -> FastAPI:
    """Build the gateway app.

    Args:
        backend: a :class:`gateway.backend.GenerationBackend` (e.g. MailboxBackend).
        tokenizer: the target model's Hugging Face tokenizer.
        model_name: the one model id served (``/v1/models``; a request naming another is 404).
        max_model_len: prompt + output tokens allowed per request.
        default_max_tokens: output limit when the request gives none (clamped to the room left).
        metrics_registry: registry for ``/metrics``; a fresh one per app when None.
        default_temperature: used when a request omits ``temperature`` (OpenAI's default is 1).
        vocab_size: the model's vocabulary (embedding rows, config.json); ``stop_token_ids``
            outside it are refused with 400. None: not checked.
        readiness: why a request cannot be served end to end right now ("" when it can);
            ``/health`` answers 503 with that reason until it is "". None: always ready.
        synthetic_acceptance: the backend's verifiers accept drafts by the synthetic-acceptance
            ablation (the cluster's configuration says so; no message does): every response's
            spec stats and headers and the gateway's metrics flag it.
        corpus: the drafters' corpora and history (a :class:`gateway.corpora.CorpusControl`),
            served under ``/v1/specmesh/`` (gateway/corpus_api.py); None: those endpoints
            answer 501.
        api_key: every route but ``/health`` and ``/metrics`` requires ``Authorization:
            Bearer <api_key>`` (401 otherwise, gateway/auth.py); None: open.
        protect_metrics: with ``api_key``, ``/health`` and ``/metrics`` require it too.
        max_requests_per_client: generation requests one client address may have in flight
            (429 past it; 0: no limit); request bodies are bounded too (gateway/limits.py).
        lora_modules: the LoRA adapters the cluster serves ({name: path}, ``--lora-modules``):
            a request's ``model`` may name one (its GenerateRequest.lora_name), and
            ``/v1/models`` lists each with the base as ``parent`` (vLLM's listing).
        lora: a :class:`gateway.lora_control.LoraControl`: its list is the adapters served
            (``lora_modules`` are added to it), changed at run time by vLLM's
            ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``; None: those answer 501.
    """
    metrics = GatewayMetrics(metrics_registry, backend=backend)
    gw = _Gateway(backend, tokenizer, model_name, max_model_len, default_max_tokens,
                  default_temperature, metrics, vocab_size, synthetic_acceptance)
    if lora is not None:  # one list: what requests may name is what the control changes
        lora.adapters.update(lora_modules or {})
        gw.lora_modules = lora.adapters
    else:
        gw.lora_modules = dict(lora_modules or {})
    app = FastAPI(title="specmesh gateway")
    app.state.gateway = gw
    app.state.metrics = metrics
    add_input_bounds(app, max_model_len, max_requests_per_client)
    add_api_key(app, api_key, protect_metrics, metrics.registry)  # outermost: before bounds

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param, None),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind, None, None),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("gateway: unexpected error")
        return JSONResponse(error_body(f"internal error: {exc}", "server_error", None, None),
                            status_code=500)

    async def _serve(request: Request, body, chat: bool) -> Response:
        arrival = time.perf_counter()
        endpoint = "chat" if chat else "completions"
        try:
            gw.check_model(body)
            body.check_supported()
            check_stop_bounds(body)
            structured = gw.structured(body)  # response_format, guided_*, tools
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{client_request_id(body, request)}"
            echo_only = not chat and body.echo and body.max_tokens == 0
            prompts = [None] if chat else completion_prompts(body.prompt)
            n, best_of = body.choice_counts()  # OpenAI n / best_of (gateway/n_choices.py)
            if len(prompts) * best_of > MAX_CHOICES:
                raise bad_request(f"{len(prompts)} prompts x {best_of} choices is more than "
                                  f"{MAX_CHOICES}", param="n")
            total = len(prompts) * best_of
            runs, fmts, prompt_of = [], [], []
            for i, prompt in enumerate(prompts):
                with metrics.profile.phase("tokenize"):
                    if chat:
                        tools = body.tools if structured.tool_mode else None
                        prompt_ids = chat_prompt_ids(tokenizer, body.template_messages(), tools)
                        limit = body.output_limit()
                    else:
                        prompt_ids = completion_prompt_ids(tokenizer, prompt)
                        # echo with max_tokens 0 (vLLM): one token generated, then dropped
                        limit = 1 if echo_only else body.max_tokens
                    prediction = body.prediction_text()
                    pred_ids = None if prediction is None else gw.prediction_ids(prediction)
                base = gw.build(body, prompt_ids, limit, rid, pred_ids, structured)
                for j in range(best_of):
                    k = i * best_of + j
                    req = choice_request(base, rid if total == 1 else f"{rid}-{k}", j,
                                         f"{rid}/{i}", best_of, want_logprobs=best_of > n)
                    runs.append(RequestRun(backend, tokenizer, req, body.stop_list(), metrics,
                                           request, arrival,
                                           synthetic_acceptance=gw.synthetic_acceptance))
                    prompt_of.append(i)
                    fmts.append(ChoiceFormat(
                        chat=chat, index=k, logprobs=base.sampling.logprobs is not None,
                        top=base.sampling.logprobs or 0,
                        prompt_logprobs=None if chat else body.prompt_logprobs,
                        echo=prompt_text(tokenizer, prompt) if not chat and body.echo else None,
                        echo_only=echo_only, return_token_ids=body.return_token_ids,
                        include_usage=body.include_usage,
                        continuous_usage=body.continuous_usage,
                        tools=structured if structured.tool_mode else None))
            if len(runs) > 1 and body.stream:
                resp = await stream_batch(gw, runs, fmts, rid, prompt_of)
            elif len(runs) > 1:
                resp = await complete_batch(gw, runs, fmts, rid, prompt_of, n)
            elif body.stream:
                resp = await gw.stream(runs[0], fmts[0])
            else:
                resp = await gw.complete(runs[0], fmts[0])
        except GatewayError as err:
            resp = err.response()
        metrics.requests.labels(endpoint=endpoint, status=str(resp.status_code)).inc()
        return resp

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _serve(request, body, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": gw.created, "owned_by": "specmesh",
            "max_model_len": max_model_len}] + lora_model_cards(gw)}

    @app.get("/health")
    async def health():
        reason = readiness() if readiness is not None else ""
        if reason:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint():
        # the gateway's own series and every role's (one scrape for the cluster)
        return Response(await metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    add_corpus_routes(app, corpus, tokenizer, vocab_size)
    add_lora_routes(app, lora, model_name)
    add_tokenize_routes(app, tokenizer, model_name, max_model_len)

    return app
