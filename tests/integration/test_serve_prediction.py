"""OpenAI Predicted Outputs end to end through the Ray cluster (prefill, verifier, drafter and
gateway in their own processes, ZMQ between them; tiny random Llama) with the ``openai`` client:
a prediction equal to the model's own greedy output is drafted from and nearly all accepted,
one that differs in a few places gets some drafts rejected, and either way the output token
ids equal plain decode's (speculation off)."""

from __future__ import annotations

import pytest

from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.launcher import start_cluster

pytestmark = pytest.mark.ray

MAX_TOKENS = 48
#: the tiny model's greedy answer to it survives decode -> encode (the prediction's tokens are
#: the output's: an exact prediction drafts only right tokens)
MESSAGES = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(ray_session, tiny_model_dir):
    from openai import OpenAI

    cfg = ClusterConfig.create(model=tiny_model_dir, dtype="float32", num_speculative_tokens=8,
                               kv_cache_mb=32, port=0, max_model_len=1024)
    handle = start_cluster(cfg)
    yield OpenAI(base_url=f"{handle.url}/v1", api_key="x", max_retries=0)
    handle.stop()


def _chat(client, **extra):
    """A greedy chat completion with the output ids (vLLM's ``return_token_ids``)."""
    prediction = extra.pop("prediction", None)
    kwargs = {"prediction": prediction} if prediction is not None else {}
    return client.chat.completions.create(
        model=None, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"return_token_ids": True, **extra}, **kwargs)


def _ids(out) -> list[int]:
    return out.choices[0].model_extra["token_ids"]


def test_prediction_drafts_are_accepted_and_the_output_is_plain_decode(client,
                                                                        smollm2_tokenizer):
    plain = _chat(client, num_speculative_tokens=0)
    want, text = _ids(plain), plain.choices[0].message.content
    assert len(want) == MAX_TOKENS and plain.usage.completion_tokens_details is None
    assert smollm2_tokenizer(text, add_special_tokens=False)["input_ids"] == want
    # the model's own output as the prediction
    out = _chat(client, prediction={"type": "content", "content": text})
    assert _ids(out) == want
    d = out.usage.completion_tokens_details
    assert d.accepted_prediction_tokens >= MAX_TOKENS // 2  # most of the output
    assert d.rejected_prediction_tokens == 0  # every prediction draft was the output's token
    spec = out.model_extra["spec_stats"]
    # prediction drafts are a part of the drafts the verifier checked
    assert d.accepted_prediction_tokens <= spec["num_accepted_tokens"]
    assert d.accepted_prediction_tokens + d.rejected_prediction_tokens \
        <= spec["num_draft_tokens"]
    # streamed: the counts come in the final usage chunk
    stream = client.chat.completions.create(
        model=None, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
        prediction={"type": "content", "content": text},
        extra_body={"return_token_ids": True})
    ids, usage = [], None
    for chunk in stream:
        for ch in chunk.choices:
            ids += ch.model_extra.get("token_ids") or []
        if chunk.usage is not None:
            usage = chunk.usage
    assert ids == want
    assert usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_a_prediction_that_differs_in_places_is_still_exact(client):
    plain = _chat(client, num_speculative_tokens=0)
    want, text = _ids(plain), plain.choices[0].message.content
    # three edits: a word replaced, a span deleted, a line inserted
    words = text.split(" ")
    assert len(words) > 8, text
    words[2] = "zebra"
    del words[5:7]
    edited = " ".join(words[:6]) + "\nan inserted line\n" + " ".join(words[6:])
    out = _chat(client, prediction={"type": "content", "content": edited})
    assert _ids(out) == want
    d = out.usage.completion_tokens_details
    assert d.accepted_prediction_tokens > 0 and d.rejected_prediction_tokens > 0
