"""Request bodies of the OpenAI-compatible endpoints (their errors: gateway/api_errors.py).

Every OpenAI and vLLM request field is in exactly one of three groups (a test iterates the
OpenAI client's own field lists):

- honoured: declared below, typed strictly (no ``"7"`` or ``true`` for a number) and
  range-checked, so nothing reaches the wire that it cannot encode (integers within 64 bits;
  a value out of range is HTTP 400 naming the field): ``model``, ``prompt`` / ``messages``,
  ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k``,
  ``min_p``, ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``stream``,
  ``stream_options``, ``n`` (1 only), ``num_speculative_tokens``, ``request_id``,
  ``return_token_ids`` (vLLM: output ids in each choice's ``token_ids``, prompt ids in
  ``prompt_token_ids``), ``prediction`` (OpenAI Predicted Outputs, gateway/prediction_field.py;
  :data:`PREDICTION_REFUSED` for the fields it cannot be combined with); logprobs (issue
  33): completions ``logprobs`` (0..20) and ``echo`` (``max_tokens: 0`` with it: the prompt
  alone), vLLM's completions ``prompt_logprobs`` (0..20, not streamed), chat ``logprobs`` and
  ``top_logprobs`` (0..20), ``stream_options.continuous_usage_stats``; the penalties and token
  constraints ``frequency_penalty``, ``presence_penalty``, ``logit_bias``,
  ``repetition_penalty``, ``min_tokens``, ``bad_words``, ``allowed_token_ids``
  (gateway/penalties.py); ``n`` and (completions) ``best_of`` (gateway/n_choices.py);
  structured output ``response_format``, ``structured_outputs``, ``guided_json`` /
  ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and (chat) ``tools`` /
  ``tool_choice``, read and checked by gateway/structured.py;
- without effect on the output, accepted and ignored: gateway/refusals.py's
  :data:`NO_OUTPUT_EFFECT` (``user``, ``metadata``, ``store``, ...);
- changing the output and not honoured: :data:`COMMON_REFUSED` plus the endpoint's own
  table, refused with HTTP 400 naming the field unless the value is absent, null or the
  neutral one listed (``length_penalty: 1`` passes, ``0.5`` does not).

Other unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from specmesh.gateway.api_errors import bad_request
from specmesh.gateway.prediction_field import prediction_text
from specmesh.gateway.refusals import (
    CHAT_REFUSED,
    COMMON_REFUSED,
    COMPLETION_REFUSED,
    PREDICTION_REFUSED,
    refuse_unhonoured,
)
from specmesh.protocol.messages import MAX_LOGPROBS


#: longest client-supplied request id (body ``request_id`` or header ``X-Request-Id``)
MAX_REQUEST_ID_LEN = 256
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

#: a count that must fit the wire (msgpack's int64) and be >= 1 / >= 0
PositiveInt64 = Annotated[StrictInt, Field(ge=1, le=INT64_MAX)]
NonNegInt64 = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
#: a finite JSON number (StrictFloat takes integers too, never strings or booleans)
Number = StrictFloat

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False
    # vLLM: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: StrictBool = False


class _CommonRequest(BaseModel):
    """Fields shared by completions and chat completions (module docstring: the groups)."""

    # extra fields are kept (model_extra) so that check_supported can refuse unhonoured ones
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    refused: ClassVar[dict[str, tuple[Any, ...]]] = COMMON_REFUSED

    model: str | None = None
    max_tokens: PositiveInt64 | None = None
    temperature: Number | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Number | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=-1, le=INT64_MAX)  # vLLM; 0 / -1 = off
    min_p: Number | None = Field(default=None, ge=0.0, le=1.0)  # vLLM extension
    seed: StrictInt | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt64] | None = None  # vLLM extension
    ignore_eos: StrictBool = False  # vLLM extension
    num_speculative_tokens: NonNegInt64 | None = None  # specmesh: this request's kappa
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(default=1, ge=INT64_MIN, le=INT64_MAX)
    # vLLM extension: the client's request id (or header X-Request-Id); the response id is
    # ``cmpl-<id>`` / ``chatcmpl-<id>``; one already in flight is refused with HTTP 409
    request_id: str | None = Field(default=None, min_length=1, max_length=MAX_REQUEST_ID_LEN)
    # vLLM extension (>= 0.10.2): the response carries the output token ids (each choice's
    # ``token_ids``; in a stream, the delta's ids per chunk) and the prompt's
    # (``prompt_token_ids``: in the choice for completions, top level for chat; in a stream
    # only in the first chunk)
    return_token_ids: StrictBool = False
    # OpenAI Predicted Outputs: {"type": "content", "content": text or text parts}; checked
    # by prediction_text (clear 400s rather than pydantic's union errors)
    prediction: Any = None
    # penalties and token constraints at every verified position (gateway/penalties.py turns
    # them into SamplingParams; ids against the vocabulary are checked there)
    frequency_penalty: Number | None = Field(default=None, ge=-2.0, le=2.0)  # OpenAI
    presence_penalty: Number | None = Field(default=None, ge=-2.0, le=2.0)  # OpenAI
    logit_bias: dict[str, Annotated[Number, Field(ge=-100.0, le=100.0)]] | None = None
    repetition_penalty: Number | None = Field(default=None, gt=0.0)  # vLLM
    min_tokens: NonNegInt64 | None = None  # vLLM
    bad_words: str | list[str] | None = None  # vLLM
    allowed_token_ids: list[NonNegInt64] | None = None  # vLLM
    # structured output (vLLM / OpenAI), read and checked by gateway/structured.py
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    def structured_fields(self) -> dict[str, Any]:
        """The structured-output and tool fields by name (gateway/structured.py reads them)."""
        names = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                 "guided_choice", "guided_grammar", "tools", "tool_choice")
        out = {n: getattr(self, n, None) for n in names}
        # OpenAI: false = at most one call (NO_OUTPUT_EFFECT otherwise: it only shapes tools)
        out["parallel_tool_calls"] = (self.model_extra or {}).get("parallel_tool_calls")
        return out

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): every
        chunk carries the usage so far."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def prediction_text(self) -> str | None:
        """The text of ``prediction`` (text parts joined), None without one.

        Raises:
            GatewayError: 400 (param ``prediction``) for anything but ``{"type": "content",
                "content": <string or list of text parts>}``.
        """
        return prediction_text(self.prediction)

    def check_prediction(self) -> None:
        """With a ``prediction``: refuse (HTTP 400 naming the field) what OpenAI documents as
        not combinable with it (:data:`PREDICTION_REFUSED`: ``n`` > 1, logprobs, positive
        presence / frequency penalties, tools and functions, audio, modalities other than
        text, ``max_completion_tokens``) and a malformed prediction."""
        if self.prediction is None:
            return
        fields = {**(self.model_extra or {}), "n": self.n,
                  "presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty}
        for name in ("max_completion_tokens", "logprobs", "top_logprobs", "tools"):
            if name in type(self).model_fields:  # else in model_extra
                fields[name] = getattr(self, name)
        for name, refused in PREDICTION_REFUSED.items():
            value = fields.get(name)
            if value is not None and refused(value):
                raise bad_request(f"prediction cannot be combined with {name}"
                                  + (" > 1" if name == "n" else ""), param=name)
        self.prediction_text()

    def choice_counts(self) -> tuple[int, int]:
        """``(n, best_of)``: choices returned per prompt and generated per prompt (``best_of``
        on completions only; else ``n``; gateway/n_choices.py).

        Raises:
            GatewayError: 400 for ``n`` < 1, ``best_of`` < ``n``, or ``best_of`` > ``n`` with
                ``stream`` (OpenAI refuses that too).
        """
        if self.n < 1:
            raise bad_request(f"n must be at least 1, got {self.n}", param="n")
        best_of = getattr(self, "best_of", None)
        if best_of is None:
            return self.n, self.n
        if best_of < self.n:
            raise bad_request(f"best_of ({best_of}) must be at least n ({self.n})",
                              param="best_of")
        if best_of > self.n and self.stream:
            raise bad_request("best_of > n cannot be streamed", param="best_of")
        return self.n, best_of

    def check_supported(self) -> None:
        """Refuse options this gateway does not implement (HTTP 400 naming the field): what
        a ``prediction`` cannot be combined with (:meth:`check_prediction`), ``n != 1`` and
        every field of the endpoint's refused table with a value that would change the
        output."""
        self.check_prediction()
        self.choice_counts()
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              param="stream_options")
        refuse_unhonoured(self.model_extra or {}, self.refused)


class CompletionRequest(_CommonRequest):
    """POST /v1/completions."""

    refused: ClassVar[dict[str, tuple[Any, ...]]] = COMPLETION_REFUSED

    prompt: str | list[int] | list[str] | list[list[int]]
    #: candidates generated per prompt, the best ``n`` returned (OpenAI; gateway/n_choices.py)
    best_of: StrictInt | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    # --- logprobs and echo (issue 33; OpenAI / vLLM semantics, gateway/logprobs.py)
    #: 0 allowed with ``echo`` only: the prompt (and its logprobs) without generated text
    max_tokens: NonNegInt64 | None = None
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    #: vLLM: the prompt's logprobs in the choice's ``prompt_logprobs`` (gateway/logprobs.py)
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(SamplingParams.logprobs, SamplingParams.prompt_logprobs): ``logprobs`` for the
        output, and for the prompt with ``echo`` (vLLM) or ``prompt_logprobs`` (the larger
        k of the two; each is cut to its own when formatted)."""
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs)
                  if k is not None]
        return self.logprobs, max(wanted) if wanted else None

    def check_supported(self) -> None:
        """As the common checks, ``max_tokens: 0`` only with ``echo`` and
        ``prompt_logprobs`` not streamed (vLLM's rules)."""
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be at least 1 (0 only with echo)",
                              param="max_tokens")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs are not available when stream is true",
                              param="prompt_logprobs")


class ChatCompletionRequest(_CommonRequest):
    """POST /v1/chat/completions."""

    refused: ClassVar[dict[str, tuple[Any, ...]]] = CHAT_REFUSED

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: PositiveInt64 | None = None
    # --- logprobs (issue 33; OpenAI semantics, gateway/logprobs.py)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(SamplingParams.logprobs, SamplingParams.prompt_logprobs): ``top_logprobs`` (0
        when absent) with ``logprobs: true``; chat reports no prompt logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def check_supported(self) -> None:
        """As the common checks, and ``top_logprobs`` only with ``logprobs: true`` (OpenAI)."""
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs: true", param="top_logprobs")
    # OpenAI function tools; "required" / a named function are forced by a grammar
    # (gateway/structured.py)
    tools: Any = None
    tool_choice: Any = None

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
