"""The bench's summary and tables split by prompt category (the workload set's chat, code-edit,
...): tokens/s per client, the ratio to kappa = 0, acceptance, output identity and Predicted
Outputs tokens per category; the config's notes in the header (pure: no cluster, no model)."""

from __future__ import annotations

import pytest

from specmesh.benchmarks.harness.render import category_markdown, markdown
from specmesh.benchmarks.harness.report import (
    HF_BASELINE,
    category_summary,
    prediction_totals,
    summarize,
    systems_for,
)
from specmesh.cluster.runs import PredictionTokens, RequestLatency, RunResult
from specmesh.protocol.spec_stats import SpecStats

CATS = ["chat", "code-edit", "chat", "code-edit"]


def _streamed(name, tokens, seconds, ids, spec=None, pred=None, cleared=None) -> RunResult:
    """A served pass: per request its tokens, time to its last token, spec stats, prediction
    tokens."""
    lat = [RequestLatency(0.1, s, n) for n, s in zip(tokens, seconds)]
    specs = [SpecStats(*x) for x in spec] if spec else [SpecStats() for _ in tokens]
    run = RunResult(name, seconds=sum(seconds), num_tokens=sum(tokens), texts=["t"] * 4,
                    token_ids=ids, latencies=lat, request_seconds=list(seconds),
                    request_spec=specs, request_prediction=list(pred or [None] * 4),
                    history_cleared=cleared)
    for s in specs:
        run.spec.add(s)
    return run


IDS = [[1], [2], [3], [4]]
SPEC = [(4, 2, 2), (10, 9, 2), (4, 0, 2), (10, 7, 2)]
PRED = [None, PredictionTokens(9, 1), None, PredictionTokens(7, 3)]


def _runs() -> dict[str, list[RunResult]]:
    edited = [[1], [2], [3], [9]]  # request 3 (a code edit) differs from kappa = 0
    return {
        # chat: 20 tokens in 2 s; code-edit: 20 tokens in 1 s, then 0.5 s
        "served k=4 ngram": [
            _streamed("served k=4 ngram", [10, 10, 10, 10], [1.0, 0.5, 1.0, 0.5], edited,
                      SPEC, PRED, cleared=True),
            _streamed("served k=4 ngram", [10, 10, 10, 10], [1.0, 0.25, 1.0, 0.25], edited,
                      SPEC, PRED, cleared=True)],
        # chat: 20 tokens in 4 s; code-edit: 20 tokens in 4 s
        "served k=0": [_streamed("served k=0", [10, 10, 10, 10], [2.0, 2.0, 2.0, 2.0], IDS,
                                 cleared=True)],
        "in-process k=4 ngram": [RunResult("in-process k=4 ngram", seconds=1.0, num_tokens=4,
                                           texts=["t"] * 4, token_ids=IDS,
                                           request_spec=[SpecStats(*x) for x in SPEC])],
        "in-process k=0": [RunResult("in-process k=0", seconds=1.0, num_tokens=4,
                                     texts=["t"] * 4, token_ids=IDS)],
        HF_BASELINE: [RunResult(HF_BASELINE, seconds=2.0, num_tokens=4, texts=["t"] * 4,
                                token_ids=IDS, request_seconds=[0.5] * 4)],
    }


def _summary(categories=CATS) -> dict:
    config = {"model": "tiny", "dtype": "float32", "kappa": 4, "max_tokens": 10,
              "num_prompts": 4, "repeats": 2, "threads": {"verifier": 2},
              "notes": ["drafters' history: cleared before every served pass"]}
    systems = [s for s in systems_for(4, 2) if s.name in _runs()]
    return summarize(config, {2: _runs()}, {2: systems}, None,
                     {2: categories} if categories else None)


def test_each_system_split_by_category():
    lv = _summary()["levels"]["2"]
    assert lv["categories"] == ["chat", "code-edit"]
    spec = lv["systems"]["served k=4 ngram"]["categories"]
    assert list(spec) == ["chat", "code-edit"]
    chat, edit = spec["chat"], spec["code-edit"]
    assert chat["num_requests"] == edit["num_requests"] == 2
    assert chat["all_tokens_per_s"] == pytest.approx([10.0, 10.0])
    assert edit["all_tokens_per_s"] == pytest.approx([20.0, 40.0])
    assert edit["median_tokens_per_s"] == pytest.approx(30.0)
    # over the same category of served k=0 (20 tokens in 4 s: 5 tokens/s)
    assert chat["ratio_to_k0"] == pytest.approx(2.0)
    assert edit["ratio_to_k0"] == pytest.approx(6.0)
    # spec stats summed over both repeats, per category
    assert chat["spec_stats"]["num_draft_tokens"] == 16 and chat["acceptance_rate"] == 0.25
    assert edit["acceptance_rate"] == pytest.approx(32 / 40)
    assert chat["identical_to_k0"] == [True, True] and chat["exact"] is True
    assert edit["identical_to_k0"] == [True, False] and edit["exact"] is False
    assert chat["prediction_tokens"] is None
    assert edit["prediction_tokens"] == {"accepted": 32, "rejected": 8, "num_requests": 4}
    served = lv["systems"]["served k=4 ngram"]
    assert served["prediction_tokens"] == edit["prediction_tokens"]
    assert served["history_cleared"] == [True, True]
    # the totals are unchanged by the split, and the mismatch is still flagged
    assert served["exact"] is False
    assert lv["mismatches"] == [{"concurrency": 2, "system": "served k=4 ngram",
                                 "plain": "served k=0", "requests": [3]}]


def test_systems_without_per_request_times_have_acceptance_but_no_rate():
    lv = _summary()["levels"]["2"]
    inproc = lv["systems"]["in-process k=4 ngram"]["categories"]["code-edit"]
    assert inproc["median_tokens_per_s"] is None and inproc["ratio_to_k0"] is None
    assert inproc["acceptance_rate"] == pytest.approx(16 / 20)
    plain = lv["systems"]["in-process k=0"]["categories"]["chat"]
    assert plain["acceptance_rate"] is None and plain["identical_to_k0"] is None
    # a batched HF request is charged its batch's time
    hf = lv["systems"][HF_BASELINE]["categories"]["chat"]
    assert hf["median_tokens_per_s"] == pytest.approx(2.0)
    assert "history_cleared" not in lv["systems"][HF_BASELINE]


def test_category_markdown():
    text = markdown(_summary())
    assert "- drafters' history: cleared before every served pass" in text
    assert "### by category, concurrency 2" in text
    assert ("| category | system | requests | tokens/s per client | x k=0 | acceptance | "
            "mean accept len | identical k=K vs k=0 | prediction tokens accepted / rejected |"
            ) in text
    assert "| chat | served k=4 ngram | 2 | 10.00 | 2.00 | 0.25 | 0.50 | 2/2 |  |" in text
    assert ("| code-edit | served k=4 ngram | 2 | 30.00 | 6.00 | 0.80 | 4.00 | "
            "**1/2 MISMATCH** | 32 / 8 |") in text
    assert "| code-edit | in-process k=4 ngram | 2 |  |  | 0.80 | 4.00 | 2/2 |  |" in text
    assert "| chat | hf generate | 2 | 2.00 |  |  |  |  |  |" in text
    assert ("- prediction tokens accepted / rejected, served k=4 ngram: 32 / 8 "
            "(4 responses)") in text


def test_no_split_without_categories_or_with_one():
    lv = _summary(None)["levels"]["2"]
    assert lv["categories"] is None
    assert all("categories" not in s for s in lv["systems"].values())
    assert "by category" not in markdown(_summary(None))
    one = _summary(["user"] * 4)["levels"]["2"]
    assert one["categories"] == ["user"] and category_markdown(one) == []
    # one category: every request; 40 tokens in 3 s and 2.5 s, k=0 40 in 8 s
    user = one["systems"]["served k=4 ngram"]["categories"]["user"]
    assert user["median_tokens_per_s"] == pytest.approx((40 / 3 + 40 / 2.5) / 2)
    assert user["ratio_to_k0"] == pytest.approx((40 / 3 + 40 / 2.5) / 2 / 5.0)


def test_category_summary_and_prediction_totals_alone():
    runs = _runs()["served k=4 ngram"]
    assert prediction_totals(runs, {1}) == {"accepted": 18, "rejected": 2, "num_requests": 2}
    assert prediction_totals(runs, {0, 2}) is None
    rows = category_summary(runs, ["a", "a", "b", "b"], None, checked=False)
    assert list(rows) == ["a", "b"]
    assert rows["a"]["identical_to_k0"] is None and rows["a"]["exact"] is None
    assert rows["b"]["spec_stats"]["num_draft_tokens"] == 28
