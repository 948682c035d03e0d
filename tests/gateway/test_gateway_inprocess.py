"""The real gateway app and MailboxBackend over the in-process workers (tiny model, no Ray):
a stop string found by the gateway ends usage, spec stats and metrics where it ended the
output, whatever kappa (issue 9 scenario 14)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from specmesh.gateway.app import create_app
from specmesh.gateway.backend import MailboxBackend
from specmesh.gateway.server import serve_gateway
from specmesh.gateway.tokens import completion_prompt_ids
from specmesh.cluster.inprocess import VERIFIER, InProcessCluster
from helpers.proposers import OracleProposer
from specmesh.protocol.messages import SamplingParams

PROMPT = "The old lighthouse keeper climbed the spiral stairs every evening"
MAX_TOKENS = 48
STEP_PAUSE_S = 0.02  # the verifier must still be running when the gateway's Abort arrives


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    from specmesh.engine.loader import load_model

    loaded = load_model(tiny_model_dir, dtype="float32")
    tok = loaded.tokenizer
    prompt_ids = completion_prompt_ids(tok, PROMPT)
    plain = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=0,
                             eos_token_ids=())
    (ref,) = plain.generate([prompt_ids], SamplingParams(max_tokens=MAX_TOKENS))
    ref_ids = ref.token_ids
    c = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=8,
                         eos_token_ids=(), proposer=OracleProposer([prompt_ids], [ref_ids]),
                         adaptive_drafts=False)
    stop = threading.Event()

    def drive():
        while not stop.is_set():
            c.drafter.step()
            c.prefill.step()
            c.verifier.step()
            time.sleep(STEP_PAUSE_S)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    backend = MailboxBackend(c.client, lambda: VERIFIER, recv_timeout_s=0.1)
    app = create_app(backend, tok, "tiny", 1024, default_max_tokens=MAX_TOKENS)
    server, _, port = serve_gateway(app)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    yield {"client": client, "cluster": c, "tok": tok, "ref": ref_ids}
    client.close()
    server.stop()
    backend.close()
    stop.set()
    thread.join(5)


def _stop_string(tok, ids: list[int], at: int) -> tuple[str, int]:
    """A stop string that first appears in the text when token ``at`` or later is added, and
    the number of tokens the output keeps (the one completing it included)."""
    for k in range(at, len(ids)):
        before = tok.decode(ids[:k], skip_special_tokens=True)
        piece = tok.decode(ids[:k + 1], skip_special_tokens=True)[len(before):].strip()
        full = tok.decode(ids, skip_special_tokens=True)
        if len(piece) >= 2 and full.find(piece) >= len(before) - 1 and piece not in before:
            return piece, k + 1
    raise AssertionError("no usable stop string in the reference output")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_stop_string_usage_and_spec_stats_do_not_depend_on_kappa(served, stream):
    client, c, tok, ref = served["client"], served["cluster"], served["tok"], served["ref"]
    stop, keep = _stop_string(tok, ref, 5)
    results = {}
    for kappa in (0, 4, 8):
        before = c.verifier.stats.num_accepted_tokens, c.verifier.stats.num_draft_tokens
        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stop": [stop],
                "num_speculative_tokens": kappa, "stream": stream, "return_token_ids": True}
        if stream:
            body["stream_options"] = {"include_usage": True}
            import json
            with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            text = "".join(ch["text"] for e in events for ch in e["choices"])
            ids = [t for e in events for ch in e["choices"] for t in ch.get("token_ids", [])]
            usage, spec = events[-1]["usage"], events[-1]["spec_stats"]
            finish = [ch["finish_reason"] for e in events for ch in e["choices"]][-1]
        else:
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            text, usage, spec = out["choices"][0]["text"], out["usage"], out["spec_stats"]
            ids = out["choices"][0]["token_ids"]
            finish = out["choices"][0]["finish_reason"]
        assert finish == "stop" and stop not in text
        assert ids == list(ref[:usage["completion_tokens"]])  # plain greedy's ids, up to the cut
        results[kappa] = (text, usage["completion_tokens"])
        n = usage["completion_tokens"]
        assert spec["num_accepted_tokens"] <= spec["num_draft_tokens"] <= n - 1
        if kappa:
            assert spec["num_accepted_tokens"] > 0  # the oracle's drafts were used
        # the verifier cut its own counters at the same place once the Abort arrived
        deadline = time.monotonic() + 10
        while c.verifier.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not c.verifier.requests
        st = c.verifier.stats
        assert (st.num_accepted_tokens - before[0], st.num_draft_tokens - before[1]) == (
            spec["num_accepted_tokens"], spec["num_draft_tokens"])
    assert results[0] == results[4] == results[8]
    assert results[0][1] == keep
