"""The bench's per-method table (benchmarks/harness/method_table.py) from a synthetic summary
shaped as ``specmesh bench`` writes it: every column from the verifier's and drafter's
profiles and the drafter's stats, blanks (None, an empty cell) where the run did not measure
a figure, never zeros, and the markdown table."""

from __future__ import annotations

import pytest

from specmesh.benchmarks.harness.method_table import (
    human_bytes,
    method_table,
    method_table_markdown,
    step_figures,
)
from specmesh.benchmarks.harness.render import markdown


def _phase(count: int, total_ms: float) -> dict:
    return {"count": count, "total_ms": total_ms, "mean_ms": total_ms / count}


def _system(kind, kappa, method, tps, shares=(), phases=None, counters=None,
            accepted=None):
    steps = 10 if accepted is not None else 0
    return {"kind": kind, "kappa": kappa, "method": method, "median_tokens_per_s": tps,
            "acceptance_per_position": list(shares),
            "spec_stats": {"num_verify_steps": steps,
                           "mean_accept_len": accepted if accepted is not None else 0.0},
            "profile_raw": {"phases": phases or {}, "counters": counters or {}}}


EAGLE_PHASES = {"forward": _phase(10, 100.0), "drafter propose": _phase(30, 24.0),
                "drafter branches": _phase(5, 6.0), "tail_wait": _phase(10, 1.0)}
EAGLE_COUNTERS = {"num_steps": 10, "drafter draft_forwards": 30, "seed_state_bytes": 2304,
                  "num_seed_states": 2, "drafter tree_nodes": 24, "drafter tree_segments": 3}


def test_step_figures_every_column():
    s = _system("served", 3, "eagle", 50.0, [0.8, 0.6, 0.3], EAGLE_PHASES, EAGLE_COUNTERS, 1.5)
    costs = {"draft_weights_bytes": 3 << 20, "draft_kv_pool_bytes": 1 << 20,
             "num_draft_forwards": 99}
    f = step_figures(s, costs)
    assert f["verify_forward_ms"] == pytest.approx(10.0)  # 100 ms over 10 forwards
    assert f["draft_ms_per_step"] == pytest.approx(3.0)  # (24 + 6) ms over 10 steps
    assert f["c"] == pytest.approx(0.3)
    assert f["forwards_per_step"] == pytest.approx(3.0)  # 30 forwards over 10 steps
    assert f["c_per_forward"] == pytest.approx(0.1)
    assert f["alpha_per_position"] == pytest.approx([0.8, 0.75, 0.5])
    assert f["acceptance_per_position"] == [0.8, 0.6, 0.3]
    assert (f["accepted_per_step"], f["tokens_per_step"]) == (1.5, 2.5)
    assert f["draft_memory_bytes"] == 4 << 20
    assert f["seed_state_bytes_per_request"] == 1152
    assert f["tree_nodes_per_tree"] == 8


def test_missing_measurements_are_none_not_zero():
    # a method that reports no costs, a run without seed states, trees or drafted steps
    s = _system("served", 3, "pard", 40.0, [], {"forward": _phase(10, 100.0),
                                                "drafter propose": _phase(10, 10.0)},
                {"num_steps": 10})
    f = step_figures(s, None)
    assert f["c"] == pytest.approx(0.1)
    for key in ("forwards_per_step", "c_per_forward", "accepted_per_step", "tokens_per_step",
                "draft_weights_bytes", "draft_kv_pool_bytes", "draft_memory_bytes",
                "seed_state_bytes_per_request", "tree_nodes_per_tree"):
        assert f[key] is None, key
    assert f["alpha_per_position"] == []
    # a method that counts its forwards but ran none: 0 forwards is a measurement
    f = step_figures(s, {"num_draft_forwards": 0, "draft_weights_bytes": 0,
                         "draft_kv_pool_bytes": 0})
    assert f["forwards_per_step"] == 0.0 and f["c_per_forward"] is None
    assert f["draft_memory_bytes"] == 0
    # no profile at all: no c, no forwards
    bare = step_figures({"kind": "served", "kappa": 3}, {"num_draft_forwards": 5})
    assert bare["c"] is None and bare["forwards_per_step"] is None


def bench_summary() -> dict:
    """Two methods at concurrency 1 and 16: an EAGLE chain reporting everything, a method
    reporting no costs (blank cells)."""
    pard_phases = {"forward": _phase(20, 160.0), "drafter propose": _phase(20, 16.0)}
    levels = {}
    for c, scale in (("1", 1.0), ("16", 2.4)):
        levels[c] = {"concurrency": int(c), "systems": {
            "served k=3 eagle": _system("served", 3, "eagle", 50.0 * scale, [0.8, 0.6, 0.3],
                                        EAGLE_PHASES, EAGLE_COUNTERS, 1.5),
            "served k=3 pard": _system("served", 3, "pard", 45.0 * scale, [0.5, 0.2, 0.1],
                                       pard_phases, {"num_steps": 20}, 0.8),
            "served k=0": _system("served", 0, None, 40.0 * scale if c == "1" else 150.0),
            "in-process k=3 eagle": _system("inprocess", 3, "eagle", 99.0)}}
    return {"config": {"model": "m", "dtype": "float32", "kappa": 3, "max_tokens": 8,
                       "num_prompts": 2, "repeats": 1,
                       "drafters": [{"label": "eagle"}, {"label": "pard"},
                                    {"label": "ngram"}]},
            "levels": levels, "mismatches": [],
            "drafter_costs": {"eagle": {"draft_weights_bytes": 3 << 20,
                                        "draft_kv_pool_bytes": 1 << 20,
                                        "num_draft_forwards": 99},
                              "pard": {}}}


def test_method_table_rows_per_method_and_concurrency():
    summary = bench_summary()
    table = method_table(summary)
    assert (table["kappa"], table["reference"], table["concurrency"]) == (3, 1, [1, 16])
    eagle, pard = table["rows"]  # ngram ran no system: no row
    assert eagle["method"] == "eagle" and eagle["system"] == "served k=3 eagle"  # served first
    assert eagle["tokens_per_s"] == pytest.approx({"1": 50.0, "16": 120.0})
    assert eagle["speedup_vs_k0"] == pytest.approx({"1": 1.25, "16": 0.8})
    assert eagle["c"] == pytest.approx(0.3) and eagle["forwards_per_step"] == 3.0
    assert set(eagle["levels"]) == {"1", "16"}
    assert pard["c"] == pytest.approx(0.1) and pard["forwards_per_step"] is None
    assert pard["draft_weights_bytes"] is None
    assert method_table({**summary, "config": {**summary["config"], "drafters": []}}) is None


def test_method_table_markdown_with_blanks():
    summary = bench_summary()
    summary["per_method"] = method_table(summary)
    lines = method_table_markdown(summary)
    assert lines[0] == "## per draft method (kappa=3; per-step figures at C=1)"
    assert ("| eagle | 3.00 | 0.300 | 0.100 | 0.80 / 0.75 / 0.50 | 1.50 | 8.0 | 3.00 MiB | "
            "1.00 MiB | 1.1 KiB | 50.00 (1.25x) | 120.00 (0.80x) |") in lines
    assert ("| pard |  | 0.100 |  | 0.50 / 0.40 / 0.50 | 0.80 |  |  |  |  | 45.00 (1.12x) | "
            "108.00 (0.72x) |") in lines
    assert any("blank: not measured" in line for line in lines)
    # in the bench's printed tables (the per-level tables left out here)
    assert "## per draft method" in markdown({**summary, "levels": {}})
    assert method_table_markdown({"config": {}}) == []


def test_human_bytes():
    assert [human_bytes(n) for n in (None, 0, 1023, 1024, 1536, 5 << 20, 3 << 30)] == \
        ["", "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "5.00 MiB", "3.00 GiB"]


def test_a_tree_listed_first_keeps_its_keys_in_its_label(tiny_model_dir):
    """Chains vs trees in one run: the EAGLE-2 tree's row is told apart from the chain's
    whichever is listed first (its set keys are in its label)."""
    from specmesh.benchmarks.harness.options import parse_drafters

    tree, chain = parse_drafters("eagle:topk=4+nodes=12,eagle", tiny_model_dir)
    assert (tree.label, chain.label) == ("eagle:topk=4+nodes=12", "eagle")
    assert parse_drafters("eagle:/a/h+topk=2")[0].label == "eagle:h+topk=2"
