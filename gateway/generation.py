"""One request's trip through the backend: TokenStreams in, text deltas and a finish out.

:class:`RequestRun` joins the backend stream, the incremental detokenizer, the stop-string
matcher, client-disconnect detection, spec stats and metrics. The HTTP layer only formats the
:class:`TextDelta` / :class:`Finish` events it yields.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from specmesh.gateway.backend import DuplicateRequestId
from specmesh.gateway.detokenize import IncrementalDetokenizer, StopStringMatcher
from specmesh.gateway.metrics import GatewayMetrics
from specmesh.protocol.enums import FinishReason
from specmesh.protocol.messages import GenerateRequest, TokenLogprobs, TokenStream
from specmesh.protocol.spec_stats import SpecStats

log = logging.getLogger(__name__)

#: verifier finish reasons that are errors, with the HTTP status they map to
ERROR_STATUS = {FinishReason.QUEUE_FULL: 429, FinishReason.INVALID: 400,
                FinishReason.ERROR: 500}
DISCONNECT_POLL_S = 0.1


@dataclass(frozen=True)
class TextDelta:
    """New output text, safe to show (complete characters, no partial stop string), and the
    output token ids committed since the previous delta (``token_ids``; the text of some may
    still be held back). Either may be empty, never both. ``logprobs``: one entry per token of
    ``token_ids`` when the request asked for them (SamplingParams.logprobs)."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class Finish:
    """The request ended; ``status`` is the HTTP status of an error finish, else 200;
    ``code`` the OpenAI error code when it is not the reason."""

    reason: str
    error: str = ""
    status: int = 200
    code: str | None = None

    @property
    def is_error(self) -> bool:
        return self.reason in ERROR_STATUS


def update_spec_stats(stats: SpecStats, msg: TokenStream) -> None:
    """Stats in a TokenStream are cumulative: keep the largest seen (a local terminal message
    carries zeros)."""
    stats.num_draft_tokens = max(stats.num_draft_tokens, msg.num_draft_tokens)
    stats.num_accepted_tokens = max(stats.num_accepted_tokens, msg.num_accepted_tokens)
    stats.num_verify_steps = max(stats.num_verify_steps, msg.num_verify_steps)


def spec_stats_headers(stats: SpecStats) -> dict[str, str]:
    """The response headers that repeat a request's spec stats."""
    headers = {"x-specmesh-draft-tokens": str(stats.num_draft_tokens),
               "x-specmesh-accepted-tokens": str(stats.num_accepted_tokens),
               "x-specmesh-mean-accept-len": f"{stats.mean_accept_len:.4f}"}
    if stats.synthetic_acceptance:  # the ablation harness accepted the drafts
        headers["x-specmesh-synthetic-acceptance"] = "1"
    return headers


class RequestRun:
    """Drive one GenerateRequest; iterate :meth:`events` exactly once.

    Args:
        backend: has ``generate(req)`` and ``abort(request_id, reason)``.
        tokenizer: decodes output tokens.
        req: the request to send.
        stops: stop strings (matched on text, never emitted).
        metrics: where TTFT / ITL / token counts go (optional).
        http_request: the Starlette request, polled for a client disconnect (optional).
        arrival: ``time.perf_counter()`` at arrival, for TTFT and e2e latency.
        synthetic_acceptance: the cluster's verifiers accept drafts by a rule that is not
            exact (the synthetic-acceptance ablation, picked by the cluster's configuration):
            the spec stats, headers and metrics of the request say so.
    """

    def __init__(self, backend, tokenizer, req: GenerateRequest, stops: list[str],
                 metrics: GatewayMetrics | None = None, http_request=None,
                 arrival: float | None = None, synthetic_acceptance: bool = False) -> None:
        self.backend = backend
        self.req = req
        self.metrics = metrics
        self.http_request = http_request
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids)
        self.matcher = StopStringMatcher(stops)
        self.stats = SpecStats(synthetic_acceptance=synthetic_acceptance)
        self.num_prompt_tokens = len(req.prompt_token_ids)
        self.num_output_tokens = 0
        #: prediction drafts the verifier accepted / rejected (OpenAI Predicted Outputs)
        self.num_accepted_prediction_tokens = 0
        self.num_rejected_prediction_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens from the prefill's prefix cache
        self.finish: Finish | None = None
        #: the prompt's logprobs (positions 1 .. n-1) when asked (SamplingParams.prompt_logprobs)
        self.prompt_logprobs: TokenLogprobs | None = None
        self.disconnected = False
        self._last_token_time: float | None = None

    @property
    def request_id(self) -> str:
        return self.req.request_id

    def _observe_tokens(self, n: int) -> None:
        now = time.perf_counter()
        if self.metrics is not None:
            if self._last_token_time is None:
                self.metrics.ttft.observe(now - self.arrival)
            else:
                gap = (now - self._last_token_time) / n
                for _ in range(n):
                    self.metrics.itl.observe(gap)
        self._last_token_time = now

    async def _watch_disconnect(self) -> None:
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await self.http_request.is_disconnected():
                self.disconnected = True
                log.info("client of %s disconnected", self.request_id)
                self.backend.abort(self.request_id, "client disconnected")
                return

    def _finish_with(self, msg: TokenStream) -> tuple[str, Finish]:
        """Text left at the end of the stream and the Finish for terminal ``msg``."""
        reason = msg.finish_reason or "stop"
        if reason in ERROR_STATUS:
            return "", Finish(reason, msg.error or reason, ERROR_STATUS[reason])
        tail, stopped = self.matcher.feed(self.detok.flush())
        if stopped:
            return tail, Finish(FinishReason.STOP)
        return tail + self.matcher.flush(), Finish(reason)

    def _feed(self, token_ids: list[int]) -> tuple[str, int, bool]:
        """Detokenize a delta one token at a time, as if each had arrived alone, so a stop
        string ends the output at the token that completes it whatever the delta's size
        (kappa). Returns ``(text to emit, tokens kept, stopped)``."""
        parts: list[str] = []
        for i, tok in enumerate(token_ids):
            text, stopped = self.matcher.feed(self.detok.add([tok]))
            parts.append(text)
            if stopped:
                return "".join(parts), i + 1, True
        return "".join(parts), len(token_ids), False

    def _update_prediction(self, msg: TokenStream) -> None:
        """Prediction counts in a TokenStream are cumulative: keep the largest seen."""
        self.num_accepted_prediction_tokens = max(self.num_accepted_prediction_tokens,
                                                  msg.num_accepted_prediction_tokens)
        self.num_rejected_prediction_tokens = max(self.num_rejected_prediction_tokens,
                                                  msg.num_rejected_prediction_tokens)

    def _cut_prediction(self, before: tuple[int, int], num_kept: int) -> None:
        """A stop string ended the output after ``num_kept`` tokens of the last delta (one
        verify step): its prediction drafts past the cut are not counted. The gateway has
        the step's counts, not which drafts they were: accepted drafts are its first ones and
        drafts lie in position order, so this is exact when the step's drafts all came from
        the prediction (or none did); otherwise accepted and accepted + rejected are upper
        bounds (the verifier, which has the flags, cuts exactly, decode/prediction_usage.py)."""
        acc = self.num_accepted_prediction_tokens - before[0]
        rej = self.num_rejected_prediction_tokens - before[1]
        kept = max(num_kept, 0)
        acc_kept = min(acc, kept)
        rej_kept = min(acc + rej, kept) - acc_kept
        self.num_accepted_prediction_tokens = before[0] + acc_kept
        self.num_rejected_prediction_tokens = before[1] + rej_kept

    def _cut_stats(self, before: SpecStats, num_kept: int) -> None:
        """A stop string ended the output after ``num_kept`` tokens of the last delta: that
        verify step's drafts past the cut are neither drafted nor accepted."""
        s = self.stats
        drafts, accepted = SpecStats.cut_step(s.num_draft_tokens - before.num_draft_tokens,
                                              s.num_accepted_tokens - before.num_accepted_tokens,
                                              num_kept)
        steps = s.num_verify_steps - before.num_verify_steps if drafts else 0
        self.stats = SpecStats(before.num_draft_tokens + drafts,
                               before.num_accepted_tokens + accepted,
                               before.num_verify_steps + steps, s.synthetic_acceptance)

    async def events(self) -> AsyncIterator[TextDelta | Finish]:
        """Yield text deltas, then exactly one :class:`Finish` (unless cancelled).

        A stop string ends the output at the token that completes it: usage
        (``num_output_tokens``), spec stats and metrics count up to there, and the verifier
        is told where with the Abort (``num_output_tokens``)."""
        watcher = None
        if self.http_request is not None:
            watcher = asyncio.create_task(self._watch_disconnect())
        try:
            async with contextlib.aclosing(self.backend.generate(self.req)) as stream:
                try:
                    async for msg in stream:
                        before = SpecStats(self.stats.num_draft_tokens,
                                           self.stats.num_accepted_tokens,
                                           self.stats.num_verify_steps,
                                           self.stats.synthetic_acceptance)
                        update_spec_stats(self.stats, msg)
                        prediction_before = (self.num_accepted_prediction_tokens,
                                             self.num_rejected_prediction_tokens)
                        self._update_prediction(msg)
                        self.num_cached_tokens = max(self.num_cached_tokens,
                                                     msg.num_cached_tokens)
                        if msg.prompt_logprobs is not None:
                            self.prompt_logprobs = msg.prompt_logprobs
                        if msg.token_ids:
                            t0 = time.perf_counter()
                            text, kept, stopped = self._feed(msg.token_ids)
                            if self.metrics is not None:
                                self.metrics.profile.observe("detokenize",
                                                             time.perf_counter() - t0)
                            self.num_output_tokens += kept
                            self._observe_tokens(kept)
                            if text or kept:
                                lp = None if msg.logprobs is None else msg.logprobs.slice(0, kept)
                                yield TextDelta(text, tuple(msg.token_ids[:kept]), lp)
                            if stopped:
                                self._cut_stats(before, kept)
                                self._cut_prediction(prediction_before, kept)
                                self.finish = Finish(FinishReason.STOP)
                                self.backend.abort(self.request_id, "stop string",
                                                   num_output_tokens=self.num_output_tokens)
                                break
                        if msg.finished:
                            text, self.finish = self._finish_with(msg)
                            if text:
                                yield TextDelta(text)
                            break
                except DuplicateRequestId as err:  # nothing was sent: leave the other one be
                    self.finish = Finish(FinishReason.INVALID, str(err), 409,
                                         "duplicate_request_id")
                finally:
                    if self.finish is None:  # cancelled: the client went away
                        self.backend.abort(self.request_id, "client disconnected")
            if self.finish is None:
                self.finish = Finish(FinishReason.ERROR,
                                     "backend stream ended without a finish", 500)
            yield self.finish
        finally:
            if watcher is not None:
                watcher.cancel()
            self._account()

    def _account(self) -> None:
        if self.metrics is None:
            return
        reason = self.finish.reason if self.finish is not None else "abort"
        if reason == FinishReason.QUEUE_FULL:
            self.metrics.queue_full.inc()
            return
        if reason == FinishReason.INVALID:
            return
        s = self.stats
        self.metrics.observe_finished(reason, self.num_prompt_tokens, self.num_output_tokens,
                                      s.num_verify_steps, s.num_draft_tokens,
                                      s.num_accepted_tokens, time.perf_counter() - self.arrival,
                                      synthetic_acceptance=s.synthetic_acceptance,
                                      lora_name=self.req.lora_name)
