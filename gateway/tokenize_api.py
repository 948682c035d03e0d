"""vLLM's tokenizer endpoints and ``/version`` on the gateway's app (issue 33, item 5), so
clients that probe them (lm-evaluation-harness, guidellm) run unchanged:

- ``POST /tokenize`` ``{"prompt", "add_special_tokens"?: true, "return_token_strs"?: false}``
  or ``{"messages", "add_generation_prompt"?: true, "add_special_tokens"?: false, ...}``:
  ``{"count", "max_model_len", "tokens", "token_strs"}``. A prompt is tokenized as
  ``/v1/completions`` tokenizes it (with special tokens unless told not to), messages as
  ``/v1/chat/completions`` does (the chat template, without the tokenizer's special tokens:
  the template writes them), so ``count`` is what a request would send;
- ``POST /detokenize`` ``{"tokens": [ids]}``: ``{"prompt": text}`` (ids outside the
  vocabulary are 400);
- ``GET /tokenizer_info``: ``{"tokenizer_class", ...}`` with the tokenizer's configuration
  (tokenizer_config.json's JSON-serializable fields and the chat template), as vLLM answers;
- ``GET /version``: ``{"version": specmesh's}``.

Bad input is HTTP 400 in OpenAI's error shape naming the field; a ``model`` other than the
served one is 404, as on the completions endpoints.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from specmesh import __version__
from specmesh.gateway.api_errors import GatewayError, bad_request
from specmesh.gateway.schemas import ChatCompletionRequest
from specmesh.gateway.tokens import template_ids, text_ids


class TokenizeRequest(BaseModel):
    """POST /tokenize: ``prompt`` (completions) or ``messages`` (chat), exactly one."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: StrictBool | None = None  # None: True for a prompt, False for chat
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt] = Field(max_length=1 << 20)


#: init kwargs about this host's files, left out of /tokenizer_info
LOCAL_KEYS = ("name_or_path", "is_local", "local_files_only", "vocab_file", "merges_file",
              "tokenizer_file", "cache_dir")


def _json_safe(value: Any) -> Any:
    """``value`` if it is JSON data (an AddedToken becomes its text); else None."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "content") and isinstance(value.content, str):  # AddedToken
        return value.content
    if isinstance(value, (list, tuple)):
        items = [_json_safe(v) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    if isinstance(value, dict):
        items = {str(k): _json_safe(v) for k, v in value.items()}
        return None if any(items[str(k)] is None and v is not None
                           for k, v in value.items()) else items
    return None


def tokenizer_info(tokenizer) -> dict[str, Any]:
    """vLLM's /tokenizer_info answer: ``tokenizer_class`` and the tokenizer's configuration
    (its init kwargs that are JSON data, special tokens as text), plus the chat template."""
    info: dict[str, Any] = {}
    for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items():
        safe = _json_safe(value)
        if safe is not None or value is None:
            info[key] = safe
    for key in LOCAL_KEYS:  # where the files lie on this host says nothing to a client
        info.pop(key, None)
    for key in ("bos_token", "eos_token", "pad_token", "unk_token", "model_max_length"):
        value = getattr(tokenizer, key, None)  # lm-evaluation-harness reads the special tokens
        if key not in info and isinstance(value, (str, int)):
            info[key] = value
    info["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        info["chat_template"] = template
    return info


def add_tokenize_routes(app: FastAPI, tokenizer, model_name: str, max_model_len: int) -> None:
    """Serve /tokenize, /detokenize, /tokenizer_info and /version on ``app``."""

    def check_model(model: str | None) -> None:
        if model is not None and model != model_name:
            raise GatewayError(404, f"The model `{model}` does not exist.",
                               type="NotFoundError", param="model", code="model_not_found")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", param="prompt")
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = text_ids(tokenizer, body.prompt, special)
        else:
            if body.continue_final_message:
                raise bad_request("continue_final_message is not supported by this server",
                                  param="continue_final_message")
            if not body.messages:
                raise bad_request("messages must not be empty", param="messages")
            if body.add_special_tokens:
                raise bad_request("add_special_tokens must be false with messages (the chat "
                                  "template writes the special tokens)",
                                  param="add_special_tokens")
            # content parts joined as the chat endpoint joins them
            messages = ChatCompletionRequest(messages=body.messages).template_messages()
            ids = template_ids(tokenizer, messages, body.add_generation_prompt)
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                "token_strs": tokenizer.convert_ids_to_tokens(ids)
                if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        vocab = len(tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of range [0, {vocab})", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def get_tokenizer_info():
        return tokenizer_info(tokenizer)

    @app.get("/version")
    async def version():
        return {"version": __version__}

