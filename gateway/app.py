"""The OpenAI-compatible HTTP app: /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics (docs/architecture.md, 'Life of a request' steps 1 and 5), and the drafters' corpora
under /v1/specmesh/ (gateway/corpus_api.py).

Tokenization follows docs/architecture.md, 'Life of a request' step 1:
``tokenizer(prompt)["input_ids"]`` for completions
and ``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` for chat; a
``prediction`` (OpenAI Predicted Outputs) is tokenized without special tokens or template.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException

from specmesh.gateway.api_errors import GatewayError, bad_request, error_body
from specmesh.gateway.auth import add_api_key
from specmesh.gateway.choices import (
    ChoiceFormat, ChunkWriter, choice_chunks, full_choice, sse as _sse, sse_response, usage_of,
)
from specmesh.gateway.corpus_api import add_corpus_routes
from specmesh.gateway.generation import Finish, RequestRun, TextDelta, spec_stats_headers
from specmesh.gateway.limits import add_input_bounds, check_stop_bounds
from specmesh.gateway.logprobs import TokenTexts
from specmesh.gateway.prompt_batch import (
    complete_batch, completion_prompts, prompt_text, stream_batch,
)
from specmesh.gateway.tokenize_api import add_tokenize_routes
from specmesh.gateway.metrics import GatewayMetrics
from specmesh.gateway.n_choices import MAX_CHOICES, choice_request
from specmesh.gateway.penalties import penalty_sampling_fields
from specmesh.gateway.prediction_field import MAX_PREDICTION_CHARS_PER_TOKEN
from specmesh.gateway.schemas import MAX_REQUEST_ID_LEN, ChatCompletionRequest, CompletionRequest
from specmesh.gateway.structured import (
    GrammarCompiler, Structured, read_structured,
)
from specmesh.gateway.tokens import chat_prompt_ids, completion_prompt_ids, prediction_ids
from specmesh.protocol.enums import FinishReason
from specmesh.protocol.messages import GenerateRequest, SamplingParams

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


def client_request_id(body, request: Request) -> str:
    """The client's request id (body ``request_id``, else header ``X-Request-Id``, as vLLM),
    else a fresh one. One in flight already is refused later with 409.

    Raises:
        GatewayError: 400 for a header id that is empty, too long or not printable ASCII.
    """
    if body.request_id is not None:
        return body.request_id
    header = request.headers.get("x-request-id")
    if header is None:
        return uuid.uuid4().hex
    if not (0 < len(header) <= MAX_REQUEST_ID_LEN and header.isascii() and header.isprintable()):
        raise bad_request(f"X-Request-Id must be 1-{MAX_REQUEST_ID_LEN} printable ASCII "
                          "characters", param="X-Request-Id")
    return header


class _Gateway:
    """State shared by the routes of one app."""

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

    def structured(self, body) -> Structured:
        """The request's output constraint (gateway/structured.py), compiled with this
        gateway's tokenizer (the compiler is built on the first request that needs it)."""
        fields = body.structured_fields()
        if all(v is None for v in fields.values()):
            return Structured()
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer)
        return read_structured(fields, self._grammars,
                               getattr(self.tokenizer, "chat_template", None))

    # ---------------------------------------------------------------- request -> GenerateRequest

    def prediction_ids(self, text: str) -> list[int]:
        """A prediction's token ids (gateway/tokens.py), at most ``max_model_len`` of them.

        Raises:
            GatewayError: 400 (param ``prediction``) for a prediction longer than that (or,
                before tokenizing it, longer than MAX_PREDICTION_CHARS_PER_TOKEN characters
                per token of it).
        """
        max_chars = MAX_PREDICTION_CHARS_PER_TOKEN * self.max_model_len
        if len(text) > max_chars:
            raise bad_request(f"the prediction has {len(text)} characters, more than this "
                              f"server takes ({max_chars})", param="prediction")
        ids = prediction_ids(self.tokenizer, text)
        if len(ids) > self.max_model_len:
            raise bad_request(f"the prediction has {len(ids)} tokens, more than this model's "
                              f"max_model_len {self.max_model_len}", param="prediction")
        return ids

    def build(self, body, prompt_ids: list[int], max_tokens: int | None,
              request_id: str, prediction_token_ids: list[int] | None = None,
              structured: Structured | None = None) -> GenerateRequest:
        """Validate lengths and build the wire request (``prediction_token_ids``: the
        request's prediction, tokenized; None: none; ``structured``: its output constraint)."""
        n = len(prompt_ids)
        if n == 0:
            raise bad_request("the prompt is empty", param="prompt")
        if n > self.max_model_len - 1:
            raise bad_request(f"the prompt has {n} tokens, more than this model's limit of "
                              f"{self.max_model_len - 1} (max_model_len {self.max_model_len} "
                              "minus one output token)", param="prompt")
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, self.max_model_len - n)
        elif n + max_tokens > self.max_model_len:
            raise bad_request(f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds "
                              f"max_model_len {self.max_model_len}", param="max_tokens")
        stop_ids = list(body.stop_token_ids or [])
        if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in stop_ids):
            raise bad_request(f"stop_token_ids must lie in [0, {self.vocab_size}) (the model's "
                              "vocabulary)", param="stop_token_ids")
        temperature = self.default_temperature if body.temperature is None else body.temperature
        logprobs, prompt_logprobs = body.logprob_counts()
        penalties = penalty_sampling_fields(body, self.tokenizer,
                                            self.vocab_size or len(self.tokenizer), max_tokens)
        sampling = SamplingParams(
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            max_tokens=max_tokens, temperature=float(temperature),
            top_p=1.0 if body.top_p is None else float(body.top_p),
            top_k=max(0, body.top_k or 0), seed=body.seed,
            min_p=0.0 if body.min_p is None else float(body.min_p),
            stop_token_ids=stop_ids, ignore_eos=body.ignore_eos, **penalties,
            grammar=structured.grammar if structured is not None else None)
        return GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                               sampling=sampling,
                               num_speculative_tokens=body.num_speculative_tokens,
                               prediction_token_ids=prediction_token_ids)

    def check_model(self, body) -> None:
        if body.model is not None and body.model != self.model_name:
            raise GatewayError(404, f"The model `{body.model}` does not exist.",
                               type="NotFoundError", param="model", code="model_not_found")

    # ---------------------------------------------------------------- responses

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
                "created": int(time.time()), "model": self.model_name, "choices": [choice],
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
        writer = ChunkWriter(fmt, self.texts, run, self.model_name, created)
        try:
            async for chunk in choice_chunks(writer, events, first):
                t0 = time.perf_counter()
                data = _sse(chunk)
                self.metrics.profile.observe("sse", time.perf_counter() - t0)
                yield data
            if fmt.include_usage and run.finish is not None and not run.finish.is_error:
                yield _sse({"id": run.request_id, "object": writer.obj, "created": created,
                            "model": self.model_name, "choices": [], "usage": usage_of(run),
                            "spec_stats": run.stats.as_dict()})
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()


@dataclass
class Collected:
    """A finished run's output: text parts, output ids, the logprob parts of its deltas (one
    per delta with tokens) and its finish."""

    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish: Finish | None = None



def create_app(backend, tokenizer, model_name: str, max_model_len: int,
               default_max_tokens: int = 256, metrics_registry: CollectorRegistry | None = None,
               default_temperature: float = 1.0, vocab_size: int | None = None,
               readiness: Callable[[], str] | None = None,
               synthetic_acceptance: bool = False, corpus=None, api_key: str | None = None,
               protect_metrics: bool = False, max_requests_per_client: int = 0) -> FastAPI:
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
    """
    metrics = GatewayMetrics(metrics_registry, backend=backend)
    gw = _Gateway(backend, tokenizer, model_name, max_model_len, default_max_tokens,
                  default_temperature, metrics, vocab_size, synthetic_acceptance)
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
            "max_model_len": max_model_len}]}

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
    add_tokenize_routes(app, tokenizer, model_name, max_model_len)

    return app
