"""``specmesh bench --drafters ngram,eagle:HEAD`` served on the tiny random model (Ray,
gateway, HTTP; concurrency 1, one repeat, no baselines): the per-method table is in the JSON
and the printed markdown with numbers for both methods (draft forwards per step, c, draft
memory, tokens/s), the seed-state bytes of the method that ships one, blanks for the one that
does not; ``specmesh plan --from-bench`` reads it back."""

import json

import pytest

from specmesh.cluster.cli import main

pytestmark = pytest.mark.ray

PROMPTS = [{"prompt": "List three colours, then list them again."},
           {"prompt": "Count from one to five, twice."}]


def test_served_bench_prints_the_per_method_table(ray_session, tiny_model_dir, tmp_path,
                                                  capsys):
    from helpers.eagle_heads import save_random_head

    head = save_random_head(tiny_model_dir, tmp_path / "tiny-head")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    out_json = tmp_path / "b.json"
    rc = main(["bench", "--model", tiny_model_dir, "--dtype", "float32", "--kv-cache-mb", "32",
               "--max-model-len", "1024", "--num-speculative-tokens", "3",
               "--concurrency", "1", "--repeats", "1", "--max-tokens", "8",
               "--prompts", str(prompts), "--json", str(out_json),
               "--drafters", f"ngram,eagle:{head}", "--baselines", "none",
               # drafting always on: the table's per-step figures need the EAGLE head's
               # drafts (the gate may turn the random head off once measured, warm-up incl.)
               "--speculation-gate", "off"])
    assert rc == 0  # every method's output identical to kappa = 0's
    summary = json.loads(out_json.read_text())
    table = summary["per_method"]
    assert (table["kappa"], table["reference"]) == (3, 1)
    rows = {r["method"]: r for r in table["rows"]}
    assert set(rows) == {"ngram", "eagle:tiny-head"}
    for name, r in rows.items():
        assert r["system"] == f"served k=3 {name}"
        assert r["tokens_per_s"]["1"] > 0 and r["speedup_vs_k0"]["1"] > 0, name
        assert r["c"] is not None and r["c"] > 0, name  # the drafter's propose time
        assert r["verify_forward_ms"] > 0 and r["num_verify_steps"] > 0, name
        # alpha per position: one per draft position where drafts were verified (the
        # untrained head's tails may come too late for the tiny model's millisecond steps)
        assert len(r["alpha_per_position"]) in (0, 3), name
    ngram, eagle = rows["ngram"], rows["eagle:tiny-head"]
    # n-gram runs no model: 0 forwards, no weights, no KV -- measured zeros
    assert (ngram["forwards_per_step"], ngram["draft_weights_bytes"],
            ngram["draft_kv_pool_bytes"]) == (0.0, 0, 0)
    assert ngram["seed_state_bytes_per_request"] is None  # no seed state: blank
    # the EAGLE head: its weights, the KV its requests held, forwards, its hidden-state seed
    assert eagle["draft_weights_bytes"] > 0 and eagle["draft_kv_pool_bytes"] > 0
    assert eagle["forwards_per_step"] > 0 and eagle["c_per_forward"] > 0
    assert eagle["seed_state_bytes_per_request"] > 0
    assert summary["drafter_costs"]["eagle:tiny-head"]["num_draft_forwards"] > 0
    out = capsys.readouterr().out
    assert "## per draft method (kappa=3; per-step figures at C=1)" in out
    assert "| ngram | 0.00 | " in out and "| eagle:tiny-head | " in out
    # plan --from-bench: the ties per method at this machine's c
    assert main(["plan", "--from-bench", str(out_json), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    methods = {m["drafter"]: m for m in report["methods"]}
    assert methods["eagle:tiny-head"]["at_this_c"] is not None
    assert methods["ngram"]["at_this_c"] is None  # no forwards: no per-pass c
