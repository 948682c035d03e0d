"""OpenAI Predicted Outputs at the real gateway app over the in-process workers (tiny model with
SmolLM2's tokenizer, no Ray): ``prediction`` is validated (400s naming the field, OpenAI's
documented limitations), tokenized and carried to the verifier; usage reports accepted and
rejected prediction tokens (streamed: in the final usage chunk), and they add up to the
prediction drafts verified; the output is plain decode's."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from helpers.proposers import OracleProposer
from specmesh.cluster.inprocess import VERIFIER, InProcessCluster
from specmesh.gateway.app import create_app
from specmesh.gateway.backend import MailboxBackend
from specmesh.gateway.server import serve_gateway
from specmesh.protocol.messages import GenerateRequest

MAX_MODEL_LEN = 1024
MAX_TOKENS = 32
MESSAGES = [{"role": "user", "content": "Rewrite the function with a docstring."}]


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """A gateway over in-process workers whose method drafts nothing: every verified draft
    is a prediction draft, so the usage counts must equal the spec stats."""
    from specmesh.engine.loader import load_model

    loaded = load_model(tiny_model_dir, dtype="float32")
    c = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=8,
                         eos_token_ids=(), proposer=OracleProposer([], []))
    sent: list[GenerateRequest] = []
    send = c.client.send

    def record(peer, msg):
        if isinstance(msg, GenerateRequest):
            sent.append(msg)
        return send(peer, msg)

    c.client.send = record  # type: ignore[method-assign]
    stop = threading.Event()

    def drive():
        while not stop.is_set():
            c.drafter.step()
            c.prefill.step()
            c.verifier.step()
            time.sleep(0.001)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    backend = MailboxBackend(c.client, lambda: VERIFIER, recv_timeout_s=0.1)
    app = create_app(backend, loaded.tokenizer, "tiny", MAX_MODEL_LEN,
                     default_max_tokens=MAX_TOKENS, default_temperature=0.0)
    server, _, port = serve_gateway(app)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    yield {"client": client, "tok": loaded.tokenizer, "sent": sent, "port": port}
    client.close()
    server.stop()
    backend.close()
    stop.set()
    thread.join(5)


def _chat(client, **fields) -> httpx.Response:
    return client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
        "return_token_ids": True, **fields})


PRED = {"type": "content", "content": "def f():\n    return 1\n"}


@pytest.mark.parametrize("prediction, what", [
    ("def f(): pass", 'prediction must be {"type": "content"'),
    ({"type": "text", "content": "x"}, 'prediction must be {"type": "content"'),
    ({"type": "content"}, 'prediction must be {"type": "content"'),
    ({"type": "content", "content": 7}, "a string or a list of text parts"),
    ({"type": "content", "content": [{"type": "image_url", "image_url": "x"}]},
     "content parts must be"),
    ({"type": "content", "content": [{"type": "text", "text": 3}]}, "content parts must be"),
    ({"type": "content", "content": "x", "extra": 1}, "unknown fields"),
])
def test_a_malformed_prediction_is_a_400(served, prediction, what):
    r = _chat(served["client"], prediction=prediction)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prediction" and what in err["message"], err


@pytest.mark.parametrize("field, value", [
    ("n", 2), ("logprobs", True), ("top_logprobs", 2), ("presence_penalty", 0.5),
    ("frequency_penalty", 1.0), ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("functions", [{"name": "f"}]), ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]), ("max_completion_tokens", 8),
])
def test_what_openai_refuses_with_a_prediction_is_a_400_naming_it(served, field, value):
    r = _chat(served["client"], prediction=PRED, **{field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "prediction cannot be combined with" in err["message"]
    assert field in err["message"]


def test_neutral_values_and_max_tokens_pass_with_a_prediction(served):
    r = _chat(served["client"], prediction=PRED, n=1, logprobs=False, presence_penalty=0,
              frequency_penalty=0, tools=[], modalities=["text"])
    assert r.status_code == 200, r.text


def test_an_oversized_prediction_is_a_400(served):
    too_many_tokens = " ".join(["word"] * (MAX_MODEL_LEN + 10))
    r = _chat(served["client"], prediction={"type": "content", "content": too_many_tokens})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prediction"
    assert "max_model_len" in r.json()["error"]["message"]
    huge = "x" * (40 * MAX_MODEL_LEN)  # refused before tokenizing
    r = _chat(served["client"], prediction={"type": "content", "content": huge})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]


def test_the_prediction_is_tokenized_without_template_and_sent(served):
    tok = served["tok"]
    parts = [{"type": "text", "text": "def f():\n"}, {"type": "text", "text": "    return 1\n"}]
    r = _chat(served["client"], prediction={"type": "content", "content": parts})
    assert r.status_code == 200, r.text
    sent = served["sent"][-1]
    assert sent.prediction_token_ids == list(
        tok("def f():\n    return 1\n", add_special_tokens=False)["input_ids"])
    r = _chat(served["client"])
    assert served["sent"][-1].prediction_token_ids is None
    assert "completion_tokens_details" not in r.json()["usage"]


def _counts(body: dict) -> tuple[int, int]:
    d = body["usage"]["completion_tokens_details"]
    return d["accepted_prediction_tokens"], d["rejected_prediction_tokens"]


def test_usage_counts_add_up_and_the_output_is_plain_decode(served):
    client, tok = served["client"], served["tok"]
    plain = _chat(client, num_speculative_tokens=0).json()
    ids = plain["choices"][0]["token_ids"]
    text = plain["choices"][0]["message"]["content"]
    # the model's own output as the prediction: drafted from, nearly all accepted
    r = _chat(client, prediction={"type": "content", "content": text}).json()
    assert r["choices"][0]["token_ids"] == ids
    accepted, rejected = _counts(r)
    spec = r["spec_stats"]
    assert accepted == spec["num_accepted_tokens"] > len(ids) // 2
    assert accepted + rejected == spec["num_draft_tokens"]
    # an edited prediction: the same output, some drafts rejected
    pred_ids = list(tok(text, add_special_tokens=False)["input_ids"])
    edited = pred_ids[:6] + [pred_ids[6] + 1] + pred_ids[7:18] + pred_ids[21:]
    r = _chat(client, prediction={"type": "content", "content": tok.decode(edited)}).json()
    assert r["choices"][0]["token_ids"] == ids
    accepted, rejected = _counts(r)
    assert accepted > 0 and rejected > 0
    assert accepted + rejected == r["spec_stats"]["num_draft_tokens"]


def test_streamed_usage_carries_the_counts_in_the_final_chunk(served):
    client = served["client"]
    text = _chat(client, num_speculative_tokens=0).json()["choices"][0]["message"]["content"]
    body = {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "prediction": {"type": "content", "content": text}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    final = events[-1]
    assert final["choices"] == [] and all(e["usage"] is None for e in events[:-1])
    accepted, rejected = _counts(final)
    assert accepted > 0 and accepted + rejected == final["spec_stats"]["num_draft_tokens"]


def test_completions_take_a_prediction_too(served):
    client = served["client"]
    body = {"prompt": "1 2 3 4", "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    plain = client.post("/v1/completions", json={**body, "num_speculative_tokens": 0}).json()
    text = plain["choices"][0]["text"]
    r = client.post("/v1/completions",
                    json={**body, "prediction": {"type": "content", "content": text}}).json()
    assert r["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    assert _counts(r)[0] > 0


def test_the_openai_client_reads_the_usage_fields(served):
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{served['port']}/v1", api_key="x",
                    max_retries=0)
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                           temperature=0)
    text = plain.choices[0].message.content
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                         temperature=0,
                                         prediction={"type": "content", "content": text})
    assert out.choices[0].message.content == text
    details = out.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens >= 0


# -- a stop string found by the gateway (no model) ---------------------------------------------


class _Bytes:
    """Token i is byte i."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class _Backend:
    def __init__(self, msgs) -> None:
        self.msgs = msgs
        self.aborts = []

    async def generate(self, req):
        for m in self.msgs:
            yield m

    def abort(self, request_id, reason, num_output_tokens=None) -> None:
        self.aborts.append(num_output_tokens)


def test_a_stop_string_cuts_the_prediction_counts_with_the_spec_stats():
    import asyncio

    from specmesh.gateway.generation import RequestRun
    from specmesh.protocol.messages import SamplingParams, TokenStream

    first = TokenStream(request_id="r", token_ids=list(b"a"))
    # one verify step: 8 prediction drafts, 7 accepted, "STOP" ends the output 6 tokens in
    step = TokenStream(request_id="r", token_ids=list(b"cdSTOPxy"), offset=1,
                       num_draft_tokens=8, num_accepted_tokens=7, num_verify_steps=1,
                       num_accepted_prediction_tokens=7, num_rejected_prediction_tokens=1)
    backend = _Backend([first, step])
    req = GenerateRequest(request_id="r", prompt_token_ids=[1], sampling=SamplingParams(),
                          prediction_token_ids=[5])
    run = RequestRun(backend, _Bytes(), req, ["STOP"])

    async def drain():
        return [ev async for ev in run.events()]

    asyncio.run(drain())
    assert backend.aborts == [7] and run.num_output_tokens == 7
    assert (run.stats.num_draft_tokens, run.stats.num_accepted_tokens) == (6, 6)
    assert (run.num_accepted_prediction_tokens, run.num_rejected_prediction_tokens) == (6, 0)


def test_completions_refuse_the_same_combinations(served):
    body = {"prompt": "1 2 3", "max_tokens": 4, "prediction": PRED}
    for field, value in (("max_completion_tokens", 4), ("n", 3), ("logprobs", 1)):
        r = served["client"].post("/v1/completions", json={**body, field: value})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and "prediction cannot be combined" in err["message"]
