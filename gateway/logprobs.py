"""Logprobs in the shapes OpenAI and vLLM answer them (issue 33, item 1).

The values come from the verifier (every output token but the first) and the prefill role
(the first output token, and the prompt's with ``echo``) on TokenStream: the float32
log_softmax of the target's logits at each position, before temperature / top-k / top-p
(vLLM's default raw-model logprobs; engine/logprobs.py). This module only formats them:

- completions (``logprobs: k``): ``{"text_offset": [...], "token_logprobs": [...], "tokens":
  [...], "top_logprobs": [{token_text: logprob}, ...]}``, one entry per token. ``top_logprobs``
  holds the k most likely tokens plus the chosen one when it is not among them (OpenAI: "up
  to logprobs + 1 elements"); ``logprobs: 0`` gives the chosen token alone. ``text_offset``
  is each token's character offset in the choice's text, counted over the token strings from
  0 (vLLM). With ``echo`` the prompt's tokens come first, the first of them with ``null``
  logprob and top_logprobs (nothing predicts it: OpenAI, vLLM).
- chat (``logprobs: true``, ``top_logprobs: k``): ``{"content": [{"token", "logprob",
  "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}`` with the k most likely
  tokens, most likely first.

A token's text is ``tokenizer.decode([id])`` (vLLM's ``decoded_token``); ``bytes`` its UTF-8
bytes (a partial character decodes to U+FFFD, as in vLLM). ``-inf`` (a masked token) is
reported as -9999.0, the JSON-safe floor OpenAI and vLLM use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specmesh.protocol.messages import TokenLogprobs

#: the floor of a reported logprob (JSON has no -inf; OpenAI's and vLLM's value)
LOGPROB_FLOOR = -9999.0
#: tokens whose text is kept per gateway (top logprobs decode the same few ids over and over)
MAX_CACHED_TOKEN_TEXTS = 1 << 16


def _floor(x: float) -> float:
    return x if x >= LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps NaN to the floor


class TokenTexts:
    """``tokenizer.decode([id])`` per token id, cached (a bounded dict)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            try:
                text = self.tokenizer.decode([token_id])
            except Exception:  # noqa: BLE001 - an id past the tokenizer (padded embedding)
                text = ""
            if len(self._cache) >= MAX_CACHED_TOKEN_TEXTS:
                self._cache.clear()
            self._cache[token_id] = text
        return text


def _entries(lp: TokenLogprobs) -> list[tuple[float, list[int], list[float]]]:
    tops = lp.top_token_ids or [[] for _ in lp.token_logprobs]
    vals = lp.top_logprobs or [[] for _ in lp.token_logprobs]
    return list(zip(lp.token_logprobs, tops, vals))


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None],
                        texts: TokenTexts, initial_offset: int = 0) -> dict[str, Any]:
    """The completions ``logprobs`` object of ``token_ids``.

    Args:
        token_ids: the tokens of the choice's text (with ``echo`` the prompt's first).
        logprobs: parts covering ``token_ids`` in order; a None part stands for one token
            without logprobs (the first prompt token).
        texts: token texts.
        initial_offset: ``text_offset`` of the first token (a stream chunk continues the
            previous chunks' offsets).

    Raises:
        ValueError: the parts do not cover ``token_ids`` exactly.
    """
    entries: list[tuple[float, list[int], list[float]] | None] = []
    for part in logprobs:
        entries.extend([None] if part is None else _entries(part))
    if len(entries) != len(token_ids):
        raise ValueError(f"{len(entries)} logprobs for {len(token_ids)} tokens")
    out: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [],
                            "top_logprobs": []}
    offset = initial_offset
    for tok, entry in zip(token_ids, entries):
        text = texts(tok)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        chosen, top_ids, top_lps = entry
        out["token_logprobs"].append(_floor(chosen))
        top = {texts(t): _floor(v) for t, v in zip(top_ids, top_lps)}
        if tok not in top_ids:
            top.setdefault(text, _floor(chosen))
        out["top_logprobs"].append(top)
    return out


def vllm_prompt_logprobs(prompt_ids: Sequence[int], logprobs: TokenLogprobs | None,
                         texts: TokenTexts, k: int) -> list[dict[str, dict] | None]:
    """vLLM's ``prompt_logprobs`` of a completions choice: per prompt token None (the first:
    nothing predicts it) or ``{token_id: {"logprob", "rank", "decoded_token"}}`` with the
    token itself first, then the ``k`` most likely tokens there (ranks 1..k).

    Raises:
        ValueError: ``logprobs`` do not cover prompt positions 1 .. n-1.
    """
    if logprobs is None or len(logprobs.token_logprobs) != len(prompt_ids) - 1:
        raise ValueError("the prompt's logprobs do not cover the prompt")
    out: list[dict[str, dict] | None] = [None]
    ranks = logprobs.ranks or [None] * len(prompt_ids)
    for tok, (chosen, top_ids, top_lps), rank in zip(prompt_ids[1:], _entries(logprobs), ranks):
        entry = {str(tok): {"logprob": _floor(chosen), "rank": rank,
                            "decoded_token": texts(tok)}}
        for i, (t, v) in enumerate(zip(top_ids[:k], top_lps[:k])):
            entry.setdefault(str(t), {"logprob": _floor(v), "rank": i + 1,
                                      "decoded_token": texts(t)})
        out.append(entry)
    return out


def completion_text_length(token_ids: Sequence[int], texts: TokenTexts) -> int:
    """The characters ``text_offset`` advances over ``token_ids`` (the next chunk's
    ``initial_offset``)."""
    return sum(len(texts(t)) for t in token_ids)


def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": _floor(logprob),
            "bytes": list(text.encode("utf-8", errors="replace"))}


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs],
                  texts: TokenTexts) -> dict[str, Any]:
    """The chat ``logprobs`` object (``{"content": [...]}``) of ``token_ids``.

    Raises:
        ValueError: the parts do not cover ``token_ids`` exactly.
    """
    entries = [e for part in logprobs for e in _entries(part)]
    if len(entries) != len(token_ids):
        raise ValueError(f"{len(entries)} logprobs for {len(token_ids)} tokens")
    content = []
    for tok, (chosen, top_ids, top_lps) in zip(token_ids, entries):
        item = _chat_entry(texts(tok), chosen)
        item["top_logprobs"] = [_chat_entry(texts(t), v) for t, v in zip(top_ids, top_lps)]
        content.append(item)
    return {"content": content}
