"""``specmesh bench`` end to end on the tiny random model: served (Ray, gateway, HTTP) and
in-process specmesh at kappa = 3 per draft method (n-gram and an untrained EAGLE head, a served
cluster each, side by side) and kappa = 0, HF batched generate and prompt lookup, concurrency
1 and 2, one repeat (llama-server asked for but absent: skipped with a note); the JSON,
markdown and PNG it writes, and a prompts file with a bad line."""

import json

import pytest

from specmesh.cluster.cli import main

pytestmark = pytest.mark.ray

PROMPTS = [
    {"name": "sea", "category": "poem",
     "messages": [{"role": "user", "content": "Write a haiku about the sea."}]},
    {"prompt": "List three colours, then list them again.",
     "prediction": "Red, green, blue. Red, green, blue."},
]


def test_bench_concurrency_levels_outputs(ray_session, tiny_model_dir, tmp_path, capsys):
    from helpers.eagle_heads import save_random_head

    head = save_random_head(tiny_model_dir, tmp_path / "tiny-head")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    out_json, out_md, out_png = (tmp_path / n for n in ("b.json", "b.md", "b.png"))
    rc = main(["bench", "--model", tiny_model_dir, "--dtype", "float32", "--kv-cache-mb", "32",
               "--max-model-len", "1024", "--num-speculative-tokens", "3",
               "--concurrency", "1,2", "--repeats", "1", "--max-tokens", "6",
               "--prompts", str(prompts), "--profile", "--json", str(out_json),
               "--markdown", str(out_md), "--plot", str(out_png),
               "--drafters", f"ngram,eagle:{head}",
               "--baselines", "hf,llama-server", "--llama-server", str(tmp_path / "none"),
               "--speculation-gate", "off"])  # drafting always on: drafts are asserted
    assert rc == 0  # every method's output identical to kappa = 0's
    summary = json.loads(out_json.read_text())
    assert summary["mismatches"] == []
    cfg = summary["config"]
    # no llama-server binary: the baseline is skipped with a note, the rest runs
    assert cfg["baselines"] == ["hf"]
    assert "is not an executable file" in cfg["llama_server"]["skipped"]
    assert cfg["concurrency"] == [1, 2]
    assert cfg["prompt_names"] == ["sea", "prompt-2"]
    # each served pass began with its cluster's drafters' history cleared through the
    # gateway -- one flag per pass
    passes = {"ngram": 2 * 2, "eagle:tiny-head": 2}  # 2 levels; k=0 runs on ngram's
    assert {k: len(v) for k, v in cfg["drafter_history_cleared"].items()} == passes
    assert all(all(v) for v in cfg["drafter_history_cleared"].values())
    assert any("drafters' cross-request memory cleared" in n for n in cfg["notes"])
    assert cfg["predictions"] == {"sent": True, "num_prompts_with_prediction": 1}
    assert any("carry a prediction, sent" in n for n in cfg["notes"])
    assert [d["label"] for d in cfg["drafters"]] == ["ngram", "eagle:tiny-head"]
    assert set(cfg["threads"]) == {"verifier", "prefill", "drafter", "gateway"}
    assert "side by side" in cfg["served_clusters"]
    spec = {f"{kind} k=3 {m}" for kind in ("served", "in-process")
            for m in ("ngram", "eagle:tiny-head")}
    want = spec | {"served k=0", "in-process k=0", "hf generate"}
    assert set(summary["levels"]["1"]["systems"]) == want | {"hf prompt lookup k=3"}
    assert set(summary["levels"]["2"]["systems"]) == want
    for level in summary["levels"].values():
        assert level["num_requests"] == 2
        assert level["categories"] == ["poem", "user"]  # split by the prompts' category
        rows = level["systems"]["served k=3 ngram"]["categories"]
        assert rows["poem"]["num_requests"] == 1 and rows["poem"]["median_tokens_per_s"] > 0
        assert rows["user"]["exact"] is True and rows["user"]["ratio_to_k0"] > 0
        # the prediction went with the served k=3 requests: accepted + rejected counted
        pred = level["systems"]["served k=3 ngram"]["prediction_tokens"]
        assert pred is not None, level["systems"]["served k=3 ngram"]
        for name, s in level["systems"].items():
            assert s["median_tokens_per_s"] > 0, name
            assert len(s["all_tokens_per_s"]) == 1
            if name != "hf generate":
                assert len(s["identical_to_hf"]) == 2
        # served runs carry token ids too (return_token_ids): outputs are compared as ids
        # served requests are streamed: TTFT and inter-token latency per request
        for name in ("served k=0", "served k=3 ngram"):
            lat = level["systems"][name]["latency"]
            assert lat["num_requests"] == 2 and lat["ttft_ms"]["p50"] > 0, name
        assert level["systems"]["in-process k=0"]["latency"] is None
        served_ids = level["systems"]["served k=0"]["token_ids"]
        assert served_ids == level["systems"]["in-process k=0"]["token_ids"]
        assert all(len(ids) > 0 for ids in served_ids)
        # greedy: speculation never changes the output, whatever the method
        for name in spec:
            s = level["systems"][name]
            assert s["exact"] is True and all(s["identical_to_k0"]), name
            assert len(s["accepted_per_pos"]) == 3, name
            assert s["verify_steps_with_drafts_share"] is not None, name
        # in-process, the untrained head drafts at every step it has a seed state for (served,
        # its tails may come too late for the tiny model's millisecond steps)
        s = level["systems"]["in-process k=3 eagle:tiny-head"]
        assert s["spec_stats"]["num_draft_tokens"] > 0
        assert len(s["acceptance_per_position"]) == 3
        assert "profile" in level["systems"]["served k=3 ngram"]
        phases = level["systems"]["in-process k=3 eagle:tiny-head"]["profile"]["phases"]
        assert "forward" in phases
        # the drafter's own phases ride along: served (Ray stats) and in-process
        assert phases["drafter commit_to_tail"]["count"] > 0
        assert level["systems"]["served k=3 ngram"]["profile"]["phases"][
            "drafter propose"]["count"] > 0
    assert summary["forward_cost"]["ratio"] > 0 and summary["forward_cost"]["batch"] == 1
    assert summary["forward_cost_by_level"]["2"]["batch"] == 2
    md = out_md.read_text()
    assert "## concurrency 1" in md and "## concurrency 2" in md
    assert "| system | tokens/s | x HF | acceptance | mean accept len |" in md
    assert "TTFT p50 / p95 ms | ITL p50 / p95 ms |" in md
    assert "### by category, concurrency 1" in md and "| poem | served k=3 ngram | 1 |" in md
    assert "- llama-server: skipped (--llama-server " in md
    assert "| in-process k=0 |" in md and "verifier step profile" in md
    assert "| drafter commit_to_tail |" in md
    plans = cfg["cluster_threads"]
    assert set(plans) == {"ngram", "eagle:tiny-head"}
    if plans["ngram"] != plans["eagle:tiny-head"]:  # a model drafter leaves its verifier a core
        assert "- thread plan: served roles: ngram: verifier" in md
    else:
        assert "- thread plan: served roles: verifier" in md
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "| served k=3 ngram |" in out and "| served k=3 eagle:tiny-head |" in out
    # `specmesh plan --from-bench` reads the file: a knee and a break-even per drafter
    assert main(["plan", "--from-bench", str(out_json), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["knee"]["points"] and report["kappa"] == 3
    assert [d["drafter"] for d in report["drafters"]] == ["ngram", "eagle:tiny-head"]
    assert all(len(d["levels"]) == 2 for d in report["drafters"])


def test_bench_bad_prompts_line_fails_before_starting(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PROMPTS[1]) + "\n" + '{"messages": "hi"}\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl, line 2: \"messages\" must be"):
        main(["bench", "--prompts", str(bad)])
    with pytest.raises(SystemExit, match="--concurrency"):
        main(["bench", "--concurrency", "1,zero"])
