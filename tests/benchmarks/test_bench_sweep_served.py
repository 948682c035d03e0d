"""``specmesh bench --kappas ... --policy ...`` served on the tiny random model: two fixed kappas
(k = 0 and 2 under ``--speculative-policy fixed``) and the goodput policy (on a verify-cost
table measured at its verifier's start) as interleaved served passes, and the JSON fields the
sweep adds: each policy pass's kappa over time, the policy's tokens/s over the best fixed
kappa's, output identity against k = 0 with drafts accepted."""

import json

import pytest

from specmesh.cluster.cli import main

pytestmark = pytest.mark.ray

#: the bench sends prompts through the chat template; the tiny model's greedy output after these
#: two repeats itself (one token ~27 times, a 3-token cycle ~10 times in 64 tokens), so n-gram
#: drafts are accepted whatever the timing of the drafter (the earlier raw-counting prompts gave
#: ~1 accepted token after the template, and a CI run with none)
PROMPTS = [{"prompt": "Repeat: cat cat cat cat cat cat"}, {"prompt": "x y z x y z x y z"}]


def test_bench_sweep_writes_policy_fields(ray_session, tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    out_json, out_md, out_png = (tmp_path / n for n in ("s.json", "s.md", "s.png"))
    rc = main(["bench", "--model", tiny_model_dir, "--dtype", "float32", "--kv-cache-mb", "32",
               "--max-model-len", "1024", "--concurrency", "2", "--repeats", "1",
               "--max-tokens", "64", "--prompts", str(prompts), "--kappas", "0,2",
               "--policy", "goodput", "--json", str(out_json), "--markdown", str(out_md),
               "--plot", str(out_png), "--no-progress"])
    assert rc == 0  # every system's output identical to k = 0's
    summary = json.loads(out_json.read_text())
    assert summary["mismatches"] == []
    assert summary["sweep"] == {"kappas": [0, 2], "policies": ["goodput"]}
    assert summary["config"]["verify_cost_table"] == "auto"
    # the goodput verifier measured its table at start (or found this CPU's in the cache) and
    # refined it with the verify forwards of the passes; the fixed policy has none
    tables = summary["config"]["verify_cost_tables"]
    assert tables["ngram (fixed)"] is None
    table = tables["ngram (goodput)"]
    assert table["source"] in ("measured", "cached") and table["num_observed"] > 0
    assert table["batch_sizes"][0] == 1 and len(table["seconds"]) == \
        len(table["batch_sizes"]) * len(table["widths"])
    level = summary["levels"]["2"]
    systems = level["systems"]
    assert set(systems) == {"served k=0", "served k=2 ngram", "served goodput ngram"}
    policy = systems["served goodput ngram"]
    assert policy["policy"] == "goodput" and policy["exact"] is True
    assert systems["served k=2 ngram"]["policy"] == "fixed"
    assert systems["served k=2 ngram"]["exact"] is True
    assert systems["served k=2 ngram"]["spec_stats"]["num_accepted_tokens"] >= 10
    # the kappa over time: one timeline per repeat, the configured kappa, drafts per step
    # within it where steps ran
    (timeline,) = policy["kappa_timeline"]
    assert timeline and all(p["kappa"] == 2 for p in timeline)
    drafts = [p["drafts_per_step"] for p in timeline if p["drafts_per_step"] is not None]
    assert drafts and all(0 <= d <= 2 for d in drafts)
    row = level["policy_vs_best_fixed"]["served goodput ngram"]
    assert row["best_fixed"] in ("served k=0", "served k=2 ngram")
    assert row["ratio"] == pytest.approx(policy["median_tokens_per_s"]
                                         / systems[row["best_fixed"]]["median_tokens_per_s"])
    assert "policy tokens/s / best fixed" in out_md.read_text()
    assert out_png.stat().st_size > 0


def test_bench_sweep_reports_confidence_calibration(ray_session, tiny_model_dir, tmp_path):
    """``--policy confidence``: exact served output, and the confidence cluster's predicted vs
    realised accepted drafts and reliability bins in the JSON, the markdown and the plot."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    out_json, out_md, out_png = (tmp_path / n for n in ("s.json", "s.md", "s.png"))
    rc = main(["bench", "--model", tiny_model_dir, "--dtype", "float32", "--kv-cache-mb", "32",
               "--max-model-len", "1024", "--concurrency", "2", "--repeats", "1",
               "--max-tokens", "64", "--prompts", str(prompts), "--kappas", "0,2",
               "--policy", "confidence", "--json", str(out_json), "--markdown", str(out_md),
               "--plot", str(out_png), "--no-progress"])
    assert rc == 0  # every system's output identical to k = 0's
    summary = json.loads(out_json.read_text())
    assert summary["mismatches"] == []
    systems = summary["levels"]["2"]["systems"]
    assert systems["served confidence ngram"]["exact"] is True
    calib = summary["confidence_calibration"]["ngram (confidence)"]
    # decided on the verify cost table measured at the verifier's start (no fallback)
    assert calib["num_steps"] > 0 and calib["num_fallback_steps"] == 0
    assert calib["realised_accepted_drafts"] > 0 and calib["predicted_accepted_drafts"] > 0
    assert calib["mean_abs_error_per_step"] is not None
    assert sum(b["num_judged"] for b in calib["reliability"]) > 0
    assert "confidence calibration" in out_md.read_text()
    assert out_png.stat().st_size > 0
