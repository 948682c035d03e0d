"""``specmesh plan --from-bench`` per method (cluster/plan_ties.py): from a small bench JSON
with the per-method table, each method's modelled speedup at its measured c, the acceptance
at which a parallel drafter ties no speculation and ties the chain at that c, and what each
method needs to tie the other as measured; a file without the table says so."""

from __future__ import annotations

import json

import pytest

from specmesh.cluster.cli import main
from specmesh.cluster.plan_ties import method_ties
from specmesh.decode.speedup_model import tokens_per_round

CHAIN_SHARES = [0.7, 0.49, 0.343]  # geometric, alpha 0.7: E = 2.533
PARALLEL_SHARES = [0.6, 0.3, 0.1]


def _row(method, c, forwards, shares):
    return {"method": method, "c": c, "forwards_per_step": forwards,
            "c_per_forward": c / forwards if forwards else None,
            "acceptance_per_position": shares}


def bench_json() -> dict:
    """A bench run at kappa 3: an EAGLE chain (3 forwards a step, c 0.3), a parallel drafter
    (1 forward, c 0.15) and n-gram (no forwards, c 0.01)."""
    return {"config": {"model": "m", "dtype": "float32", "kappa": 3,
                       "drafters": [{"label": "eagle"}, {"label": "pard"}, {"label": "ngram"}]},
            "levels": {"1": {"systems": {}}}, "mismatches": [],
            "per_method": {"kappa": 3, "reference": 1, "concurrency": [1], "rows": [
                _row("eagle", 0.3, 3.0, CHAIN_SHARES),
                _row("pard", 0.15, 1.0, PARALLEL_SHARES),
                _row("ngram", 0.01, 0.0, [0.2])]}}


def test_ties_per_method():
    eagle, pard, ngram = method_ties(bench_json())
    assert eagle["alpha"] == pytest.approx(0.7, abs=1e-9)
    e = 1 + sum(CHAIN_SHARES)
    assert eagle["tokens_per_round"] == pytest.approx(e)
    assert eagle["modelled_speedup"] == pytest.approx(e / 1.3)
    t = eagle["at_this_c"]
    assert t["c"] == pytest.approx(0.1)
    assert t["chain_speedup"] == pytest.approx(e / (1 + 3 * 0.1))
    # the ties solve E(alpha) / (1 + c) == target at this machine's c per pass
    assert tokens_per_round(t["parallel_ties_no_speculation_alpha"], 3) == \
        pytest.approx(1.1, abs=1e-9)
    assert tokens_per_round(t["parallel_ties_chain_alpha"], 3) == \
        pytest.approx(t["chain_speedup"] * 1.1, abs=1e-9)
    assert t["parallel_ties_no_speculation_alpha"] < t["parallel_ties_chain_alpha"] < 0.7
    # what the parallel drafter needs, at its own measured c, to tie the chain as measured
    vs = {x["versus"]: x for x in pard["ties"]}
    assert set(vs) == {"eagle", "ngram"}
    assert tokens_per_round(vs["eagle"]["alpha"], 3) == \
        pytest.approx(eagle["modelled_speedup"] * 1.15, abs=1e-9)
    assert vs["eagle"]["own_alpha"] == pard["alpha"]
    # n-gram: no draft forwards, so no per-pass c; its shares pad to kappa positions
    assert ngram["c_per_forward"] is None and ngram["at_this_c"] is None
    assert ngram["tokens_per_round"] == pytest.approx(1.2)
    # a tie no acceptance reaches: None
    hard = bench_json()
    hard["per_method"]["rows"][1]["c"] = 5.0
    assert method_ties(hard)[1]["ties"][0]["alpha"] is None
    assert method_ties({"config": {}, "levels": {}}) is None


def test_cli_plan_from_bench_prints_the_ties(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench_json()))
    assert main(["plan", "--from-bench", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [m["drafter"] for m in report["methods"]] == ["eagle", "pard", "ngram"]
    assert main(["plan", "--from-bench", str(path)]) == 0
    text = capsys.readouterr().out
    assert "chain vs parallel per method (kappa 3" in text
    assert "  eagle: 3.00 draft forwards per step, c 0.300 (0.100 per forward), alpha 0.700" \
        in text
    assert "at this c (0.100 per pass): a parallel drafter ties no speculation at alpha " \
        in text
    assert "    ties eagle (as measured) at its own c with alpha " in text
    old = bench_json()
    del old["per_method"]
    path.write_text(json.dumps(old))
    assert main(["plan", "--from-bench", str(path)]) == 0
    assert "no per-method table in the file" in capsys.readouterr().out
