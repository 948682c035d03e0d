"""The adaptive-speculation sweep's option parsing (``--kappas``, ``--policy``) and its report
logic: the systems of a level, the policy / best fixed comparison, the kappa timeline from
sampled counters and the markdown table; no cluster."""

from __future__ import annotations

import argparse

import pytest

from specmesh.benchmarks.harness.options import (
    add_bench_options,
    parse_kappas,
    parse_policies,
    sweep_options,
)
from specmesh.benchmarks.harness.render import sweep_markdown
from specmesh.benchmarks.harness.report import (
    SERVED_PLAIN,
    kappa_timeline,
    policy_vs_best_fixed,
    summarize,
    sweep_systems,
)
from specmesh.cluster.runs import RunResult


def test_kappas_parse_with_zero_first():
    assert parse_kappas("0,1,3,5") == [0, 1, 3, 5]
    assert parse_kappas("3, 1,3") == [0, 3, 1]  # k = 0, the reference, added
    for bad, why in (("", "no kappa"), ("1,x", "not an integer"), ("-1", ">= 0")):
        with pytest.raises(SystemExit, match=why):
            parse_kappas(bad)


def test_policies_parse():
    assert parse_policies("schedule,goodput,schedule") == ("schedule", "goodput")
    with pytest.raises(SystemExit, match="fixed kappas are --kappas"):
        parse_policies("fixed")
    with pytest.raises(SystemExit, match="unknown policy 'eagle'"):
        parse_policies("eagle")
    with pytest.raises(SystemExit, match="no policy"):
        parse_policies(" , ")


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_bench_options(p)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    return p.parse_args(list(argv))


def test_sweep_options_from_the_command_line():
    assert sweep_options(_args()) == {}  # the plain bench
    assert sweep_options(_args("--kappas", "0,1,3,5", "--policy", "schedule,goodput")) == {
        "kappas": [0, 1, 3, 5], "policies": ("schedule", "goodput")}
    # a policy alone: compared with k = 0 and the cluster's kappa
    assert sweep_options(_args("--policy", "goodput")) == {"kappas": [0, 4],
                                                          "policies": ("goodput",)}
    assert sweep_options(_args("--kappas", "0,2")) == {"kappas": [0, 2], "policies": ()}
    with pytest.raises(SystemExit, match="which is 0"):
        sweep_options(_args("--kappas", "0", "--policy", "goodput"))


def test_sweep_systems_of_a_level():
    systems = sweep_systems([0, 1, 3], ("schedule", "goodput"), ["ngram", "eagle"])
    names = [s.name for s in systems]
    assert names == [SERVED_PLAIN, "served k=1 ngram", "served k=3 ngram",
                     "served schedule ngram", "served goodput ngram", "served k=1 eagle",
                     "served k=3 eagle", "served schedule eagle", "served goodput eagle"]
    by = {s.name: s for s in systems}
    assert by["served goodput eagle"].kappa == 3  # adapts within the largest kappa
    assert by["served goodput eagle"].policy == "goodput"
    assert by["served k=1 ngram"].policy == "fixed"
    assert all(s.plain == SERVED_PLAIN for s in systems[1:])


def _sys(tps: float) -> dict:
    return {"median_tokens_per_s": tps}


def test_policy_is_compared_with_the_best_fixed_of_its_method():
    systems = sweep_systems([0, 1, 3], ("goodput",), ["ngram", "eagle"])
    measured = {SERVED_PLAIN: _sys(10.0), "served k=1 ngram": _sys(12.0),
                "served k=3 ngram": _sys(15.0), "served goodput ngram": _sys(14.4),
                "served k=1 eagle": _sys(9.0), "served k=3 eagle": _sys(8.0),
                "served goodput eagle": _sys(10.5)}
    got = policy_vs_best_fixed(measured, systems)
    assert got["served goodput ngram"]["best_fixed"] == "served k=3 ngram"
    assert got["served goodput ngram"]["ratio"] == pytest.approx(0.96)
    # eagle's fixed kappas lose to plain decode: the policy is held to k = 0's tokens/s
    assert got["served goodput eagle"]["best_fixed"] == SERVED_PLAIN
    assert got["served goodput eagle"]["ratio"] == pytest.approx(1.05)
    # a policy without any measured fixed system is left out
    assert policy_vs_best_fixed({"served goodput ngram": _sys(1.0)}, systems) == {}


def test_kappa_timeline_from_sampled_counters():
    samples = [(0.0, 3, 100, 50), (0.5, 3, 130, 60), (1.0, 1, 130, 60), (1.5, 1, 140, 70)]
    assert kappa_timeline(samples) == [
        {"t": 0.5, "kappa": 3, "drafts_per_step": 3.0},
        {"t": 1.0, "kappa": 1, "drafts_per_step": None},  # no step ran
        {"t": 1.5, "kappa": 1, "drafts_per_step": 1.0}]
    assert kappa_timeline(samples[:1]) == []


def _run(name: str, tps: float, ids: list[list[int]], timeline=None) -> RunResult:
    return RunResult(name, seconds=10.0 / tps, num_tokens=10, texts=["a"] * len(ids),
                     token_ids=ids, kappa_timeline=timeline)


def test_summary_and_markdown_of_a_sweep():
    systems = sweep_systems([0, 2], ("goodput",), ["ngram"])
    ids = [[1, 2, 3]]
    tl = [{"t": 0.5, "kappa": 2, "drafts_per_step": 1.5}]
    runs = {1: {SERVED_PLAIN: [_run(SERVED_PLAIN, 10.0, ids)],
                "served k=2 ngram": [_run("served k=2 ngram", 20.0, ids)],
                "served goodput ngram": [_run("served goodput ngram", 19.0, ids, tl)]}}
    summary = summarize({"model": "m"}, runs, {1: systems})
    level = summary["levels"]["1"]
    assert level["systems"]["served goodput ngram"]["kappa_timeline"] == [tl]
    assert level["systems"]["served goodput ngram"]["exact"] is True
    assert level["policy_vs_best_fixed"]["served goodput ngram"]["ratio"] == \
        pytest.approx(0.95)
    assert level["ratios"]["served goodput ngram / best fixed (served k=2 ngram)"] == \
        pytest.approx(0.95)
    table = "\n".join(sweep_markdown(summary))
    assert "| served goodput ngram | 0.95x (served k=2 ngram, 1.50 drafts/step) |" in table
    assert sweep_markdown({"levels": {}}) == []


def test_confidence_calibration_table_and_reliability_panel(tmp_path):
    from specmesh.benchmarks.harness.render import calibration_markdown, write_plot
    from specmesh.decode.confidence_budget import ConfidenceBudget

    assert parse_policies("confidence") == ("confidence",)
    budget = ConfidenceBudget()
    budget.observe_step([[0.9, 0.9], [0.5]], [2, 0])  # predicted .9 + .81 + .5, realised 2
    budget.stats.num_fallback_steps = 1
    systems = sweep_systems([0, 2], ("confidence",), ["ngram"])
    ids = [[1, 2, 3]]
    runs = {1: {SERVED_PLAIN: [_run(SERVED_PLAIN, 10.0, ids)],
                "served k=2 ngram": [_run("served k=2 ngram", 20.0, ids)],
                "served confidence ngram": [_run("served confidence ngram", 19.0, ids)]}}
    summary = summarize({"model": "m"}, runs, {1: systems})
    summary["sweep"] = {"kappas": [0, 2], "policies": ["confidence"]}
    summary["confidence_calibration"] = {"ngram (confidence)": budget.stats.as_dict()}
    table = "\n".join(calibration_markdown(summary))
    assert "| ngram (confidence) | 1 | 2.21 | 2 | 0.21 |" in table
    assert calibration_markdown({"levels": {}}) == []
    path = tmp_path / "plot.png"
    write_plot(summary, str(path))
    assert path.stat().st_size > 0
