"""``specmesh bench --baselines``: the option and its llama-server companions, the systems and
schedule per baseline, the TTFT / inter-token latency percentiles and their table columns, the
served-vs-llama-server ratios, and llama.cpp's outputs compared for information only (pure:
no cluster, no model, no llama.cpp)."""

from __future__ import annotations

import pytest

from specmesh.benchmarks.harness.bench import _schedule, llama_peer
from specmesh.benchmarks.harness.report import latency_summary, percentile
from specmesh.benchmarks.harness.llama_server import DEFAULT_SPEC_TYPE
from specmesh.benchmarks.harness.options import BenchOptions, bench_options, parse_baselines
from specmesh.benchmarks.harness.render import markdown
from specmesh.benchmarks.harness.report import HF_BASELINE, summarize, systems_for
from specmesh.cluster.cli import build_parser
from specmesh.cluster.runs import RequestLatency, RunResult
from specmesh.protocol.spec_stats import SpecStats


def _opts(*argv: str) -> BenchOptions:
    return bench_options(build_parser().parse_args(["bench", *argv]))


# -- the options -------------------------------------------------------------------------------


def test_baselines_option_defaults_to_hf_alone():
    opts = _opts()
    assert opts.baselines == ("hf",)
    assert opts.llama_server is None and opts.llama_spec_type == DEFAULT_SPEC_TYPE
    assert opts.llama_server_args == () and opts.llama_keep_spec_state is False
    assert _opts("--llama-keep-spec-state").llama_keep_spec_state is True
    opts = _opts("--baselines", "hf,llama-server", "--llama-server", "/opt/llama-server",
                 "--llama-spec-type", "ngram-simple", "--llama-server-args",
                 "--spec-ngram-simple-size-n 3 --log-disable")
    assert opts.baselines == ("hf", "llama-server")
    assert opts.llama_server == "/opt/llama-server" and opts.llama_spec_type == "ngram-simple"
    assert opts.llama_server_args == ("--spec-ngram-simple-size-n", "3", "--log-disable")


@pytest.mark.parametrize("text,want", [("hf", ("hf",)), ("llama-server", ("llama-server",)),
                                       (" llama-server , hf,hf", ("llama-server", "hf")),
                                       ("none", ())])
def test_parse_baselines(text, want):
    assert parse_baselines(text) == want


@pytest.mark.parametrize("text,match", [("vllm", r"unknown baseline 'vllm' \(use a comma list "
                                                 r"of hf, llama-server, or none\)"),
                                        ("hf,none", "'none' cannot be combined"),
                                        (" , ", "no baseline given")])
def test_parse_baselines_refuses(text, match):
    with pytest.raises(SystemExit, match=match):
        parse_baselines(text)


def test_bad_llama_options_fail_before_anything_starts(capsys):
    with pytest.raises(SystemExit, match="--baselines: unknown baseline"):
        _opts("--baselines", "hf,sglang")
    with pytest.raises(SystemExit, match="--llama-server-args: No closing quotation"):
        _opts("--llama-server-args", "--chat-template 'chatml")
    with pytest.raises(SystemExit):  # argparse: not one of the n-gram types
        _opts("--llama-spec-type", "draft-simple")
    assert "invalid choice: 'draft-simple'" in capsys.readouterr().err


def test_a_missing_llama_server_is_a_note_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(tmp_path / "cache"))
    missing = tmp_path / "llama-server"
    note = llama_peer(_opts("--baselines", "hf,llama-server", "--llama-server", str(missing)),
                      None)
    assert note == f"--llama-server {missing} is not an executable file"
    note = llama_peer(_opts("--baselines", "llama-server"), None)
    assert isinstance(note, str) and "bash benchmarks/build_llama_server.sh" in note


def test_llama_server_needs_a_gguf(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    hf_dir = tmp_path / "hf-model"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    note = llama_peer(_opts("--llama-server", str(binary)), str(hf_dir))
    assert isinstance(note, str) and "is not a GGUF" in note
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert llama_peer(_opts("--llama-server", str(binary)), str(gguf)) == (
        str(binary), f"--llama-server {binary}", str(gguf))


# -- the systems and the schedule --------------------------------------------------------------


def test_systems_per_baseline():
    def names(baselines, kappa=4, level=1):
        return [s.name for s in systems_for(kappa, level, ["ngram"], (), baselines,
                                            "ngram-mod")]

    specmesh = ["served k=4 ngram", "served k=0", "in-process k=4 ngram", "in-process k=0"]
    assert names(("hf",)) == specmesh + [HF_BASELINE, "hf prompt lookup k=4"]
    assert names(("hf",)) == [s.name for s in systems_for(4, 1, ["ngram"])]  # as before
    assert names(()) == specmesh
    assert names(("llama-server",), level=4) == specmesh + ["llama-server",
                                                            "llama-server ngram-mod"]
    assert names(("hf", "llama-server"), kappa=0) == [
        "served k=0", "in-process k=0", HF_BASELINE, "hf prompt lookup k=1", "llama-server"]
    spec = systems_for(4, 1, ["ngram"], (), ("llama-server",), "ngram-mod")[-1]
    assert (spec.kind, spec.kappa, spec.plain, spec.method) == ("llama", 4, "llama-server",
                                                                "ngram-mod")


def test_schedule_interleaves_the_llama_systems():
    sched = _schedule([1, 4], 4, 2, ["ngram"], (), ("hf", "llama-server"), "ngram-cache")
    per_repeat = [[(lv, s.name) for r, lv, s in sched if r == k] for k in (0, 1)]
    assert sorted(per_repeat[0]) == sorted(per_repeat[1]) and per_repeat[0] != per_repeat[1]
    assert (4, "llama-server ngram-cache") in per_repeat[0]
    assert (1, "llama-server") in per_repeat[0]


# -- percentiles, the summary, the tables ------------------------------------------------------


def test_percentile_interpolates_between_ranks():
    assert percentile([3.0], 95) == 3.0
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)  # order does not matter
    assert percentile(list(range(1, 21)), 95) == pytest.approx(19.05)
    assert percentile([10, 20], 0) == 10 and percentile([10, 20], 100) == 20
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def _timed(name, tps, texts, ttft_s, itl_s=0.01, n=5, spec=(0, 0, 0), ids=None):
    lat = [RequestLatency(t, t + itl_s * (n - 1), n) for t in ttft_s]
    return RunResult(name, seconds=1.0, num_tokens=tps, texts=texts, token_ids=ids,
                     spec=SpecStats(*spec), latencies=lat)


def test_latency_summary_pools_every_repeat():
    runs = [_timed("s", 1, ["a"], [0.1, 0.2]), _timed("s", 1, ["a"], [0.3, 0.4], itl_s=0.03)]
    lat = latency_summary(runs)
    assert lat["num_requests"] == 4
    assert lat["ttft_ms"]["p50"] == pytest.approx(250.0)
    assert lat["ttft_ms"]["p95"] == pytest.approx(385.0)
    assert lat["itl_ms"]["p50"] == pytest.approx(20.0)
    assert latency_summary([RunResult("hf")]) is None  # not streamed
    one_token = latency_summary([RunResult("s", latencies=[RequestLatency(0.1, 0.1, 1)])])
    assert one_token["itl_ms"] == {"p50": None, "p95": None}


def _summary(llama: bool = True) -> dict:
    runs = {
        "served k=2 ngram": [_timed("served k=2 ngram", 60, ["a", "b"], [0.1, 0.3],
                                    spec=(4, 2, 2))],
        "served k=0": [_timed("served k=0", 30, ["a", "b"], [0.1, 0.1])],
        "in-process k=2 ngram": [RunResult("in-process k=2 ngram", 1.0, 70, texts=["a", "b"])],
        "in-process k=0": [RunResult("in-process k=0", 1.0, 35, texts=["a", "b"])],
        HF_BASELINE: [RunResult(HF_BASELINE, 1.0, 20, texts=["a", "b"])],
        "hf prompt lookup k=2": [RunResult("hf prompt lookup k=2", 1.0, 25, texts=["a", "b"])],
    }
    if llama:
        runs["llama-server"] = [_timed("llama-server", 40, ["a", "c"], [0.04, 0.06])]
        runs["llama-server ngram-mod"] = [_timed("llama-server ngram-mod", 50, ["a", "d"],
                                                 [0.1, 0.1], spec=(10, 5, 0))]
    config = {"model": "tiny", "dtype": "float32", "kappa": 2, "max_tokens": 8,
              "num_prompts": 2, "repeats": 1, "threads": {"verifier": 2},
              "llama_server": {"binary": "/b/llama-server", "found": "found on $PATH",
                               "servers": {"llama-server": {
                                   "threads": 2, "parallel": 1, "ctx_size": 256,
                                   "spec_type": None, "extra_args": []},
                                   "llama-server ngram-mod": {
                                   "threads": 2, "parallel": 1, "ctx_size": 256,
                                   "spec_type": "ngram-mod", "extra_args": []}}}
              if llama else {"skipped": "no llama-server on $PATH"}}
    baselines = ("hf", "llama-server") if llama else ("hf",)
    return summarize(config, {1: runs}, {1: systems_for(2, 1, ["ngram"], (), baselines,
                                                        "ngram-mod")})


def test_llama_outputs_are_informative_and_served_is_held_to_its_best():
    s = _summary()
    lv = s["levels"]["1"]
    llama = lv["systems"]["llama-server ngram-mod"]
    assert llama["identical_to_k0"] == [True, False] and llama["exact"] is None
    assert llama["identical_to_hf"] == [True, False]
    assert s["mismatches"] == []  # a peer's differing output is not specmesh's mismatch
    assert llama["acceptance_rate"] == pytest.approx(0.5)
    r = lv["ratios"]
    assert r["llama-server ngram-mod / llama-server"] == pytest.approx(1.25)
    assert r["served k=2 ngram / best llama-server (llama-server ngram-mod)"] == pytest.approx(
        1.2)
    assert r["served k=0 / best llama-server (llama-server ngram-mod)"] == pytest.approx(0.6)
    # TTFT against the lowest llama-server p50: plain's 50 ms (ngram-mod's is 100 ms)
    assert r["TTFT p50 served k=2 ngram / llama-server"] == pytest.approx(4.0)
    assert r["TTFT p50 served k=0 / llama-server"] == pytest.approx(2.0)
    assert lv["systems"]["served k=0"]["latency"]["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert lv["systems"]["in-process k=0"]["latency"] is None


def test_tables_gain_ttft_and_itl_columns():
    text = markdown(_summary())
    assert ("| identical to HF | identical k=K vs k=0 | TTFT p50 / p95 ms | ITL p50 / p95 ms |"
            in text)
    assert "|---|---|---|---|---|---|---|---|---|---|---|---|" in text
    assert "| served k=0 | 30.00 | 1.50 |  |  |  |  |  | 2/2 |  | 100.0 / 100.0 | 10.0 / 10.0 |" \
        in text
    # llama.cpp: acceptance from its timings, no verify steps (no mean accept length), its
    # differing output shown, not flagged
    assert ("| llama-server ngram-mod | 50.00 | 2.50 | 0.50 |  |  |  |  | 1/2 | 1/2 | "
            "100.0 / 100.0 | 10.0 / 10.0 |") in text
    assert "| hf generate | 20.00 | 1.00 |  |  |  |  |  |  |  |  |  |" in text
    assert "MISMATCH" not in text
    assert "- llama-server: /b/llama-server, -t 2, --parallel 1, -c 256" in text
    assert "speculation ngram-mod with at most kappa drafts" in text
    assert "- TTFT: request sent to first content chunk; ITL: per request" in text
    assert "- served k=2 ngram / best llama-server (llama-server ngram-mod): 1.20x" in text
    assert "- TTFT p50 served k=2 ngram / llama-server: 4.00x" in text


def test_a_skipped_llama_server_is_named_in_the_header():
    text = markdown(_summary(llama=False))
    assert "- llama-server: skipped (no llama-server on $PATH)" in text
    assert "best llama-server" not in text
