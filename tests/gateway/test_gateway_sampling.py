"""Sampling through the real gateway app over the in-process workers (tiny model with SmolLM2's
tokenizer, no Ray; issue 8 items 5, 7, 8):

- every field of the OpenAI client's completions and chat request types is honoured, accepted
  without effect on the output, or refused with HTTP 400 naming it (neutral values pass);
  out-of-range values, integers beyond 64 bits included, are 400 naming the field;
- seeded requests (``seed=42, temperature=1.0``): the same text with speculation off, with the
  n-gram drafter and with a garbage drafter (drafted > 0), streaming and not, chat and
  completions; repeated calls agree; different seeds differ;
- 8 concurrent seeded requests do not change a concurrent greedy request's output.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from specmesh.gateway.refusals import CHAT_REFUSED, COMPLETION_REFUSED, NO_OUTPUT_EFFECT
from specmesh.gateway.schemas import ChatCompletionRequest, CompletionRequest
from helpers.served_gateway import ServedGateway
from helpers.proposers import GarbageProposer

PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"
MESSAGES = [{"role": "user", "content": "Say something about the sea."}]
MAX_TOKENS = 24


class Served(ServedGateway):
    """One in-process cluster driven by a thread, behind a real gateway on 127.0.0.1."""

    def __init__(self, loaded, proposer=None) -> None:
        super().__init__(loaded, proposer=proposer, default_max_tokens=MAX_TOKENS)

    def output(self, chat: bool = False, stream: bool = False,
               **fields) -> tuple[tuple[str, tuple[int, ...]], dict]:
        """The output (text, token ids) and spec stats of one request."""
        body = {"max_tokens": MAX_TOKENS, **fields, "stream": stream, "return_token_ids": True}
        body.update({"messages": MESSAGES} if chat else {"prompt": PROMPT})
        url = "/v1/chat/completions" if chat else "/v1/completions"
        if not stream:
            r = self.client.post(url, json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            choice = out["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            return (text, tuple(choice["token_ids"])), out["spec_stats"]
        with self.client.stream("POST", url, json=body) as r:
            assert r.status_code == 200, r.read()
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        parts = [(ch["delta"].get("content") or "") if chat else ch["text"]
                 for e in events for ch in e["choices"]]
        ids = tuple(t for e in events for ch in e["choices"] for t in ch["token_ids"])
        return ("".join(parts), ids), events[-1]["spec_stats"]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from specmesh.engine.loader import load_model

    return load_model(tiny_model_dir, dtype="float32")


@pytest.fixture(scope="module")
def ngram(loaded):
    s = Served(loaded)
    yield s
    s.close()


@pytest.fixture(scope="module")
def garbage(loaded):
    s = Served(loaded, proposer=GarbageProposer(loaded.config.vocab_size, seed=0))
    yield s
    s.close()


# -- request fields ---------------------------------------------------------------------------


def _openai_fields(chat: bool) -> set[str]:
    if chat:
        from openai.types.chat import completion_create_params as params
    else:
        from openai.types import completion_create_params as params
    return (set(params.CompletionCreateParamsNonStreaming.__annotations__)
            | set(params.CompletionCreateParamsStreaming.__annotations__))


#: a value that would change the output, per refused field (the rest get "x")
NON_NEUTRAL = {
    "frequency_penalty": 2.0, "presence_penalty": -2.0, "repetition_penalty": 2.0,
    "logit_bias": {"19556": -100}, "min_tokens": 20, "response_format": {"type": "json_object"},
    "top_logprobs": 2, "best_of": 2, "echo": True, "suffix": "!", "logprobs": 1,
    "use_beam_search": True, "length_penalty": 0.5, "early_stopping": True,
    "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "include_stop_str_in_output": True, "add_generation_prompt": False,
    "continue_final_message": True, "add_special_tokens": "x", "tools": [{"type": "function"}],
    "tool_choice": "auto", "modalities": ["text", "audio"], "return_tokens_as_token_ids": True,
}
#: honoured fields and a value to send (model, prompt / messages, stream are set by `text`)
HONOURED = {
    "max_tokens": 5, "max_completion_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
    "min_p": 0.05, "seed": 3, "stop": ["zzz"], "stop_token_ids": [2], "ignore_eos": True,
    "num_speculative_tokens": 2, "n": 2, "best_of": 3, "request_id": None,
    "stream_options": None,
    "return_token_ids": True, "prediction": {"type": "content", "content": "a predicted answer"},
    "logprobs": 2, "echo": True,
    "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.2,
    "logit_bias": {"19556": -100}, "min_tokens": 1, "bad_words": ["zzz"],
    "allowed_token_ids": [2, 30, 19556],
    "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
}
#: chat's own values where the endpoints differ (logprobs is a flag there, the count apart)
HONOURED_CHAT = {"logprobs": True, "top_logprobs": 2}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_openai_request_field_is_honoured_or_refused(ngram, chat):
    model = ChatCompletionRequest if chat else CompletionRequest
    refused = CHAT_REFUSED if chat else COMPLETION_REFUSED
    declared = set(model.model_fields)
    fields = _openai_fields(chat)
    assert fields, "the openai client's request types list no fields"
    unclassified = fields - declared - set(refused) - NO_OUTPUT_EFFECT
    assert not unclassified, f"fields neither honoured nor refused: {sorted(unclassified)}"
    assert not declared & set(refused) and not declared & NO_OUTPUT_EFFECT
    url = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"max_tokens": 2, **({"messages": MESSAGES} if chat else {"prompt": PROMPT})}
    for name in sorted(refused):
        bad = NON_NEUTRAL.get(name, "x")
        r = ngram.client.post(url, json={**base, name: bad})
        assert r.status_code == 400, (name, r.text)
        err = r.json()["error"]
        assert err["param"] == name and name in err["message"], err
        for neutral in (None, *refused[name]):  # neutral values change nothing: accepted
            r = ngram.client.post(url, json={**base, name: neutral})
            assert r.status_code == 200, (name, neutral, r.text)
    for name in sorted(fields & NO_OUTPUT_EFFECT):
        r = ngram.client.post(url, json={**base, name: "x" if name != "metadata" else {}})
        assert r.status_code == 200, (name, r.text)
    for name in sorted((fields | set(HONOURED)) & (declared - {"model", "prompt", "messages",
                                                               "stream"})):
        if name == "max_completion_tokens" and not chat:
            continue
        value = HONOURED_CHAT.get(name, HONOURED.get(name)) if chat else HONOURED[name]
        body = {**base, name: value} if value is not None else base
        if chat and name == "top_logprobs":  # only with logprobs: true (OpenAI)
            body["logprobs"] = True
        r = ngram.client.post(url, json=body)
        assert r.status_code == 200, (name, r.text)
    # what reached the wire
    r = ngram.client.post(url, json={**base, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
                                     "min_p": 0.05, "seed": 3})
    assert r.status_code == 200
    sp = ngram.sent[-1].sampling
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.seed) == (0.7, 0.9, 5, 0.05, 3)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("field, value", [
    ("seed", 2**70), ("seed", -2**64), ("seed", "7"), ("seed", True), ("seed", 1.5),
    ("top_k", 2**70), ("top_k", -2), ("stop_token_ids", [2**70]), ("stop_token_ids", [-1]),
    ("max_tokens", 2**70), ("max_tokens", 0), ("num_speculative_tokens", 2**64),
    ("num_speculative_tokens", -1), ("n", 2**70), ("n", 0), ("temperature", 2.5),
    ("temperature", -0.1), ("temperature", "1"), ("top_p", 0), ("top_p", 1.5),
    ("min_p", -0.1), ("min_p", 1.01), ("ignore_eos", "yes"), ("stream", 1),
])
def test_out_of_range_values_are_400_naming_the_field(ngram, chat, field, value):
    url = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": 2, **({"messages": MESSAGES} if chat else {"prompt": PROMPT}),
            field: value}
    r = ngram.client.post(url, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == field


def test_nan_and_infinite_numbers_are_400(ngram):
    for value in ("NaN", "Infinity", "1e999"):
        r = ngram.client.post("/v1/completions", content=(
            '{"prompt": "hi", "max_tokens": 2, "temperature": %s}' % value).encode(),
            headers={"content-type": "application/json"})
        assert r.status_code == 400, (value, r.text)


# -- seeded and sampled requests --------------------------------------------------------------

SEEDED = {"temperature": 1.0, "seed": 42}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_seeded_output_does_not_depend_on_speculation_streaming_or_repeats(ngram, garbage, chat):
    outs, drafted = {}, {}
    for name, served in (("ngram", ngram), ("garbage", garbage)):
        for kappa in (0, 4):
            for stream in (False, True):
                out, stats = served.output(chat, stream, num_speculative_tokens=kappa, **SEEDED)
                outs[name, kappa, stream] = out
                drafted[name, kappa, stream] = stats["num_draft_tokens"]
    assert len(set(outs.values())) == 1, outs
    assert all(drafted[("garbage", 4, s)] > 0 for s in (False, True)), drafted
    assert all(drafted[(n, 0, s)] == 0 for n in ("ngram", "garbage") for s in (False, True))
    again, _ = ngram.output(chat, **SEEDED)
    assert again == outs["ngram", 4, False]
    others = {ngram.output(chat, temperature=1.0, seed=s)[0] for s in (1, 2, 3)}
    assert len(others | {again}) == 4  # every seed its own output


def test_unseeded_sampled_requests_vary(ngram):
    outs = {ngram.output(temperature=1.0)[0] for _ in range(3)}
    assert len(outs) > 1


def test_concurrent_seeded_requests_do_not_change_a_greedy_one(garbage):
    alone, _ = garbage.output(temperature=0)
    with ThreadPoolExecutor(max_workers=9) as pool:
        seeded = [pool.submit(garbage.output, stream=bool(i % 2), temperature=1.0, seed=i)
                  for i in range(8)]
        greedy = pool.submit(garbage.output, temperature=0)
        results = [f.result() for f in seeded]
        assert greedy.result()[0] == alone
    # and each seeded one is its own output, as when it runs alone
    assert [t for t, _ in results] == [garbage.output(temperature=1.0, seed=i)[0]
                                       for i in range(8)]


def test_usage_reports_the_prompt_tokens_the_prefix_cache_held(ngram):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: 0 for a prompt never seen, then
    the repeated prompt's leading full KV blocks (its last token is always computed)."""
    prompt = "cached prompt " * 40  # a prompt seen by no other test of this module
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = ngram.client.post("/v1/completions", json=body).json()["usage"]
    again = ngram.client.post("/v1/completions", json=body).json()["usage"]
    n = first["prompt_tokens"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < n and cached % 16 == 0 and cached >= n - 16
