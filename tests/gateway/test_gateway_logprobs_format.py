"""The logprobs objects' shapes (gateway/logprobs.py; OpenAI's and vLLM's): the chosen token
added to a completions top-k it is not in, ``-inf`` floored to -9999.0, echo's null first
entry, text offsets over the token strings, chat's bytes and top lists."""

from __future__ import annotations

import pytest

from specmesh.gateway.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from specmesh.protocol.messages import TokenLogprobs


class Tok:
    """A tokenizer whose token i is the letter chr(97 + i) (and 'é' for 5)."""

    def decode(self, ids):
        return "".join("é" if i == 5 else chr(97 + i) for i in ids)


def test_completion_shapes():
    texts = TokenTexts(Tok())
    lp = TokenLogprobs(token_logprobs=[-0.5, float("-inf")], top_token_ids=[[1, 2], [0, 4]],
                       top_logprobs=[[-0.5, -1.0], [-0.1, -3.0]])
    out = completion_logprobs([1, 3], [lp], texts, initial_offset=7)
    assert out == {"text_offset": [7, 8], "token_logprobs": [-0.5, -9999.0],
                   "tokens": ["b", "d"],
                   "top_logprobs": [{"b": -0.5, "c": -1.0},
                                    {"a": -0.1, "e": -3.0, "d": -9999.0}]}  # chosen added


def test_completion_echo_first_token_null_and_k0():
    texts = TokenTexts(Tok())
    prompt = TokenLogprobs(token_logprobs=[-2.0], top_token_ids=[[]], top_logprobs=[[]])
    out = completion_logprobs([0, 5], [None, prompt], texts)
    assert out["token_logprobs"] == [None, -2.0] and out["top_logprobs"] == [None, {"é": -2.0}]
    assert out["text_offset"] == [0, 1] and out["tokens"] == ["a", "é"]
    with pytest.raises(ValueError):
        completion_logprobs([0, 5, 1], [None, prompt], texts)


def test_chat_shapes():
    texts = TokenTexts(Tok())
    lp = TokenLogprobs(token_logprobs=[-0.25], top_token_ids=[[5, 2]],
                       top_logprobs=[[-0.25, -2.0]])
    assert chat_logprobs([5], [lp], texts) == {"content": [{
        "token": "é", "logprob": -0.25, "bytes": [195, 169],
        "top_logprobs": [{"token": "é", "logprob": -0.25, "bytes": [195, 169]},
                         {"token": "c", "logprob": -2.0, "bytes": [99]}]}]}
