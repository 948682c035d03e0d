"""The bench's pure parts: counter / profile deltas, aggregation, markdown, plot, the HF
batching helpers and the run schedule (no cluster, no model)."""

import pytest

from specmesh.benchmarks.harness.bench import _schedule
from specmesh.benchmarks.harness.systems import cut_at_eos, left_pad
from specmesh.benchmarks.harness.render import markdown, write_plot
from specmesh.benchmarks.harness.report import HF_BASELINE, same_outputs, summarize, systems_for
from specmesh.benchmarks.harness.report import (
    acceptance_per_position,
    bucket_quantile,
    merge_snapshots,
    profile_summary,
    snapshot_delta,
    step_cost_check,
    verifier_snapshot,
)
from specmesh.cluster.runs import RunResult
from specmesh.protocol.spec_stats import SpecStats
from specmesh.protocol.step_profile import StepProfile


def _profile(forward_ms: list[float], plain_ms: list[float], steps: int, with_drafts: int,
             with_tail: int = 0) -> dict:
    p = StepProfile()
    for ms in forward_ms:
        p.observe("forward_with_drafts", ms / 1e3)
    for ms in plain_ms:
        p.observe("forward_plain", ms / 1e3)
    p.count("num_steps", steps)
    p.count("num_steps_with_drafts", with_drafts)
    if with_tail:
        p.count("num_steps_with_tail", with_tail)
    return p.as_dict()


def test_snapshot_delta_counts_only_the_pass():
    before = verifier_snapshot({"num_draft_tokens": 4, "num_accepted_tokens": 2,
                                "num_verify_steps": 1, "num_accepted_tokens_per_pos": [1, 1],
                                "profile": _profile([3.0], [1.0], 2, 1)})
    after = verifier_snapshot({"num_draft_tokens": 10, "num_accepted_tokens": 5,
                               "num_verify_steps": 3, "num_accepted_tokens_per_pos": [3, 2, 0],
                               "profile": _profile([3.0, 4.0, 4.0], [1.0, 2.0], 5, 3)})
    d = snapshot_delta(before, after)
    assert (d["num_draft_tokens"], d["num_accepted_tokens"], d["num_verify_steps"]) == (6, 3, 2)
    assert d["num_accepted_tokens_per_pos"] == [2, 1, 0]
    ph = d["profile"]["phases"]
    assert ph["forward_with_drafts"]["count"] == 2
    assert ph["forward_with_drafts"]["mean_ms"] == pytest.approx(4.0)
    assert ph["forward_plain"]["count"] == 1
    assert d["profile"]["counters"] == {"num_steps": 3, "num_steps_with_drafts": 2}
    both = merge_snapshots([before, after])
    assert both["num_accepted_tokens_per_pos"] == [4, 3, 0]
    assert both["profile"]["phases"]["forward_plain"]["count"] == 3


def test_bucket_quantile_interpolates():
    counts = [0] * 17
    counts[6] = 4  # four observations in (2.5 ms, 5 ms]
    assert bucket_quantile(counts, 0.5) == pytest.approx(0.00375)
    assert bucket_quantile([0] * 17, 0.5) is None
    s = profile_summary(_profile([4.0] * 4, [], 4, 2, with_tail=3))
    assert s["phases"]["forward_with_drafts"]["p50_ms"] == pytest.approx(3.75)
    # supply (tails there when planned) and what the goodput caps let through, apart
    assert s["steps_with_tail_share"] == pytest.approx(0.75)
    assert s["steps_with_drafts_share"] == pytest.approx(0.5)
    assert s["request_steps_with_tail_share"] is None


def test_step_cost_check_and_acceptance_per_position():
    prof = _profile([5.0, 5.0], [4.0, 4.0], 4, 2)
    c = step_cost_check(prof, 1.2)
    assert c["bound_ms"] == pytest.approx(1.1 * 1.2 * 4.0)
    assert c["within_bound"] is True
    assert step_cost_check(prof, 1.0)["within_bound"] is False
    assert step_cost_check(prof, None)["within_bound"] is None
    assert c["without_drafts_from"] == "own plain steps"
    k0 = step_cost_check(_profile([5.0], [], 1, 1), 1.2, _profile([], [5.0], 3, 0))
    assert k0["without_drafts_from"] == "kappa=0 run"
    assert k0["bound_ms"] == pytest.approx(1.1 * 1.2 * 5.0)
    none = step_cost_check(_profile([5.0], [], 1, 1), 1.2)
    assert none["without_drafts_mean_ms"] is None and none["within_bound"] is None
    assert acceptance_per_position([6, 3, 1], 10) == [0.6, 0.3, 0.1]
    assert acceptance_per_position([0, 0], 0) == []


def test_hf_helpers():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids == [[5, 6, 7], [0, 0, 8]] and mask == [[1, 1, 1], [0, 0, 1]]
    assert cut_at_eos([4, 2, 0, 0], [2]) == [4, 2]
    assert cut_at_eos([4, 5], [2]) == [4, 5]


def test_schedule_interleaves_every_run():
    sched = _schedule([1, 2], kappa=3, repeats=2)
    assert len(sched) == 2 * (len(systems_for(3, 1)) + len(systems_for(3, 2)))
    first = [(lv, s.name) for r, lv, s in sched if r == 0]
    second = [(lv, s.name) for r, lv, s in sched if r == 1]
    assert sorted(first) == sorted(second) and first != second  # same runs, another order
    assert "hf prompt lookup k=3" in {s.name for s in systems_for(3, 1)}
    assert "hf prompt lookup k=3" not in {s.name for s in systems_for(3, 2)}


def _run(name, tps, texts, ids=None, spec=(0, 0, 0), per_pos=(), profile=None, c=1):
    return RunResult(name, seconds=1.0, num_tokens=tps, spec=SpecStats(*spec), texts=texts,
                     token_ids=ids, accepted_per_pos=list(per_pos), profile=profile,
                     concurrency=c)


def _fake_runs(level: int) -> dict:
    prof = _profile([5.0], [4.0, 4.0], 3, 1)
    runs = {
        "served k=2 ngram": [_run("served k=2 ngram", 30, ["a", "b"], spec=(4, 2, 2),
                                  per_pos=[2, 0, 0], profile=prof),
                             _run("served k=2 ngram", 34, ["a", "b"], spec=(4, 2, 2),
                                  per_pos=[1, 1], profile=prof)],
        "served k=0": [_run("served k=0", 20, ["a", "b"], profile=prof)],
        "in-process k=2 ngram": [_run("in-process k=2 ngram", 40, ["a", "x"], ids=[[1], [3]],
                                      spec=(4, 1, 2), per_pos=[1, 0], profile=prof)],
        "in-process k=0": [_run("in-process k=0", 25, ["a", "b"], ids=[[1], [2]])],
        HF_BASELINE: [_run(HF_BASELINE, 10, ["a", "b"], ids=[[1], [2]])],
    }
    if level == 1:
        runs["hf prompt lookup k=2"] = [_run("hf prompt lookup k=2", 15, ["a", "b"],
                                             ids=[[1], [2]])]
    return runs


def _summary() -> dict:
    config = {"model": "tiny", "dtype": "float32", "kappa": 2, "max_tokens": 8,
              "num_prompts": 2, "repeats": 2, "threads": {"verifier": 2}}
    fc = {"context_len": 200, "num_tokens": 3, "batch": 1, "single_ms": 4.0, "multi_ms": 5.0,
          "ratio": 1.25}
    fc2 = dict(fc, batch=2, single_ms=5.0, multi_ms=10.0, ratio=2.0)
    return summarize(config, {1: _fake_runs(1), 2: _fake_runs(2)},
                     {1: systems_for(2, 1), 2: systems_for(2, 2)}, {"1": fc, "2": fc2})


def test_summarize_medians_ratios_identity():
    s = _summary()
    assert set(s["levels"]) == {"1", "2"}
    lv = s["levels"]["1"]
    spec = lv["systems"]["served k=2 ngram"]
    assert spec["median_tokens_per_s"] == pytest.approx(32.0)
    assert spec["ratio_to_hf"] == pytest.approx(3.2)
    assert spec["acceptance_rate"] == pytest.approx(0.5)  # summed over both repeats
    assert spec["mean_accept_len"] == pytest.approx(1.0)
    assert spec["accepted_per_pos"] == [3, 1]
    assert spec["acceptance_per_position"] == [0.75, 0.25]
    assert spec["identical_to_hf"] == [True, True] and spec["identical_to_k0"] == [True, True]
    inproc = lv["systems"]["in-process k=2 ngram"]
    assert inproc["identical_to_hf"] == [True, False]  # token ids compared
    assert inproc["identical_to_k0"] == [True, False]
    assert lv["systems"][HF_BASELINE]["identical_to_hf"] is None
    assert lv["ratios"]["served k=2 ngram / served k=0"] == pytest.approx(1.6)
    assert lv["ratios"]["served k=2 ngram / in-process k=2 ngram"] == pytest.approx(0.8)
    assert spec["step_cost"]["bound_ms"] == pytest.approx(1.1 * 1.25 * 4.0)
    assert spec["step_cost"]["without_drafts_from"] == "kappa=0 run"
    assert (lv["systems"]["in-process k=2 ngram"]["step_cost"]["without_drafts_from"]
            == "own plain steps")
    assert "hf prompt lookup k=2" not in s["levels"]["2"]["systems"]
    # each level's steps are held to the forward cost of a batch that size
    spec2 = s["levels"]["2"]["systems"]["served k=2 ngram"]
    assert spec2["step_cost"]["forward_cost_ratio"] == pytest.approx(2.0)
    assert spec2["step_cost"]["bound_ms"] == pytest.approx(1.1 * 2.0 * 4.0)
    assert s["forward_cost"]["batch"] == 1 and set(s["forward_cost_by_level"]) == {"1", "2"}


def test_markdown_tables_and_profile():
    text = markdown(_summary())
    assert "## concurrency 1 (2 requests)" in text and "## concurrency 2 (2 requests)" in text
    assert ("| system | tokens/s | x HF | acceptance | mean accept len | acceptance per position "
            "| steps with drafts | accepted per step | identical to HF |") in text
    assert "- thread plan: served roles: verifier 2" in text
    assert "| served k=2 ngram | 32.00 | 3.20 | 0.50 | 1.00 | 0.75 / 0.25 |  |  | 2/2 | 2/2 |" in text
    assert ("| in-process k=2 ngram | 40.00 | 4.00 | 0.25 | 0.50 | 0.50 / 0.00 |  |  | 1/2 | "
            "**1/2 MISMATCH** |") in text
    assert ("**OUTPUT MISMATCH at concurrency 1: in-process k=2 ngram differs from "
            "in-process k=0 on request(s) 1**") in text
    assert "| hf generate | 10.00 | 1.00 |  |  |  |  |  |  |  |" in text
    assert "### verifier step profile, concurrency 1" in text
    assert "| forward_with_drafts |" in text and "| steps with a usable tail (supply) |" in text
    assert "bound 1.1 x ratio 1.25" in text
    assert "forward cost, batch 1 (3-token / 1-token forward per request" in text
    assert "= 1.25x" in text and "forward cost, batch 2" in text and "= 2.00x" in text


def test_same_outputs_prefers_token_ids():
    a = _run("a", 1, ["x", "y"], ids=[[1], [2]])
    b = _run("b", 1, ["x", "y"], ids=[[1], [3]])
    assert same_outputs(a, b) == [True, False]
    assert same_outputs(a, _run("c", 1, ["x", "z"])) == [True, False]


def test_plot_writes_png(tmp_path):
    path = tmp_path / "bench.png"
    write_plot(_summary(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_accepted_per_step_counts_every_request_step():
    """vLLM's mean accept length averages over steps with drafts; accepted_per_step over all
    request-steps, so a drafter that rarely proposes is charged for its silent steps."""
    from specmesh.benchmarks.harness.report import accepted_per_step
    from specmesh.protocol.spec_stats import SpecStats

    spec = SpecStats(num_draft_tokens=8, num_accepted_tokens=6, num_verify_steps=2)
    prof = {"counters": {"num_request_steps": 20, "num_request_steps_with_drafts": 2}}
    assert spec.mean_accept_len == 3.0
    assert accepted_per_step(spec, prof) == pytest.approx(0.3)
    assert accepted_per_step(spec, None) is None
    assert accepted_per_step(spec, {"counters": {}}) is None


def test_drafter_profiles_join_the_snapshot_under_their_prefix():
    from specmesh.benchmarks.harness.report import verifier_snapshot, with_drafter_profiles
    from specmesh.protocol.step_profile import StepProfile

    v, d1, d2 = StepProfile(), StepProfile(), StepProfile()
    v.observe("forward", 0.02)
    d1.observe("commit_to_tail", 0.003)
    d2.observe("commit_to_tail", 0.001)
    d2.count("run_ahead_tokens", 4)
    snap = with_drafter_profiles(verifier_snapshot({"profile": v.as_dict()}),
                                 [d1.as_dict(), d2.as_dict()])
    phases = snap["profile"]["phases"]
    assert set(phases) == {"forward", "drafter commit_to_tail"}
    assert phases["drafter commit_to_tail"]["count"] == 2
    assert abs(phases["drafter commit_to_tail"]["mean_ms"] - 2.0) < 1e-9
    assert snap["profile"]["counters"] == {"drafter run_ahead_tokens": 4}
