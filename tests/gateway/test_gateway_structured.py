"""Structured output and forced tool calls through the real gateway and the three in-process
workers (tiny random Llama with SmolLM2's tokenizer, n-gram drafter): every output follows its
constraint (the model only ever sees masked logits, so it must parse), speculation on (k = 4
and 8) equals off token for token, and malformed constraints are a 400 that says why."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from helpers.served_gateway import ServedGateway

#: a few-shot prompt: the n-gram drafter finds the repeated keys in it
PROMPT = ('{"name":"rex","kind":"dog","tags":["a","b"],"age":3,"owner":{"id":7,"ok":true}}\n'
          '{"name":"tom","kind":"cat","tags":["b"],"age":5,"owner":{"id":2,"ok":false}}\n')
MESSAGES = [{"role": "user", "content": "Give me a pet as JSON. " + PROMPT}]
PET = {"type": "object", "additionalProperties": False,
       "required": ["name", "kind", "tags", "age", "owner"],
       "properties": {
           "name": {"type": "string", "maxLength": 6},
           "kind": {"enum": ["dog", "cat", "bird"]},
           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
           "age": {"type": "integer", "minimum": 0, "maximum": 30},
           "owner": {"type": "object", "additionalProperties": False,
                     "required": ["id", "ok"],
                     "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                    "ok": {"type": "boolean"}}}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"],
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"type": "string", "maxLength": 5}}}}}


def _pet(text: str) -> bool:
    jsonschema.validate(json.loads(text), PET)
    return True


class Served(ServedGateway):
    """An in-process cluster (with the tokenizer: structured output on) driven by a thread,
    behind a real gateway on 127.0.0.1."""

    def __init__(self, loaded) -> None:
        super().__init__(loaded, num_speculative_tokens=8, tokenizer=loaded.tokenizer,
                         default_max_tokens=96)

    def post(self, chat: bool, **fields) -> httpx.Response:
        body = {"max_tokens": 96, "temperature": 0, "return_token_ids": True, **fields}
        body.update({"messages": MESSAGES} if chat else {"prompt": PROMPT})
        return self.client.post("/v1/chat/completions" if chat else "/v1/completions",
                                json=body)

    def run(self, chat: bool, **fields) -> tuple[dict, str, tuple[int, ...]]:
        """(choice, text, token ids) of one request that must succeed."""
        r = self.post(chat, **fields)
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        text = (choice["message"]["content"] or "") if chat else choice["text"]
        return {**choice, "spec_stats": out["spec_stats"]}, text, tuple(choice["token_ids"])

    def stream(self, chat: bool, **fields) -> list[dict]:
        body = {"max_tokens": 96, "temperature": 0, "stream": True, **fields}
        body.update({"messages": MESSAGES} if chat else {"prompt": PROMPT})
        url = "/v1/chat/completions" if chat else "/v1/completions"
        with self.client.stream("POST", url, json=body) as r:
            assert r.status_code == 200, r.read()
            return [json.loads(line[6:]) for line in r.iter_lines()
                    if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from specmesh.engine.loader import load_model  # torch model: only when these tests run

    return load_model(tiny_model_dir, dtype="float32")


@pytest.fixture(scope="module")
def served(loaded):
    s = Served(loaded)
    yield s
    s.close()


def _same_with_and_without_speculation(served, chat: bool, finished: bool = True,
                                       **fields) -> tuple[str, int]:
    """The output with kappa 0, 4 and 8 (one text, asserted) and the drafts accepted;
    ``finished``: the grammar must have completed (else max_tokens may cut it)."""
    outs, accepted = set(), 0
    for k in (0, 4, 8):
        choice, text, ids = served.run(chat, num_speculative_tokens=k, **fields)
        assert choice["finish_reason"] in (("stop", "tool_calls") if finished else
                                           ("stop", "length")), choice
        outs.add((text, ids, json.dumps(choice["message"].get("tool_calls") and [
            c["function"] for c in choice["message"]["tool_calls"]]) if chat else ""))
        if k == 0:
            assert choice["spec_stats"]["num_draft_tokens"] == 0
        else:
            accepted += choice["spec_stats"]["num_accepted_tokens"]
    assert len(outs) == 1, outs
    return next(iter(outs))[0], accepted


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_json_schema_output_validates_and_speculation_changes_nothing(served, chat):
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
    text, accepted = _same_with_and_without_speculation(served, chat, response_format=rf)
    jsonschema.validate(json.loads(text), PET)
    assert accepted > 0
    plain, _, _ = served.run(chat, num_speculative_tokens=0)
    assert plain[("message" if chat else "text")] != text  # the constraint changed the output


@pytest.mark.parametrize("field, value, check", [
    ("guided_json", PET, _pet),
    ("structured_outputs", {"json": PET}, _pet),
    ("guided_regex", r"[a-z]{2,5}-\d{2}", lambda t: re.fullmatch(r"[a-z]{2,5}-\d{2}", t)),
    ("structured_outputs", {"regex": r"(yes|no), [0-9]{3}"},
     lambda t: re.fullmatch(r"(yes|no), [0-9]{3}", t)),
    ("guided_choice", ["red", "green", "dark blue"], lambda t: t in ("red", "green",
                                                                      "dark blue")),
    ("structured_outputs", {"choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ("guided_grammar", 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/',
     lambda t: re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", t)),
    ("guided_grammar", 'root ::= "ab" [0-9] [0-9]', lambda t: re.fullmatch(r"ab\d\d", t)),
])
def test_every_constraint_kind_is_followed_with_speculation_on_and_off(served, field, value,
                                                                       check):
    text, _ = _same_with_and_without_speculation(served, False, **{field: value})
    assert check(text), text


def test_json_object_is_an_object_with_speculation_on_and_off(served):
    # any JSON object: the random model writes keys of any length, so max_tokens may end it
    choice, text, _ = served.run(False, response_format={"type": "json_object"})
    same, _ = _same_with_and_without_speculation(
        served, False, finished=False, response_format={"type": "json_object"})
    assert same == text and text.startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


def test_sampled_seeded_json_is_the_same_with_speculation_on_and_off(served):
    text, _ = _same_with_and_without_speculation(
        served, False, guided_json=PET, temperature=1.0, seed=11)
    jsonschema.validate(json.loads(text), PET)


def test_stream_gives_the_same_constrained_text(served):
    _, text, _ = served.run(False, guided_json=PET)
    events = served.stream(False, guided_json=PET)
    assert "".join(ch["text"] for e in events for ch in e["choices"]) == text
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_tool_choice_required_and_named_return_tool_calls(served, stream):
    tools = [WEATHER, TIME]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice_field in ("required", named):
        if stream:
            events = served.stream(True, tools=tools, tool_choice=choice_field,
                                   parallel_tool_calls=False)
            deltas = [ch["delta"] for e in events for ch in e["choices"]]
            calls = [c for d in deltas for c in d.get("tool_calls", [])]
            reason = events[-1]["choices"][0]["finish_reason"]
        else:
            # one call: the random model would go on adding calls to the array
            choice, _, _ = served.run(True, tools=tools, tool_choice=choice_field,
                                      parallel_tool_calls=False)
            assert "tool_calls" in choice["message"], choice
            calls, reason = choice["message"]["tool_calls"], choice["finish_reason"]
            assert choice["message"]["content"] is None
        assert reason == "tool_calls" and calls, (choice_field, calls)
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        for call in calls:
            assert call["type"] == "function" and call["id"].startswith("call_")
            fn = call["function"]
            jsonschema.validate(json.loads(fn["arguments"]), by_name[fn["name"]])
        if choice_field is named:
            assert [c["function"]["name"] for c in calls] == ["get_weather"]
    if not stream:
        _same_with_and_without_speculation(served, True, tools=tools, tool_choice="required",
                                           parallel_tool_calls=False)


def test_tool_choice_none_serves_plain_text(served):
    plain, text, _ = served.run(True, num_speculative_tokens=0)
    choice, with_tools, _ = served.run(True, tools=[WEATHER], tool_choice="none",
                                       num_speculative_tokens=0)
    assert with_tools == text and "tool_calls" not in choice["message"]


@pytest.mark.parametrize("chat, fields, param, words", [
    (False, {"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    (False, {"guided_json": {"type": "objectx"}}, "guided_json", "objectx"),
    (False, {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    (False, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format", "nope"),
    (False, {"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    (False, {"guided_choice": []}, "guided_choice", "non-empty"),
    (False, {"guided_grammar": 'root ::= "a'}, "guided_grammar", "GBNF"),
    (False, {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    (False, {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one"),
    (False, {"tools": [WEATHER], "tool_choice": "required"}, "tools", "tools"),
    (True, {"tools": [WEATHER]}, "tool_choice", "chat template does not define tool calling"),
    (True, {"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "auto"),
    (True, {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    (True, {"tools": [{"type": "function"}], "tool_choice": "required"}, "tools", "tools[0]"),
    (True, {"tools": [WEATHER], "tool_choice": "required",
            "response_format": {"type": "json_object"}}, "tool_choice", "only one"),
])
def test_bad_constraints_are_400_saying_why(served, chat, fields, param, words):
    r = served.post(chat, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    # the roles are still serving
    assert served.post(chat, max_tokens=2).status_code == 200


def test_required_tool_calls_parse_every_call_and_cut_output_is_content():
    from specmesh.gateway.structured import Structured, required_tools_schema, tool_calls

    required = Structured(None, "required")
    text = json.dumps([{"name": "get_time", "parameters": {"zone": "UTC"}},
                       {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}])
    calls = tool_calls(required, text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "unit": "C"})]
    assert len({c["id"] for c in calls}) == 2
    assert tool_calls(required, text[:-3]) is None  # cut by max_tokens: plain content
    named = Structured(None, "named", "get_time")
    assert tool_calls(named, '{"zone":"CET"}')[0]["function"] == {
        "name": "get_time", "arguments": '{"zone": "CET"}'}
    schema = required_tools_schema({"f": {"type": "object"}}, parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    jsonschema.validate([{"name": "f", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "g", "parameters": {}}], schema)


def test_n_seeded_choices_all_follow_the_schema(served):
    r = served.post(False, guided_json=PET, temperature=1.0, seed=3, n=3,
                    num_speculative_tokens=4)
    assert r.status_code == 200, r.text
    texts = [ch["text"] for ch in r.json()["choices"]]
    for text in texts:  # every forked choice advanced its own matcher from the first token
        jsonschema.validate(json.loads(text), PET)
    assert len(set(texts)) > 1  # the derived seeds made them differ
