"""``specmesh bench`` end to end on the tiny random model: served (Ray, gateway, HTTP) and
in-process specmesh at kappa = 3 and 0, HF batched generate and prompt lookup, concurrency
1 and 2, one repeat; the JSON, markdown and PNG it writes, and a prompts file with a bad line."""

import json

import pytest

from cluster.cli import main

pytestmark = pytest.mark.ray

PROMPTS = [
    {"name": "sea", "category": "poem",
     "messages": [{"role": "user", "content": "Write a haiku about the sea."}]},
    {"prompt": "List three colours, then list them again."},
]


def test_bench_concurrency_levels_outputs(ray_session, tiny_model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    out_json, out_md, out_png = (tmp_path / n for n in ("b.json", "b.md", "b.png"))
    rc = main(["bench", "--model", tiny_model_dir, "--dtype", "float32", "--kv-cache-mb", "32",
               "--max-model-len", "1024", "--num-speculative-tokens", "3",
               "--concurrency", "1,2", "--repeats", "1", "--max-tokens", "6",
               "--prompts", str(prompts), "--profile", "--json", str(out_json),
               "--markdown", str(out_md), "--plot", str(out_png)])
    assert rc == 0
    summary = json.loads(out_json.read_text())
    assert summary["config"]["concurrency"] == [1, 2]
    assert summary["config"]["prompt_names"] == ["sea", "prompt-2"]
    want = {"specmesh k=3", "specmesh k=0", "in-process k=3", "in-process k=0", "hf generate"}
    assert set(summary["levels"]["1"]["systems"]) == want | {"hf prompt lookup k=3"}
    assert set(summary["levels"]["2"]["systems"]) == want
    for level in summary["levels"].values():
        assert level["num_requests"] == 2
        for name, s in level["systems"].items():
            assert s["median_tokens_per_s"] > 0, name
            assert len(s["all_tokens_per_s"]) == 1
            if name != "hf generate":
                assert len(s["identical_to_hf"]) == 2
        # greedy: speculation never changes the output
        assert all(level["systems"]["in-process k=3"]["identical_to_k0"])
        assert all(level["systems"]["specmesh k=3"]["identical_to_k0"])
        assert "profile" in level["systems"]["specmesh k=3"]
        assert "forward" in level["systems"]["in-process k=3"]["profile"]["phases"]
    assert summary["forward_cost"]["ratio"] > 0
    md = out_md.read_text()
    assert "## concurrency 1" in md and "## concurrency 2" in md
    assert "| system | tokens/s | x HF | acceptance | mean accept len |" in md
    assert "| in-process k=0 |" in md and "verifier step profile" in md
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| specmesh k=3 |" in capsys.readouterr().out


def test_bench_bad_prompts_line_fails_before_starting(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PROMPTS[1]) + "\n" + '{"messages": "hi"}\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl, line 2: \"messages\" must be"):
        main(["bench", "--prompts", str(bad)])
    with pytest.raises(SystemExit, match="--concurrency"):
        main(["bench", "--concurrency", "1,zero"])
