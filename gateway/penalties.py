"""The request fields of penalties and token constraints (issue 33 item 3), checked and turned
into SamplingParams fields: ``frequency_penalty``, ``presence_penalty`` (OpenAI),
``repetition_penalty``, ``min_tokens``, ``bad_words``, ``allowed_token_ids`` (vLLM
extensions) and ``logit_bias`` (OpenAI: token ids as JSON object keys, biases in
[-100, 100]). Ranges are checked by the request schema (gateway/schemas.py); what needs the
tokenizer or the vocabulary is checked here, each failure an HTTP 400 naming the field.

``bad_words`` are tokenized as vLLM does (``SamplingParams.update_from_tokenizer``): each word
without special tokens, once as written (leading spaces stripped) and once with a leading
space when that gives a different first token and as many tokens (the word inside a text);
the verifier then masks a word's last token wherever the output ends with its other tokens.
"""

from __future__ import annotations

from typing import Any

from specmesh.gateway.api_errors import bad_request
from specmesh.gateway.tokens import prediction_ids

#: most logit_bias entries / bad words / allowed ids a request may carry (a bound on the work
#: per verified row; OpenAI's own limit for logit_bias is 300)
MAX_LOGIT_BIAS = 300
MAX_BAD_WORDS = 128


def _token_ids_in_vocab(name: str, ids: list[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"{name}: token id {bad[0]} is outside the vocabulary "
                          f"[0, {vocab_size})", param=name)


def logit_bias_lists(logit_bias: dict[str, float] | None, vocab_size: int
                     ) -> tuple[list[int], list[float]]:
    """``logit_bias`` as (token ids, biases), keys parsed as decimal integers.

    Raises:
        GatewayError: 400 (param ``logit_bias``) for a key that is not a token id of the
            vocabulary, or more than :data:`MAX_LOGIT_BIAS` entries (the values' range is the
            schema's).
    """
    if not logit_bias:
        return [], []
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias has {len(logit_bias)} entries, more than "
                          f"{MAX_LOGIT_BIAS}", param="logit_bias")
    ids, values = [], []
    for key, value in logit_bias.items():
        text = key.strip()
        if not (text.isascii() and text.lstrip("-").isdigit()):
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}",
                              param="logit_bias")
        ids.append(int(text))
        values.append(float(value))
    _token_ids_in_vocab("logit_bias", ids, vocab_size)
    return ids, values


def bad_words_token_ids(tokenizer, words: list[str] | None, vocab_size: int) -> list[list[int]]:
    """The token ids of each bad word, with and without a leading space (module docstring).

    Raises:
        GatewayError: 400 (param ``bad_words``) for more than :data:`MAX_BAD_WORDS` words, a
            word that tokenizes to nothing, or ids outside the vocabulary.
    """
    if not words:
        return []
    if len(words) > MAX_BAD_WORDS:
        raise bad_request(f"bad_words has {len(words)} words, more than {MAX_BAD_WORDS}",
                          param="bad_words")
    out: list[list[int]] = []
    for word in words:
        plain = prediction_ids(tokenizer, word.lstrip())
        if not plain:
            raise bad_request(f"bad word {word!r} has no tokens", param="bad_words")
        out.append(plain)
        spaced = prediction_ids(tokenizer, " " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    _token_ids_in_vocab("bad_words", [t for w in out for t in w], vocab_size)
    return out


def penalty_sampling_fields(body, tokenizer, vocab_size: int, max_tokens: int
                            ) -> dict[str, Any]:
    """SamplingParams keyword arguments of ``body``'s penalties and token constraints
    (neutral values for absent fields).

    Raises:
        GatewayError: 400 naming the field: ``min_tokens`` above the request's max tokens,
            an empty ``allowed_token_ids``, ids outside ``[0, vocab_size)``, a bad
            ``logit_bias`` key or bad word.
    """
    min_tokens = body.min_tokens or 0
    if min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({min_tokens}) must not exceed max_tokens "
                          f"({max_tokens})", param="min_tokens")
    allowed = body.allowed_token_ids
    if allowed is not None:
        if not allowed:
            raise bad_request("allowed_token_ids must not be empty", param="allowed_token_ids")
        _token_ids_in_vocab("allowed_token_ids", allowed, vocab_size)
        allowed = sorted(set(allowed))
    bias_ids, bias_values = logit_bias_lists(body.logit_bias, vocab_size)
    words = [body.bad_words] if isinstance(body.bad_words, str) else body.bad_words
    return {
        "presence_penalty": float(body.presence_penalty or 0.0),
        "frequency_penalty": float(body.frequency_penalty or 0.0),
        "repetition_penalty": 1.0 if body.repetition_penalty is None
        else float(body.repetition_penalty),
        "logit_bias_token_ids": bias_ids, "logit_bias_values": bias_values,
        "min_tokens": min_tokens,
        "bad_words_token_ids": bad_words_token_ids(tokenizer, words, vocab_size),
        "allowed_token_ids": allowed,
    }


__all__ = ["MAX_BAD_WORDS", "MAX_LOGIT_BIAS", "bad_words_token_ids", "logit_bias_lists",
           "penalty_sampling_fields"]
