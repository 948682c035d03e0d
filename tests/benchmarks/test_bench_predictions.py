"""The bench's served client against a fake gateway (tests/helpers/fake_gateway.py, no model):
each prompt's ``prediction`` sent as OpenAI's Predicted Outputs and the accepted / rejected
prediction tokens of its usage recorded per request; per-request times and spec stats; the
drafters' history cleared on the gateway before every served pass, a 404 recorded as "cannot",
any other error raised; a server that refuses predictions stops the bench before its passes."""

from __future__ import annotations

import pytest

from helpers.fake_gateway import FakeGateway
from specmesh.benchmarks.harness import systems
from specmesh.benchmarks.harness.report import verifier_snapshot
from specmesh.cluster.runs import (
    CLEAR_HISTORY_PATH,
    PredictionTokens,
    clear_drafter_history,
    openai_client,
    prediction_tokens_of,
    run_openai_concurrent,
)

CHAT = "/v1/chat/completions"
PROMPTS = [
    {"name": "ask", "category": "chat", "messages": [{"role": "user", "content": "a b c"}]},
    {"name": "edit", "category": "code-edit", "prediction": "p q r s t u",
     "messages": [{"role": "user", "content": "x y"}]},
    {"name": "edit2", "category": "code-edit", "prediction": "p q",
     "messages": [{"role": "user", "content": "z"}]},
]


@pytest.mark.parametrize("stream", [True, False])
def test_predictions_sent_and_their_usage_recorded_per_request(stream):
    with FakeGateway() as gw:
        res = run_openai_concurrent(openai_client(gw.url), "m", PROMPTS, 4, "s", 2,
                                    stream=stream, predictions=True)
    bodies = {b["messages"][0]["content"]: b for _, b in gw.requests}
    assert "prediction" not in bodies["a b c"]
    assert bodies["x y"]["prediction"] == {"type": "content", "content": "p q r s t u"}
    assert bodies["z"]["prediction"] == {"type": "content", "content": "p q"}
    assert all(b["return_token_ids"] is True for b in bodies.values())  # still asked for
    # 6 predicted words, 4 tokens: 4 accepted, 2 rejected; 2 words: both accepted
    assert res.request_prediction == [None, PredictionTokens(4, 2), PredictionTokens(2, 0)]
    assert [s.num_draft_tokens for s in res.request_spec] == [0, 6, 2]
    assert res.spec.num_draft_tokens == 8 and res.spec.num_accepted_tokens == 6
    assert len(res.request_seconds) == 3 and all(t > 0 for t in res.request_seconds)
    assert res.request_tokens == [4, 4, 4]


def test_predictions_off_sends_none():
    with FakeGateway(refuse_prediction=True) as gw:
        res = run_openai_concurrent(openai_client(gw.url), "m", PROMPTS, 3, "s", 1,
                                    stream=True)
    assert all("prediction" not in b for _, b in gw.requests)
    assert res.request_prediction == [None, None, None]


def test_prediction_tokens_of_objects_and_dicts():
    assert prediction_tokens_of(None) is None
    assert prediction_tokens_of({"completion_tokens": 3}) is None
    assert prediction_tokens_of({"completion_tokens_details": {
        "accepted_prediction_tokens": 5, "rejected_prediction_tokens": None}}) == \
        PredictionTokens(5, 0)
    assert PredictionTokens(1, 2) + PredictionTokens(3, 4) == PredictionTokens(4, 6)


def test_clear_history_answers():
    with FakeGateway() as gw:
        assert clear_drafter_history(gw.url) is True
        assert gw.paths() == [CLEAR_HISTORY_PATH]
    with FakeGateway(clear_status=404) as gw:
        assert clear_drafter_history(gw.url + "/") is False
    with FakeGateway(clear_status=500) as gw:
        with pytest.raises(RuntimeError, match=r"clear_history: HTTP 500: .*unreachable"):
            clear_drafter_history(gw.url)
    with pytest.raises(RuntimeError, match="no answer"):
        clear_drafter_history(gw.url, timeout_s=2)  # stopped: nothing listens


class _Handle:
    """What run_served uses of a ClusterHandle: its gateway's URL and key, the kappa switch."""

    def __init__(self, gw: FakeGateway) -> None:
        self.url, self.gw = gw.url, gw
        self.api_key = None  # the fake gateway takes any request
        self.kappas: list[int] = []

    def set_num_speculative_tokens(self, kappa: int) -> None:
        self.kappas.append(kappa)
        self.gw.record(f"kappa={kappa}", {})


@pytest.fixture
def no_ray(monkeypatch):
    """The verifiers' counters (a Ray call each, served) as an empty snapshot."""
    monkeypatch.setattr(systems, "served_snapshot", lambda handle: verifier_snapshot({}))


@pytest.mark.parametrize("clear_status,cleared", [(200, True), (404, False)])
def test_every_served_pass_clears_the_history_first(no_ray, clear_status, cleared):
    with FakeGateway(clear_status=clear_status) as gw:
        handle, client = _Handle(gw), openai_client(gw.url)
        runs = [systems.run_served(handle, client, "m", PROMPTS[:2], 3, kappa, 1, f"k={kappa}",
                                   predictions=True) for kappa in (4, 0, 4)]
    # per pass: kappa set, history cleared, then the pass's requests
    assert gw.paths() == ["kappa=4", CLEAR_HISTORY_PATH, CHAT, CHAT,
                          "kappa=0", CLEAR_HISTORY_PATH, CHAT, CHAT,
                          "kappa=4", CLEAR_HISTORY_PATH, CHAT, CHAT]
    assert [r.history_cleared for r in runs] == [cleared] * 3
    # predictions at kappa > 0 only: kappa = 0 stays plain decode
    sent = ["prediction" in b for p, b in gw.requests if p == CHAT]
    assert sent == [False, True, False, False, False, True]
    assert runs[1].request_prediction == [None, None]
    assert runs[2].request_prediction == [None, PredictionTokens(3, 3)]


def test_served_pass_without_clearing_and_a_failing_clear(no_ray):
    with FakeGateway() as gw:
        res = systems.run_served(_Handle(gw), openai_client(gw.url), "m", PROMPTS[:1], 2, 4,
                                 1, "s", clear_history=False)
    assert CLEAR_HISTORY_PATH not in gw.paths() and res.history_cleared is None
    with FakeGateway(clear_status=500) as gw:
        with pytest.raises(RuntimeError, match="HTTP 500"):
            systems.run_served(_Handle(gw), openai_client(gw.url), "m", PROMPTS, 2, 4, 1, "s")
        assert CHAT not in gw.paths()  # no pass on a cluster whose history stayed


def test_a_server_refusing_predictions_stops_the_bench_early():
    with FakeGateway(refuse_prediction=True) as gw:
        client = openai_client(gw.url)
        with pytest.raises(SystemExit, match=r"prompt 'edit'.*--predictions off"):
            systems.check_predictions(client, "m", PROMPTS)
        assert systems.check_predictions(client, "m", PROMPTS[:1]) is False  # none to send
    with FakeGateway() as gw:
        assert systems.check_predictions(openai_client(gw.url), "m", PROMPTS) is True
        (_, body), = gw.requests
        assert body["prediction"]["content"] == "p q r s t u"


# -- the options and the report's notes ----------------------------------------------------------


def test_options_predictions_and_the_workload_set():
    from specmesh.benchmarks.harness.bench import bench_prompts
    from specmesh.benchmarks.harness.options import bench_options
    from specmesh.cluster.cli import build_parser
    from specmesh.data.prompts import load_workloads

    def opts(*argv):
        return bench_options(build_parser().parse_args(["bench", *argv]))

    assert opts().predictions is True and opts().prompts_file is None
    assert opts("--predictions", "off").predictions is False
    with pytest.raises(SystemExit):
        opts("--predictions", "maybe")
    got = bench_prompts(opts("--prompts", "workloads", "--num-prompts", "8"))
    assert got == load_workloads()[:8]
    assert [p["category"] for p in got[6:8]] == ["code-edit"] * 2


def test_notes_say_what_was_cleared_and_sent():
    from specmesh.benchmarks.harness.report import WARMUP_NOTE, run_notes

    prompts = PROMPTS  # two of three carry a prediction
    notes = run_notes(prompts, [1, 4], {"ngram": [True, True], "suffix": [False, False]},
                      predictions=True)
    assert notes[0].startswith("drafters' cross-request memory cleared through the gateway "
                               f"(POST {CLEAR_HISTORY_PATH}) before every served pass (ngram)")
    assert notes[1].startswith("**drafters' cross-request memory NOT cleared on the suffix "
                               "cluster (2 of 2 passes)") and "HTTP 404" in notes[1]
    assert notes[2] == WARMUP_NOTE  # served passes: each prompt sent once before them
    assert notes[3].startswith("concurrency 4: the 3 prompts are cycled to 4 requests")
    assert notes[4].startswith("Predicted Outputs: 2 of 3 prompts carry a prediction, sent")
    assert len(notes) == 5
    off = run_notes(prompts[:1], [1], {}, predictions=False)
    assert off == []  # no served pass, no prediction, no cycling: nothing to say
    off = run_notes(prompts, [1], {"ngram": [True]}, predictions=False)
    assert off[-1] == ("Predicted Outputs: 2 of 3 prompts carry a prediction, not sent "
                       "(--predictions off, or no kappa > 0 system)")
