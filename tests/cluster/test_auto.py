"""``auto`` decided once (cluster/auto.py, cluster/auto_resolve.py): the dtype from a
measurement of every candidate (fake timings here, never real ones), cached per model and CPU
and measured again when either changes; the drafter from the thread plan; the context from the
model and the KV memory; a role launched later follows the controller's settings."""

from __future__ import annotations

import json
import os

import pytest

from specmesh.cluster.auto import (
    CPU_CANDIDATES,
    AutoCache,
    Candidate,
    Setting,
    banner,
    check_max_model_len,
    choose_dtype,
    default_max_model_len,
    follow_settled,
    pick_dtype,
    proposal,
    resolve_auto_drafter,
)
from specmesh.cluster.controller import Controller


def timing(decode_ms: float, verify_ms: float) -> dict:
    return {"decode_ms": decode_ms, "verify_ms": verify_ms, "context_len": 128,
            "num_verify_tokens": 5}


class FakeMeasure:
    """``measure(dtypes)`` with fixed timings per dtype; counts its calls."""

    def __init__(self, timings: dict) -> None:
        self.timings = timings
        self.calls: list[list[str]] = []

    def __call__(self, dtypes: list[str]) -> dict:
        self.calls.append(list(dtypes))
        return {d: self.timings[d] for d in dtypes if d in self.timings}


# -- the dtype: the measurement feeds the choice ------------------------------------------------


def test_the_fastest_exact_candidate_wins_whatever_the_inexact_ones_cost():
    fast_bf16 = {"float32": timing(10, 12), "bfloat16": timing(4, 5)}
    slow_bf16 = {"float32": timing(10, 12), "bfloat16": timing(20, 30)}
    for timings in (fast_bf16, slow_bf16):
        got = pick_dtype(CPU_CANDIDATES, timings)
        assert got.dtype == "float32" and got.source == "measured"
        assert "fastest exact" in got.reason and "bfloat16" in got.reason
        assert "not exact" in got.reason  # the banner says what bf16 would give up
    assert "0.41x float32's" in pick_dtype(CPU_CANDIDATES, fast_bf16).reason


def test_a_measurement_on_busy_cores_says_so():
    quiet = {"float32": {**timing(8, 9), "load_avg": 0.5, "num_cpus": 2}}
    busy = {"float32": {**timing(60, 250), "load_avg": 7.5, "num_cpus": 2}}
    assert "shared the cores" not in pick_dtype(CPU_CANDIDATES, quiet).reason
    assert "load average 7.5 on 2 CPUs" in pick_dtype(CPU_CANDIDATES, busy).reason


def test_the_measurement_decides_between_exact_candidates():
    cands = (Candidate("float32", True), Candidate("float64", True),
             Candidate("bfloat16", False, "rounds"))
    assert pick_dtype(cands, {"float32": timing(10, 10), "float64": timing(5, 5),
                              "bfloat16": timing(1, 1)}).dtype == "float64"
    assert pick_dtype(cands, {"float32": timing(5, 5), "float64": timing(10, 10),
                              "bfloat16": timing(1, 1)}).dtype == "float32"
    # an exact candidate that could not be measured loses to one that was
    assert pick_dtype(cands, {"float32": "cannot load", "float64": timing(9, 9)}
                      ).dtype == "float64"


def test_without_a_measurement_the_rule_is_the_first_exact_candidate():
    got = pick_dtype(CPU_CANDIDATES, {"float32": "no room", "bfloat16": "no room"})
    assert (got.dtype, got.source) == ("float32", "rule")
    assert "not measured (no room)" in got.reason
    # no exact candidate at all: the fastest measured one
    inexact = (Candidate("bfloat16", False), Candidate("float16", False))
    assert pick_dtype(inexact, {"bfloat16": timing(3, 3), "float16": timing(2, 2)}
                      ).dtype == "float16"
    with pytest.raises(ValueError):
        pick_dtype((), {})


# -- the dtype: cached per model and CPU ------------------------------------------------------


def test_a_measurement_is_cached_and_made_again_for_another_key(tmp_path):
    cache = AutoCache(tmp_path)
    measure = FakeMeasure({"float32": timing(8, 9), "bfloat16": timing(17, 18)})
    key = {"model": {"files": [["m.gguf", 10, 1]]}, "cpu": {"model_name": "A", "flags": "x"}}
    first = choose_dtype(CPU_CANDIDATES, measure, cache, key)
    assert (first.dtype, first.source, len(measure.calls)) == ("float32", "measured", 1)
    again = choose_dtype(CPU_CANDIDATES, measure, cache, dict(key))
    assert (again.dtype, again.source, len(measure.calls)) == ("float32", "cached", 1)
    assert again.timings == first.timings
    for changed in ({**key, "model": {"files": [["m.gguf", 10, 2]]}},  # the file changed
                    {**key, "cpu": {"model_name": "B", "flags": "x"}}):  # another CPU
        assert choose_dtype(CPU_CANDIDATES, measure, cache, changed).source == "measured"
    assert len(measure.calls) == 3
    # an unreadable or foreign file counts as missing
    cache.path(key).write_text("{not json")
    assert choose_dtype(CPU_CANDIDATES, measure, cache, key).source == "measured"
    cache.path(key).write_text(json.dumps({"key": {"other": 1}, "value": {"timings": {}}}))
    assert choose_dtype(CPU_CANDIDATES, measure, cache, key).source == "measured"
    broken = {"timings": {"float32": {"decode_ms": 1}}}  # no verify_ms
    cache.path(key).write_text(json.dumps({"key": key, "value": broken}))
    assert choose_dtype(CPU_CANDIDATES, measure, cache, key).source == "measured"
    assert len(measure.calls) == 6


def test_a_rule_choice_is_not_cached(tmp_path):
    cache = AutoCache(tmp_path)
    nothing = FakeMeasure({})
    assert choose_dtype(CPU_CANDIDATES, nothing, cache, {"k": 1}).source == "rule"
    assert cache.get({"k": 1}) is None


def test_auto_dtype_measures_once_per_model_file_and_cpu(tmp_path, tiny_model_dir,
                                                         monkeypatch):
    """The real key (cluster.auto_resolve.dtype_key): touching the model's weights or another
    CPU identity measures again; the same ones read the cache. The measurement is faked."""
    import shutil

    import specmesh.cluster.auto_resolve as resolve
    import specmesh.engine.forward_probe as probe
    from specmesh.cluster.auto_resolve import auto_dtype

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    calls: list = []

    def fake(m, dtypes, threads, **kw):
        calls.append((m, tuple(dtypes), threads))
        return {"float32": probe.ForwardTiming(8.0, 9.0), "bfloat16": "cannot load"}

    monkeypatch.setattr(resolve, "measure_dtypes", fake)
    cache = AutoCache(tmp_path / "cache")
    got = auto_dtype(str(model), "cpu", 2, cache=cache)
    assert (got.dtype, got.source) == ("float32", "measured") and len(calls) == 1
    assert calls[0][1:] == (("float32", "bfloat16"), 2)
    assert auto_dtype(str(model), "cpu", 2, cache=cache).source == "cached"
    assert auto_dtype(str(model), "cpu", 2, measure=False, cache=cache).source == "cached"
    assert len(calls) == 1
    weights = model / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert auto_dtype(str(model), "cpu", 2, cache=cache).source == "measured"
    assert len(calls) == 2
    real = resolve.cpu_identity()
    monkeypatch.setattr(resolve, "cpu_identity", lambda *a: {**real, "flags": "another"})
    assert auto_dtype(str(model), "cpu", 2, measure=False, cache=cache).source == "rule"
    assert auto_dtype(str(model), "cpu", 2, cache=cache).source == "measured"
    assert len(calls) == 3
    assert auto_dtype(str(model), "cpu", 4, cache=cache).source == "measured"  # threads too


def test_cpu_identity_reads_the_model_name_and_flags(tmp_path):
    from specmesh.engine.devices import cpu_identity

    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("processor\t: 0\nmodel name\t: EPYC X\nflags\t\t: fpu avx2 avx512_bf16\n")
    b.write_text("processor\t: 0\nmodel name\t: EPYC X\nflags\t\t: fpu avx2\n")
    ia, ib = cpu_identity(str(a)), cpu_identity(str(b))
    assert ia["model_name"] == "EPYC X" and ia["flags"] != ib["flags"]
    assert cpu_identity(str(tmp_path / "missing"))["model_name"] == ""


# -- the drafter ------------------------------------------------------------------------------


def test_a_model_drafter_only_where_it_does_not_slow_the_verifier():
    head = "/heads/smollm2"
    # 2 cores: the head's core is half the verifier's
    spec, why = resolve_auto_drafter(head, "SmolLM2", 2, False, 1, 2)
    assert spec == "ngram" and "costs no forward" in why and "2 cores" in why
    assert resolve_auto_drafter(head, "SmolLM2", 4, False, 3, 4)[0] == "ngram"
    assert resolve_auto_drafter(head, "SmolLM2", 8, False, 7, 8)[0] == "eagle"
    assert resolve_auto_drafter(head, "SmolLM2", 64, False, 63, 64)[0] == "eagle"
    # a plan that shares the verifier's cores with the drafter never picks it
    assert resolve_auto_drafter(head, "SmolLM2", 8, False, 8, 8)[0] == "ngram"
    # a GPU verifier: the head drafts on the CPU beside it
    spec, why = resolve_auto_drafter(head, "SmolLM2", 2, True, 1, 2)
    assert spec == "eagle" and "GPU" in why
    # no head shipped: n-gram everywhere
    assert resolve_auto_drafter(None, "tiny", 64, True, 63, 64)[0] == "ngram"


def test_drafter_auto_on_the_command_line_follows_the_thread_plan(tiny_model_dir,
                                                                  monkeypatch):
    """One function decides ``auto`` (cluster.drafter_option.auto_drafter): with a head
    shipped for the target, a 2-core default plan gives n-gram and the full plan a
    ``--thread-plan`` that leaves the verifier its cores gives the head."""
    import specmesh.cluster.drafter_option as option
    from specmesh.cluster.auto_resolve import resolve_settings
    from specmesh.cluster.cli import build_parser
    from specmesh.cluster.options import cluster_config, drafter_plans

    monkeypatch.setattr(option, "shipped_head_for", lambda model: "/heads/tiny")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    args = build_parser().parse_args(["serve", "--model", tiny_model_dir])
    settings = resolve_settings(args, plans=drafter_plans(args))
    assert settings["drafter"].value == ["ngram", {}]
    assert "would slow the verifier" in settings["drafter"].reason
    assert cluster_config(args, settings).drafter.method == "ngram"
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    args = build_parser().parse_args(["serve", "--model", tiny_model_dir,
                                      "--thread-plan", "verifier=8"])
    settings = resolve_settings(args, plans=drafter_plans(args))
    assert settings["drafter"].value == ["eagle", {}]
    assert any(line.startswith("[specmesh] drafter eagle: the EAGLE head")
               for line in banner(settings))


# -- the context length -------------------------------------------------------------------------


def test_max_model_len_is_the_models_bounded_by_the_kv_memory():
    assert default_max_model_len(8192, 11648) == (8192, default_max_model_len(8192, 11648)[1])
    value, why = default_max_model_len(8192, 4096)
    assert value == 4096 and "KV memory" in why
    assert "max_position_embeddings 8192" in default_max_model_len(8192, 9000)[1]
    with pytest.raises(ValueError):
        default_max_model_len(8192, 0)
    assert check_max_model_len(3000, 8192, 11648) == ""
    assert "max_position_embeddings 8192" in check_max_model_len(9000, 8192, 11648)
    assert "--kv-cache-mb" in check_max_model_len(9000, 16384, 4096)
    assert check_max_model_len(1, 8192, 11648)


@pytest.fixture(scope="module")
def long_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a context of 8,192 positions (its config.json only: the weights do
    not depend on it)."""
    import shutil

    path = tmp_path_factory.mktemp("tiny-long") / "model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _serve_config(*argv: str):
    from specmesh.cluster.cli import build_parser
    from specmesh.cluster.options import cluster_config

    return cluster_config(build_parser().parse_args(["serve", *argv]))


def test_a_prompt_beyond_2048_tokens_is_served_by_default(long_model_dir, smollm2_tokenizer):
    """The default context is the model's (8,192 here): the gateway builds a request of a
    3,000-token prompt; one beyond the model's context is 400 naming the limit; the verifier's
    limit is the gateway's."""
    from fastapi.testclient import TestClient

    from specmesh.gateway.app import create_app
    from specmesh.gateway.schemas import CompletionRequest

    cfg = _serve_config("--model", long_model_dir)
    assert cfg.max_model_len == cfg.verifier.max_model_len == 8192
    app = create_app(object(), smollm2_tokenizer, "tiny", cfg.max_model_len)
    req = app.state.gateway.build(CompletionRequest(prompt=[5] * 3000, max_tokens=16),
                                  [5] * 3000, 16, "cmpl-1")
    assert len(req.prompt_token_ids) == 3000 and req.sampling.max_tokens == 16
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": [5] * 9000, "max_tokens": 16})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "9000 tokens" in message and "max_model_len 8192" in message, message


def test_max_model_len_options(long_model_dir, tiny_model_dir):
    # the tiny model: 2 layers x 2 KV heads x 16 dims, float32: 512 bytes a token
    assert _serve_config("--model", tiny_model_dir).max_model_len == 2048
    assert _serve_config("--model", long_model_dir, "--kv-cache-mb", "2").max_model_len == 4096
    assert _serve_config("--model", long_model_dir, "--max-model-len", "3000"
                         ).max_model_len == 3000
    with pytest.raises(SystemExit, match="max_position_embeddings 8192"):
        _serve_config("--model", long_model_dir, "--max-model-len", "10000")
    with pytest.raises(SystemExit, match="--kv-cache-mb"):
        _serve_config("--model", long_model_dir, "--kv-cache-mb", "2", "--max-model-len", "5000")


# -- decided once ---------------------------------------------------------------------------------


def test_the_controller_keeps_the_first_value_of_each_setting():
    c = Controller()
    assert c.settle({}) == {}
    first = {"dtype": Setting("float32", "given", True).as_dict()}
    assert c.settle(first) == first
    later = {"dtype": Setting("bfloat16", "measured").as_dict(),
             "max_model_len": Setting(8192, "model").as_dict()}
    got = c.settle(later)
    assert got["dtype"]["value"] == "float32" and got["max_model_len"]["value"] == 8192


def test_a_later_launch_follows_the_settled_values_or_is_refused():
    settled = {"dtype": Setting("float32", "given", True).as_dict(),
               "max_model_len": Setting(8192, "the model's context").as_dict(),
               "drafter": Setting(["ngram", {}], "n-gram").as_dict()}
    auto = {"dtype": Setting("bfloat16", "rule"), "max_model_len": Setting(4096, "kv"),
            "drafter": Setting(["eagle", {}], "head")}
    got = follow_settled(auto, settled, "verifier")
    assert [got[k].value for k in ("dtype", "max_model_len", "drafter")] == [
        "float32", 8192, ["ngram", {}]]
    assert got["dtype"].reason.startswith("settled by the cluster's controller")
    same = {"dtype": Setting("float32", "given", True)}
    assert follow_settled(same, settled, "verifier")["dtype"].value == "float32"
    with pytest.raises(ValueError, match=r"--dtype bfloat16: this cluster runs float32"):
        follow_settled({"dtype": Setting("bfloat16", "given", True)}, settled, "verifier")
    with pytest.raises(ValueError, match=r"--drafter eagle: this cluster runs ngram"):
        follow_settled({"drafter": Setting(["eagle", {}], "given", True)}, settled, "prefill")
    # the gateway runs no model: a dtype given to it is not refused (nor ever proposed)
    assert follow_settled({"dtype": Setting("bfloat16", "given", True)}, settled,
                          "gateway")["dtype"].value == "float32"
    assert "dtype" not in proposal(auto, "gateway") and "dtype" in proposal(auto, "verifier")


def _launch_args(*argv: str):
    from specmesh.cluster.cli import build_parser

    return build_parser().parse_args(["launch", *argv])


def test_deploy_flow_gateway_without_dtype_follows_roles_given_float32(tiny_model_dir):
    """deploy/README.md's flow at the config level: prefill, drafter and verifier launched
    with ``--dtype float32``, then the gateway without ``--dtype``: every config the launches
    build runs float32 (the gateway's own ``auto`` is never asked), and a later verifier
    given bfloat16 is refused before it starts."""
    from specmesh.cluster.auto_resolve import launch_settings
    from specmesh.cluster.options import cluster_config, drafter_plans

    controller = Controller()
    base = ["--model", tiny_model_dir, "--num-speculative-tokens", "3"]
    dtypes = {}
    for role in ("prefill", "drafter", "verifier"):
        args = _launch_args(role, *base, "--dtype", "float32")
        settings = launch_settings(args, controller.settle, role, drafter_plans(args))
        dtypes[role] = cluster_config(args, settings).dtype
    args = _launch_args("gateway", *base)
    settings = launch_settings(args, controller.settle, "gateway", drafter_plans(args))
    dtypes["gateway"] = cluster_config(args, settings).dtype
    assert set(dtypes.values()) == {"float32"}, dtypes
    assert "settled by the cluster's controller" in settings["dtype"].reason
    args = _launch_args("verifier", *base, "--dtype", "bfloat16")
    with pytest.raises(SystemExit, match="this cluster runs float32"):
        launch_settings(args, controller.settle, "verifier", drafter_plans(args))


def test_a_gateway_launched_first_settles_no_dtype(tiny_model_dir, monkeypatch):
    """The gateway runs no model: launched first it proposes no dtype and measures nothing;
    the first model role's launch settles it."""
    import specmesh.cluster.auto_resolve as resolve
    from specmesh.cluster.auto_resolve import launch_settings

    def no_measurement(*a, **kw):
        raise AssertionError("the gateway measured a dtype")

    monkeypatch.setattr(resolve, "auto_dtype", no_measurement)
    controller = Controller()
    args = _launch_args("gateway", "--model", tiny_model_dir)
    launch_settings(args, controller.settle, "gateway")
    assert "dtype" not in controller.settings and "drafter" in controller.settings
    args = _launch_args("verifier", "--model", tiny_model_dir, "--dtype", "float32")
    assert launch_settings(args, controller.settle, "verifier")["dtype"].value == "float32"
    assert controller.settings["dtype"]["value"] == "float32"


def test_config_settings_record_a_whole_cluster(tiny_model_dir):
    from specmesh.cluster.auto_resolve import config_settings

    cfg = _serve_config("--model", tiny_model_dir, "--drafter", "ngram:min=1")
    got = config_settings(cfg)
    assert got["dtype"]["value"] == cfg.dtype and got["max_model_len"]["value"] == 2048
    assert got["drafter"]["value"] == ["ngram", {"min_ngram": 1}]


def test_serve_gates_speculation_for_model_drafters_by_default():
    """`specmesh serve --speculation-gate auto` (the default) runs the speculation gate with
    the goodput caps (decode/speculation_gate.py) for a drafter that runs a model and not for
    n-gram; on / off as asked; never without the caps or in code unless asked; re-resolved
    when the draft method changes (the bench runs each method from one config)."""
    from dataclasses import replace

    from specmesh.cluster.config import ClusterConfig

    assert not _serve_config("--drafter", "ngram").verifier.gates_speculation
    assert _serve_config("--drafter", "ngram", "--speculation-gate", "on"
                         ).verifier.gates_speculation
    eagle = ClusterConfig.create(model="m", draft_method="eagle", speculation_gate_mode="auto")
    assert eagle.verifier.gates_speculation
    assert not ClusterConfig.create(model="m", draft_method="eagle",
                                    speculation_gate_mode="off").verifier.gates_speculation
    ngram = replace(eagle, verifier=replace(eagle.verifier, draft_method="ngram"),
                    drafter=replace(eagle.drafter, method="ngram"))
    assert not ngram.verifier.gates_speculation
    assert not _serve_config("--speculation-gate", "on", "--goodput-drafts", "off"
                             ).verifier.gates_speculation
    assert not ClusterConfig.create(model="m").verifier.gates_speculation
    assert not ClusterConfig.create(model="m", draft_method="eagle").verifier.gates_speculation
    with pytest.raises(ValueError, match="speculation_gate_mode"):
        ClusterConfig.create(model="m", speculation_gate_mode="sometimes")