"""From an HTTP request body to the wire's GenerateRequest (docs/architecture.md, 'Life of a
request' step 1): the model check, the client's request id, the output constraint
(gateway/structured.py), the prediction's token ids, the length checks against
``max_model_len`` and the SamplingParams (OpenAI / vLLM defaults: ``temperature`` the
server's default, ``max_tokens`` the room left up to ``default_max_tokens``). Every bad value
is an HTTP 400 naming the field. A mixin of the app's ``_Gateway`` (gateway/app.py: its
``tokenizer``, ``model_name``, ``max_model_len``, defaults and ``vocab_size``)."""

from __future__ import annotations

import uuid

from fastapi import Request

from specmesh.gateway.api_errors import GatewayError, bad_request
from specmesh.gateway.lora_models import lora_name_of
from specmesh.gateway.penalties import penalty_sampling_fields
from specmesh.gateway.prediction_field import MAX_PREDICTION_CHARS_PER_TOKEN
from specmesh.gateway.schemas import MAX_REQUEST_ID_LEN
from specmesh.gateway.structured import GrammarCompiler, Structured, read_structured
from specmesh.gateway.tokens import prediction_ids
from specmesh.protocol.messages import GenerateRequest, SamplingParams


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


class RequestBuilder:
    """Builds the GenerateRequest of a body (see the module docstring)."""

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
                               prediction_token_ids=prediction_token_ids,
                               lora_name=lora_name_of(self, body))

    def check_model(self, body) -> None:
        if body.model is not None and body.model != self.model_name \
                and body.model not in getattr(self, "lora_modules", {}):
            raise GatewayError(404, f"The model `{body.model}` does not exist.",
                               type="NotFoundError", param="model", code="model_not_found")
