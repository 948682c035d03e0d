"""``specmesh plan`` (cluster/plan_command.py): the table and ``--json`` of the chapter's
figures, and ``--from-bench``: this machine's break-even batch per drafter from a bench JSON
(cluster/plan_bench.py), on a summary shaped as ``specmesh bench --profile``
writes it."""

from __future__ import annotations

import json

import pytest

from specmesh.cluster.plan_bench import knee, machine_plan, measured_crossing
from specmesh.cluster.cli import main


def _system(kind, kappa, method, tps, shares=(), tail_wait_ms=None, propose_ms=None):
    phases = {}
    if tail_wait_ms is not None:
        phases["tail_wait"] = {"mean_ms": tail_wait_ms, "p50_ms": tail_wait_ms, "count": 9}
    if propose_ms is not None:
        phases["drafter propose"] = {"mean_ms": propose_ms, "p50_ms": propose_ms, "count": 9}
    return {"kind": kind, "kappa": kappa, "method": method, "median_tokens_per_s": tps,
            "acceptance_per_position": list(shares), "profile": {"phases": phases}}


def bench_summary() -> dict:
    """A bench run at kappa 3, concurrency 1, 4 and 16: forwards cost 10 ms + 0.1 ms per
    query token (T* = 100), n-gram accepts alpha = 0.7 geometrically and waits 0.5 ms a step
    for tails; measured speedup 1.3x, 1.1x, 0.8x."""
    def fc(batch):
        return {"context_len": 200, "num_tokens": 4, "batch": batch,
                "single_ms": 10 + 0.1 * batch, "multi_ms": 10 + 0.4 * batch}

    shares = [0.7, 0.49, 0.343]
    levels = {}
    for c, speed in ((1, 1.3), (4, 1.1), (16, 0.8)):
        levels[str(c)] = {"systems": {
            "served k=3 ngram": _system("served", 3, "ngram", 100 * speed, shares, 0.505, 0.05),
            "served k=0": _system("served", 0, None, 100.0),
            "in-process k=0": _system("inprocess", 0, None, 90.0),
            "hf generate": _system("hf", 0, None, 20.0)}}
    return {"config": {"model": "m", "dtype": "float32", "kappa": 3,
                       "drafters": [{"label": "ngram", "method": "ngram"}]},
            "forward_cost_by_level": {str(c): fc(c) for c in (1, 4, 16)},
            "levels": levels, "mismatches": []}


def test_knee_of_the_measured_forwards():
    fit = knee(bench_summary()["forward_cost_by_level"])
    assert fit["fixed_ms"] == pytest.approx(10.0)
    assert fit["per_token_ms"] == pytest.approx(0.1)
    assert fit["t_star"] == pytest.approx(100.0)
    assert fit["step_ms"] == pytest.approx(10.1)
    assert knee(None) is None


def test_machine_break_even_per_drafter():
    report = machine_plan(bench_summary())
    (d,) = report["drafters"]
    assert d["drafter"] == "ngram" and d["systems"] == "served"
    assert d["levels"][0]["tokens_per_round"] == pytest.approx(2.533)
    assert d["levels"][0]["alpha"] == pytest.approx(0.7, abs=1e-9)
    assert d["extra"] == pytest.approx(0.05)  # 0.505 ms of tail wait over a 10.1 ms step
    # T* (E - extra) / (kappa + 1) = 100 * (2.533 - 0.05) / 4
    assert d["break_even_batch"] == pytest.approx(62.075, abs=1e-6)
    # the fitted line: (10 * (E - 1) - 0.505) / (0.1 * (4 - E))
    assert d["break_even_batch_linear"] == pytest.approx(
        (10 * 1.533 - 0.505) / (0.1 * (4 - 2.533)), rel=1e-9)
    m = d["measured"]
    assert m["bound"] == "crossed" and m["pays_at"] == [1, 4]
    assert 4 < m["batch"] < 16


def test_measured_crossing_bounds():
    assert measured_crossing([(1, 0.9), (4, 0.8)])["bound"] == "below"
    assert measured_crossing([(1, 1.2), (4, 1.1)])["bound"] == "above"
    # slower at 1, faster at 4, slower at 16: falls through after C=4
    m = measured_crossing([(1, 0.9), (4, 1.2), (16, 0.8)])
    assert m["pays_at"] == [4] and 4 < m["batch"] < 16


def test_without_forward_costs_only_the_measured_crossing():
    summary = bench_summary()
    del summary["forward_cost_by_level"]
    report = machine_plan(summary)
    assert report["knee"] is None and "--profile" in report["notes"][0]
    assert report["drafters"][0]["break_even_batch"] is None
    assert report["drafters"][0]["measured"]["bound"] == "crossed"


def test_cli_plan_json_parses(capsys):
    assert main(["plan", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["drafting"]: r for r in report["rows"]}
    assert rows["chain"]["speedup"] == pytest.approx(1.69, abs=5e-3)
    assert rows["parallel"]["break_even_batch"] == pytest.approx(175, abs=1)
    assert main(["plan"]) == 0
    table = capsys.readouterr().out
    assert "break-even B" in table and "1.69x" in table and "2.17x" in table


def test_cli_plan_from_bench(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench_summary()))
    assert main(["plan", "--from-bench", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["drafters"][0]["break_even_batch"] == pytest.approx(62.075, abs=1e-6)
    assert main(["plan", "--from-bench", str(path)]) == 0
    text = capsys.readouterr().out
    assert "drafter ngram" in text and "break-even batch, model (roofline, T*): 62" in text
    assert "break-even batch, model (the fitted line): 101" in text
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not a `specmesh bench"):
        main(["plan", "--from-bench", str(bad)])
    with pytest.raises(SystemExit, match="alpha must be in"):
        main(["plan", "--acceptance", "1.5"])
