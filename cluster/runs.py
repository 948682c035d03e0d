"""Running prompts through a served cluster with the official ``openai`` client, shared by
``specmesh demo`` and ``specmesh bench``: the bundled prompts, one pass's totals, and a pass
by several concurrent clients, streamed (SSE) or not, optionally with each prompt's
``prediction`` sent as OpenAI's Predicted Outputs and the accepted / rejected prediction tokens
of its usage recorded; and the gateway call that clears the drafters' cross-request memory.

A streamed request records its latency (:class:`RequestLatency`): the time to its first
content chunk (TTFT) and its mean inter-token latency, (last content chunk - first) / (tokens
- 1). Per-chunk gaps are not per-token gaps: a specmesh chunk carries every token one verify
step committed (the accepted drafts and the bonus token), so the per-request mean is the one
measure that means the same for every server (vLLM's benchmark calls it TPOT)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources

from specmesh.protocol.spec_stats import SpecStats

#: Client timeout for one request, seconds (a long prompt on a busy 2-core machine).
CLIENT_TIMEOUT_S = 600


def load_prompts(limit: int | None = None) -> list[dict]:
    """The bundled prompts: [{name, category, messages}]."""
    text = resources.files("specmesh.data").joinpath("demo_prompts.json").read_text()
    prompts = json.loads(text)
    return prompts[:limit] if limit else prompts


@dataclass(frozen=True)
class RequestLatency:
    """One streamed request's timings, seconds from sending it: ``ttft_s`` to its first chunk
    with content (text or token ids), ``last_token_s`` to its last such chunk;
    ``num_tokens`` its completion tokens."""

    ttft_s: float
    last_token_s: float
    num_tokens: int

    @property
    def itl_s(self) -> float | None:
        """Mean inter-token latency, seconds: (last_token_s - ttft_s) / (num_tokens - 1);
        None with fewer than two tokens."""
        if self.num_tokens < 2:
            return None
        return (self.last_token_s - self.ttft_s) / (self.num_tokens - 1)

    def as_dict(self) -> dict:
        return {"ttft_s": self.ttft_s, "last_token_s": self.last_token_s,
                "num_tokens": self.num_tokens, "itl_s": self.itl_s}


@dataclass(frozen=True)
class PredictionTokens:
    """A response's Predicted Outputs counts (OpenAI's ``usage.completion_tokens_details``):
    ``accepted`` prediction tokens that appear in the completion, ``rejected`` those that do
    not."""

    accepted: int = 0
    rejected: int = 0

    def __add__(self, other: PredictionTokens) -> PredictionTokens:
        return PredictionTokens(self.accepted + other.accepted, self.rejected + other.rejected)

    def as_dict(self) -> dict:
        return {"accepted": self.accepted, "rejected": self.rejected}


def _get(obj, name: str):  # noqa: ANN001, ANN202
    """Field ``name`` of a response object (a declared attribute or one the client kept in
    ``model_extra``) or of a dict; None when absent."""
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    value = getattr(obj, name, None)
    return value if value is not None else (getattr(obj, "model_extra", None) or {}).get(name)


def prediction_tokens_of(usage) -> PredictionTokens | None:  # noqa: ANN001
    """The accepted / rejected prediction tokens of a response's ``usage`` (an ``openai``
    usage object or a dict); None when the server reported neither (no prediction sent, or
    a server without Predicted Outputs)."""
    details = _get(usage, "completion_tokens_details")
    accepted = _get(details, "accepted_prediction_tokens")
    rejected = _get(details, "rejected_prediction_tokens")
    if accepted is None and rejected is None:
        return None
    return PredictionTokens(int(accepted or 0), int(rejected or 0))


def prediction_body(prompt: dict) -> dict:
    """The request fields that send ``prompt``'s ``prediction`` (OpenAI's Predicted Outputs,
    ``{"prediction": {"type": "content", "content": text}}``); ``{}`` when it has none. Sent
    in ``extra_body``: the ``openai`` versions this project accepts (>= 1.30) include some
    without the ``prediction`` parameter."""
    text = prompt.get("prediction")
    return {"prediction": {"type": "content", "content": text}} if text else {}


@dataclass
class RunResult:
    """One pass over the prompts by one system: completion tokens, seconds (wall time of the
    pass), texts and spec stats. ``token_ids`` holds each completion's ids when the system
    exposes them (in-process, HF, and the gateway with vLLM's ``return_token_ids``; None for a
    system that does not); ``accepted_per_pos[i]`` counts accepted drafts at
    draft position i; ``profile`` is the verifier's step profile over the pass
    (:meth:`protocol.step_profile.StepProfile.as_dict`); ``concurrency`` is the number of
    concurrent clients (or the batch size); ``latencies`` one :class:`RequestLatency` per
    request, in prompt order, when the requests were streamed (empty otherwise).

    Per request, in prompt order (empty where the system does not expose it):
    ``request_seconds`` from sending it (or the start of its batch) to its last token;
    ``request_spec`` its spec stats; ``request_prediction`` its :class:`PredictionTokens`
    (None for a request whose response reported none)."""

    system: str
    seconds: float = 0.0
    num_tokens: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    texts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] | None = None
    accepted_per_pos: list[int] = field(default_factory=list)
    profile: dict | None = None
    concurrency: int = 1
    latencies: list[RequestLatency] = field(default_factory=list)
    request_seconds: list[float] = field(default_factory=list)
    request_spec: list[SpecStats] = field(default_factory=list)
    request_prediction: list[PredictionTokens | None] = field(default_factory=list)
    #: the drafters' cross-request memory cleared before the pass: True, False (the server
    #: cannot: HTTP 404), None (not asked: a system without such memory or control)
    history_cleared: bool | None = None
    #: the verifier's kappa sampled through the pass (the bench's adaptive-speculation
    #: sweep): ``[{"t": s since the pass began, "kappa", "drafts_per_step"}, ...]``
    kappa_timeline: list[dict] | None = None

    @property
    def request_tokens(self) -> list[int] | None:
        """Completion tokens per request, prompt order: the streamed requests' counts, else
        the lengths of ``token_ids``; None when the run has neither."""
        if self.latencies:
            return [lat.num_tokens for lat in self.latencies]
        return None if self.token_ids is None else [len(t) for t in self.token_ids]

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {"system": self.system, "seconds": self.seconds, "num_tokens": self.num_tokens,
                "tokens_per_s": self.tokens_per_s, "spec_stats": self.spec.as_dict(),
                "texts": self.texts, "token_ids": self.token_ids,
                "accepted_per_pos": self.accepted_per_pos, "profile": self.profile,
                "concurrency": self.concurrency,
                "latencies": [lat.as_dict() for lat in self.latencies],
                "request_seconds": self.request_seconds,
                "request_spec": [s.as_dict() for s in self.request_spec],
                "request_prediction": [None if p is None else p.as_dict()
                                       for p in self.request_prediction],
                "history_cleared": self.history_cleared}


def openai_client(url: str, api_key: str | None = None):
    """An ``openai.OpenAI`` client for the gateway at ``url`` (no retries), sending
    ``api_key`` (the cluster's ``--api-key``; None: a placeholder, the server has none)."""
    from openai import OpenAI  # openai: slow to import, only the drivers' HTTP runs

    return OpenAI(base_url=f"{url}/v1", api_key=api_key or "specmesh",
                  timeout=CLIENT_TIMEOUT_S, max_retries=0)


#: The gateway's endpoint that empties its drafters' cross-request memory (a drafter's global
#: history of earlier outputs), so the next requests are drafted as if the earlier ones had
#: not been served.
CLEAR_HISTORY_PATH = "/v1/specmesh/drafters/clear_history"


def clear_drafter_history(url: str, timeout_s: float = CLIENT_TIMEOUT_S,
                          api_key: str | None = None) -> bool:
    """``POST {url}`` :data:`CLEAR_HISTORY_PATH` on the gateway at ``url`` (an empty JSON
    body, proxies bypassed: the gateway is local). True when it answered 2xx (cleared);
    False when it answered 404 (a server without the endpoint: nothing was cleared, which the
    caller must say). ``api_key``: sent as ``Authorization: Bearer`` (the cluster's
    ``--api-key``; None: none sent).

    Raises:
        RuntimeError: any other status, or no answer (naming the URL and the reason).
    """
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url.rstrip("/") + CLEAR_HISTORY_PATH, data=b"{}",
                                 headers=headers, method="POST")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout_s) as resp:
            resp.read()
        return True
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return False
        detail = e.read().decode("utf-8", "replace")[:300]
        raise RuntimeError(f"{req.full_url}: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise RuntimeError(f"{req.full_url}: no answer ({reason})") from None


#: vLLM's request extension: the response carries the output token ids (choice ``token_ids``)
RETURN_TOKEN_IDS = {"return_token_ids": True}


def _token_ids(resp) -> list[int] | None:
    """A chat completion's output token ids (None when the server did not return them)."""
    ids = (resp.choices[0].model_extra or {}).get("token_ids")
    return None if ids is None else [int(t) for t in ids]


def spec_stats_of(extra: dict) -> SpecStats:
    """The spec stats a specmesh response carries (``spec_stats``, beside the OpenAI fields;
    zeros when absent). ``extra``: the response's fields that are not OpenAI's."""
    stats = extra.get("spec_stats") or {}
    return SpecStats(stats.get("num_draft_tokens", 0), stats.get("num_accepted_tokens", 0),
                     stats.get("num_verify_steps", 0))


def _spec_stats(resp) -> SpecStats:
    return spec_stats_of(resp.model_extra or {})


@dataclass
class StreamedChat:
    """What one streamed chat completion returned: the text, the output token ids (None when
    the server sent none), completion tokens (the usage chunk's, else the ids', else one per
    content chunk), the non-OpenAI fields of its chunks (later chunks overriding earlier
    ones: ``spec_stats``, llama.cpp's ``timings``), its :class:`RequestLatency` and the
    usage chunk's :class:`PredictionTokens` (None when it reported none)."""

    text: str
    token_ids: list[int] | None
    num_tokens: int
    extra: dict
    latency: RequestLatency
    prediction: PredictionTokens | None = None


def stream_chat(client, model: str, messages: list[dict], max_tokens: int,
                extra_body: dict | None = None,
                clock: Callable[[], float] = time.perf_counter) -> StreamedChat:
    """One greedy chat completion streamed over SSE (``stream_options.include_usage``). The
    clock is read once before sending and once per chunk that carries content (text or token
    ids); the first such reading gives the TTFT, the last the time of the last token (a
    stream without content, an EOS the server did not send as text, takes its end for both).

    Raises:
        openai.OpenAIError: the request failed.
    """
    parts: list[str] = []
    ids: list[int] | None = None
    extra: dict = {}
    usage_tokens = None
    prediction = None
    first = last = None
    num_chunks = 0
    t0 = clock()
    with client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra_body) as stream:
        for chunk in stream:
            extra.update(chunk.model_extra or {})
            if chunk.usage is not None:
                usage_tokens = chunk.usage.completion_tokens
                prediction = prediction_tokens_of(chunk.usage)
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            piece = (choice.delta.content or "") if choice.delta is not None else ""
            chunk_ids = (choice.model_extra or {}).get("token_ids")
            if chunk_ids is not None:
                ids = (ids or []) + [int(t) for t in chunk_ids]
            if piece or chunk_ids:
                last = clock()
                first = last if first is None else first
                num_chunks += 1
                parts.append(piece)
    if first is None or last is None:  # nothing but an end (an EOS the server did not send)
        first = last = clock()
    n = usage_tokens if usage_tokens is not None else (len(ids) if ids is not None
                                                        else num_chunks)
    return StreamedChat("".join(parts), ids, n, extra,
                        RequestLatency(first - t0, last - t0, n), prediction)


def run_openai_concurrent(client, model: str, prompts: list[dict], max_tokens: int,
                          system: str, concurrency: int, stream: bool = False,
                          extra_body: dict | None = RETURN_TOKEN_IDS,
                          spec_stats: Callable[[dict], SpecStats] = spec_stats_of,
                          clock: Callable[[], float] = time.perf_counter,
                          predictions: bool = False) -> RunResult:
    """Send ``prompts`` to an OpenAI-compatible server (the gateway, llama.cpp's
    ``llama-server``) from ``concurrency`` client threads sharing one ``openai`` client
    (each thread takes the next prompt when its previous one finished); greedy.
    ``seconds`` is the wall time from the first request to the last completion; ``texts``
    are in prompt order. ``stream``: each request over SSE (:func:`stream_chat`), its
    :class:`RequestLatency` in ``latencies``. ``extra_body``: the non-OpenAI request fields
    (vLLM's ``return_token_ids`` by default); ``spec_stats``: a response's spec stats from
    its non-OpenAI fields; ``predictions``: each prompt's ``prediction`` is sent
    (:func:`prediction_body`); a prompt's ``model``, when it has one, is the model its request
    names (a LoRA adapter: the bench's mixed-adapter load), else ``model``. Per request: its
    seconds to its last token (streamed: to its last content chunk), spec stats and
    prediction tokens (``request_*``).

    Raises:
        openai.OpenAIError: a request failed (the other threads finish first).
        KeyboardInterrupt: at once, the requests not yet sent cancelled and those in flight
            left to their threads (the caller stops the server).
    """
    res = RunResult(system, concurrency=concurrency)
    texts: list[str] = [""] * len(prompts)
    ids: list[list[int] | None] = [None] * len(prompts)
    latencies: list[RequestLatency | None] = [None] * len(prompts)
    seconds: list[float] = [0.0] * len(prompts)
    specs: list[SpecStats] = [SpecStats() for _ in prompts]
    predicted: list[PredictionTokens | None] = [None] * len(prompts)
    lock = threading.Lock()

    def one(i: int) -> None:
        body = {**(extra_body or {}), **(prediction_body(prompts[i]) if predictions else {})}
        name = prompts[i].get("model") or model  # a LoRA adapter of a mixed-adapter load
        if stream:
            out = stream_chat(client, name, prompts[i]["messages"], max_tokens, body or None,
                              clock)
            with lock:
                res.num_tokens += out.num_tokens
                specs[i] = spec_stats(out.extra)
                texts[i], ids[i], latencies[i] = out.text, out.token_ids, out.latency
                seconds[i], predicted[i] = out.latency.last_token_s, out.prediction
            return
        t0 = clock()
        resp = client.chat.completions.create(model=name, messages=prompts[i]["messages"],
                                              max_tokens=max_tokens, temperature=0,
                                              extra_body=body or None)
        took = clock() - t0
        with lock:
            res.num_tokens += resp.usage.completion_tokens
            specs[i] = spec_stats(resp.model_extra or {})
            texts[i] = resp.choices[0].message.content or ""
            ids[i] = _token_ids(resp)
            seconds[i], predicted[i] = took, prediction_tokens_of(resp.usage)

    t0 = clock()
    pool = ThreadPoolExecutor(max_workers=max(1, concurrency))
    interrupted = False
    try:
        futures = [pool.submit(one, i) for i in range(len(prompts))]
        for f in futures:
            f.result()
    except KeyboardInterrupt:  # Ctrl-C: no new requests, no wait for those in flight
        interrupted = True
        raise
    finally:
        pool.shutdown(wait=not interrupted, cancel_futures=interrupted)
    res.seconds = clock() - t0
    res.texts = texts
    res.token_ids = None if None in ids else ids
    res.latencies = [lat for lat in latencies if lat is not None]
    res.request_seconds, res.request_spec, res.request_prediction = seconds, specs, predicted
    for s in specs:
        res.spec.add(s)
    return res


def run_openai(client, model: str, prompts: list[dict], max_tokens: int, system: str,
               show: bool = False) -> RunResult:
    """Send each prompt (one at a time) through the gateway; greedy."""
    res = RunResult(system)
    ids: list[list[int] | None] = []
    for p in prompts:
        t0 = time.perf_counter()
        resp = client.chat.completions.create(model=model, messages=p["messages"],
                                              max_tokens=max_tokens, temperature=0,
                                              extra_body=RETURN_TOKEN_IDS)
        res.seconds += time.perf_counter() - t0
        res.num_tokens += resp.usage.completion_tokens
        one = _spec_stats(resp)
        res.spec.add(one)
        text = resp.choices[0].message.content or ""
        res.texts.append(text)
        ids.append(_token_ids(resp))
        if show:
            print(f"\n### {p['name']} ({p['category']})\n{text}\n"
                  f"[{resp.usage.completion_tokens} tokens, drafted {one.num_draft_tokens}, "
                  f"accepted {one.num_accepted_tokens}, mean accept length "
                  f"{one.mean_accept_len:.2f}]", flush=True)
    res.token_ids = None if None in ids else ids
    return res


def same_outputs(a: RunResult, b: RunResult) -> list[bool]:
    """Per request: identical output? Token ids when both runs have them, else texts."""
    if a.token_ids is not None and b.token_ids is not None:
        return [x == y for x, y in zip(a.token_ids, b.token_ids)]
    return [x == y for x, y in zip(a.texts, b.texts)]
