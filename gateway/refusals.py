"""The request fields the gateway does not honour, and what it does with them (the groups of
gateway/schemas.py's docstring): fields without effect on the output are accepted and ignored
(:data:`NO_OUTPUT_EFFECT`); fields that would change the output are refused with HTTP 400
naming the field unless the value is absent, null or the neutral one listed
(:data:`COMMON_REFUSED` plus the endpoint's own table); and the fields OpenAI documents as not
combinable with ``prediction`` (:data:`PREDICTION_REFUSED`)."""

from __future__ import annotations

from typing import Any

from specmesh.gateway.api_errors import bad_request

#: fields without effect on the output tokens: accepted and ignored
NO_OUTPUT_EFFECT = frozenset({
    "user", "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options", "safety_identifier", "parallel_tool_calls", "priority",
    "cache_salt", "kv_transfer_params",
})

#: fields that change the output and are not honoured -> the values that change nothing
#: (absent and null always pass); anything else is HTTP 400 naming the field
COMMON_REFUSED: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "suffix": ("",),
    "functions": ([],), "function_call": ("none",), "audio": (),
    "modalities": (["text"],), "reasoning_effort": (), "verbosity": (),
    "web_search_options": (), "moderation": (),
    # vLLM extensions
    "use_beam_search": (False,), "length_penalty": (1,), "early_stopping": (False,),
    "prompt_logprobs": (), "guided_decoding_backend": (), "guided_whitespace_pattern": (),
    "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "truncate_prompt_tokens": (),
    "logits_processors": ([],), "return_tokens_as_token_ids": (False,),
    "mm_processor_kwargs": (), "vllm_xargs": (),
}
#: /v1/completions only (prompts are tokenized with the tokenizer's special tokens)
COMPLETION_REFUSED: dict[str, tuple[Any, ...]] = {
    **{k: v for k, v in COMMON_REFUSED.items() if k != "prompt_logprobs"},
    "add_special_tokens": (True,),
    "max_completion_tokens": (), "top_logprobs": (),  # chat's; completions say logprobs: k
    "tools": ([],), "tool_choice": ("none",),
}
#: /v1/chat/completions only (the chat template with the generation prompt,
#: docs/architecture.md, 'Life of a request')
CHAT_REFUSED: dict[str, tuple[Any, ...]] = {
    **COMMON_REFUSED, "echo": (False,), "add_special_tokens": (False,), "best_of": (1,),
    "add_generation_prompt": (True,), "continue_final_message": (False,),
    "chat_template": (), "chat_template_kwargs": ({},), "documents": (),
}


#: fields OpenAI documents as not combinable with ``prediction`` -> whether a value is refused
#: with one (absent and null always pass); a 400 names the field
PREDICTION_REFUSED: dict[str, Any] = {
    "n": lambda v: v > 1,
    "logprobs": lambda v: v is not False,
    "top_logprobs": lambda v: True,
    "presence_penalty": lambda v: isinstance(v, (int, float)) and v > 0,
    "frequency_penalty": lambda v: isinstance(v, (int, float)) and v > 0,
    "tools": lambda v: v != [],
    "functions": lambda v: v != [],
    "audio": lambda v: True,
    "modalities": lambda v: v != ["text"],
    "max_completion_tokens": lambda v: True,
}


def _same(value: Any, neutral: Any) -> bool:
    """``value == neutral`` with JSON types kept apart (``false`` is not ``0``)."""
    if isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    if isinstance(neutral, (int, float)):
        return isinstance(value, (int, float)) and value == neutral
    return type(value) is type(neutral) and value == neutral


def refuse_unhonoured(fields: dict[str, Any], table: dict[str, tuple[Any, ...]]) -> None:
    """HTTP 400 naming the first field of ``table`` whose value would change the output.

    Raises:
        GatewayError: 400 with ``param`` = the field.
    """
    for name, value in fields.items():
        neutrals = table.get(name)
        if neutrals is None or value is None or any(_same(value, n) for n in neutrals):
            continue
        allowed = " or ".join(repr(n) for n in neutrals)
        raise bad_request(f"{name} is not supported by this server"
                          + (f" (only {allowed})" if allowed else ""), param=name)
