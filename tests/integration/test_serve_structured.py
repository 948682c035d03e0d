"""Structured output end to end through the Ray cluster (prefill, verifier, drafter and
gateway in their own processes, ZMQ between them; tiny random Llama with SmolLM2's tokenizer)
with the ``openai`` client: every role compiles the grammar from its own tokenizer, a JSON
schema and a forced tool call come back valid, and speculation on equals off token for token
with drafts accepted."""

from __future__ import annotations

import json

import jsonschema
import pytest

from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.launcher import start_cluster

pytestmark = pytest.mark.ray

#: repeated keys: the n-gram drafter drafts them from the prompt
MESSAGES = [{"role": "user", "content": 'Pets: {"name":"rex","kind":"dog","age":3} '
                                        '{"name":"tom","kind":"cat","age":5} Another one:'}]
PET = {"type": "object", "additionalProperties": False, "required": ["name", "kind", "age"],
       "properties": {"name": {"type": "string", "maxLength": 8},
                      "kind": {"enum": ["dog", "cat", "bird"]},
                      "age": {"type": "integer", "minimum": 0, "maximum": 20}}}


@pytest.fixture(scope="module")
def client(ray_session, tiny_model_dir):
    from openai import OpenAI

    cfg = ClusterConfig.create(model=tiny_model_dir, dtype="float32", num_speculative_tokens=8,
                               kv_cache_mb=32, port=0, max_model_len=1024)
    handle = start_cluster(cfg)
    yield OpenAI(base_url=f"{handle.url}/v1", api_key="x", max_retries=0)
    handle.stop()


def _chat(client, **extra):
    kw = {k: extra.pop(k) for k in ("response_format", "tools", "tool_choice",
                                    "parallel_tool_calls") if k in extra}
    return client.chat.completions.create(
        model=None, messages=MESSAGES, max_tokens=64, temperature=0,
        extra_body={"return_token_ids": True, **extra}, **kw)


def test_json_schema_and_forced_tool_calls_are_served_and_exact(client):
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}}
    outs, accepted = [], 0
    for k in (0, 4, 8):
        out = _chat(client, response_format=rf, num_speculative_tokens=k)
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), PET)
        outs.append(out.choices[0].model_extra["token_ids"])
        accepted += out.model_extra["spec_stats"]["num_accepted_tokens"] if k else 0
    assert outs[0] == outs[1] == outs[2] and accepted > 0
    tool = {"type": "function", "function": {"name": "add_pet", "parameters": PET}}
    out = _chat(client, tools=[tool], tool_choice="required", parallel_tool_calls=False)
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "add_pet"
    jsonschema.validate(json.loads(call.function.arguments), PET)
