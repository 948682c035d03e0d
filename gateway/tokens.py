"""Prompt tokenization exactly as docs/architecture.md, 'Life of a request' step 1 fixes it, and
a prediction's (OpenAI Predicted Outputs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specmesh.gateway.api_errors import GatewayError, bad_request


def _plain_ids(value: Any) -> list[int]:
    """A flat ``list[int]`` from whatever the tokenizer returned.

    transformers 5 returns a BatchEncoding (a dict) from ``apply_chat_template(tokenize=True)``;
    older versions a list; some a tensor or a batch of one.
    """
    if isinstance(value, Mapping) or hasattr(value, "input_ids"):
        value = value["input_ids"]
    if hasattr(value, "tolist"):
        value = value.tolist()
    value = list(value)
    if len(value) == 1 and isinstance(value[0], (list, tuple)):
        value = list(value[0])
    return [int(t) for t in value]


def completion_prompt_ids(tokenizer, prompt) -> list[int]:
    """``tokenizer(prompt)["input_ids"]`` for text; token ids are checked and used as given."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise bad_request("only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _plain_ids(tokenizer(prompt)["input_ids"])
    ids = [int(t) for t in prompt]
    vocab = len(tokenizer)
    bad = [t for t in ids if t < 0 or t >= vocab]
    if bad:
        raise bad_request(f"token id {bad[0]} is out of range [0, {vocab})", param="prompt")
    return ids


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None
                    ) -> list[int]:
    """``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` as ids;
    ``tools`` (a request's forced tools, gateway/structured.py) go to the template too, as
    vLLM passes them (a template without tool calling ignores them)."""
    extra = {"tools": tools} if tools else {}
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            **extra)
    except GatewayError:
        raise
    except Exception as err:  # noqa: BLE001 - jinja raises for roles/orders a template refuses
        raise bad_request(f"cannot apply the chat template: {err}", param="messages") from err
    return _plain_ids(out)


def prediction_ids(tokenizer, text: str) -> list[int]:
    """The token ids of a prediction's text: ``tokenizer(text, add_special_tokens=False)``,
    no chat template (it stands for the output, which the template does not wrap)."""
    return _plain_ids(tokenizer(text, add_special_tokens=False)["input_ids"])


def text_ids(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer(text, add_special_tokens=...)["input_ids"]`` as a flat list (/tokenize)."""
    return _plain_ids(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def template_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """The chat template's ids of ``messages``: :func:`chat_prompt_ids` (what
    /v1/chat/completions sends), or without the generation prompt (/tokenize may ask).

    Raises:
        GatewayError: 400 (param ``messages``) when the template refuses the messages.
    """
    if add_generation_prompt:
        return chat_prompt_ids(tokenizer, messages)
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                            tokenize=True)
    except Exception as err:  # noqa: BLE001 - jinja raises for roles/orders a template refuses
        raise bad_request(f"cannot apply the chat template: {err}", param="messages") from err
    return _plain_ids(out)
