"""``specmesh env`` and the cluster's CPU backend overrides: the report names every backend with
on/off and why; ``--cpu-backend`` and the environment's switches become one
:class:`BackendOverrides` in the cluster config, which every role applies (and nothing else)."""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys

import pytest

from specmesh.cluster.cli import build_parser, main
from specmesh.cluster.config import ClusterConfig
from specmesh.engine.backend import CHOICES, BackendOverrides, cpu_backend


def test_specmesh_env_prints_every_backend_with_on_off_and_why(capsys):
    assert main(["env", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    backend = cpu_backend(BackendOverrides())
    assert backend.features.model_name in out and "dtype auto" in out and "torch" in out
    for name, choice in backend.choices().items():
        line = next(x for x in out.splitlines() if x.strip().startswith(name + " "))
        assert line.split()[1] in ("on", "off") and len(line.split()) > 2, line
    assert "env" in build_parser().format_help()  # listed by `specmesh --help`


def test_specmesh_env_json_is_the_report_for_machines(capsys):
    from specmesh.engine.devices import resolve_dtype

    assert main(["env", "--json", "--device", "cpu", "--cpu-backend",
                 "compiled_stack=off"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"cpu", "torch", "dtype_auto", "backends"}
    assert report["dtype_auto"]["dtype"] == resolve_dtype("auto", "cpu")
    assert report["dtype_auto"]["why"]
    assert {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"} <= \
        set(report["cpu"]["flags"])
    assert report["torch"]["num_threads"] >= 1 and report["cpu"]["num_cores"] >= 1
    choices = report["backends"]["choices"]
    assert list(choices) == list(CHOICES)
    for c in choices.values():
        assert isinstance(c["on"], bool) and c["why"] and c["dtypes"]
        assert isinstance(c["on_for_dtype"], bool) and c["why_for_dtype"]
        assert c["on"] or not c["on_for_dtype"]
    assert choices["compiled_stack"] == {**choices["compiled_stack"], "on": False,
                                         "why": "switched off by an override "
                                                "(compiled_stack=off)"}
    assert report["backends"]["overrides"] == "compiled_stack=off"


def test_specmesh_env_per_dtype_column(capsys):
    main(["env", "--json", "--dtype", "float64"])
    choices = json.loads(capsys.readouterr().out)["backends"]["choices"]
    assert not choices["layer_ops"]["on_for_dtype"]
    assert "float32 only" in choices["layer_ops"]["why_for_dtype"]


def test_the_console_command_runs():
    done = subprocess.run([sys.executable, "-m", "specmesh.cluster.cli", "env", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert list(json.loads(done.stdout)["backends"]["choices"]) == list(CHOICES)


def test_a_bad_override_is_a_clear_exit():
    with pytest.raises(SystemExit, match="--cpu-backend: .*NAME one of"):
        main(["env", "--cpu-backend", "fast=on"])


def _cluster_config(argv: list[str]) -> ClusterConfig:
    from specmesh.cluster.options import add_cluster_options, cluster_config

    p = argparse.ArgumentParser()
    add_cluster_options(p)
    return cluster_config(p.parse_args(["--device", "cpu", "--drafter", "ngram", *argv]))


def test_the_cluster_config_carries_the_environment_and_cli_overrides(monkeypatch):
    monkeypatch.setenv("SPECMESH_COMPILED_STACK", "0")
    monkeypatch.setenv("SPECMESH_LAYER_OPS", "0")
    cfg = _cluster_config(["--cpu-backend", "eagle_q8_0=off,layer_ops=on"])
    assert cfg.backend == BackendOverrides(compiled_stack=False, eagle_q8_0=False,
                                           layer_ops=True)  # the command line wins
    assert cfg.with_kappa(2).backend == cfg.backend
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # as Ray sends it to every role
    monkeypatch.delenv("SPECMESH_COMPILED_STACK")
    monkeypatch.delenv("SPECMESH_LAYER_OPS")
    assert _cluster_config([]).backend == BackendOverrides()


def test_cluster_config_backend_field():
    assert ClusterConfig.create().backend == BackendOverrides()
    cfg = ClusterConfig.create(backend="gguf_matmul=off")
    assert cfg.backend == BackendOverrides(gguf_matmul=False)
    with pytest.raises(ValueError, match="NAME one of"):
        ClusterConfig.create(backend="gguf=off")
    with pytest.raises(ValueError, match="backend must be"):
        ClusterConfig.create(backend={"gguf_matmul": False})


def test_every_role_builds_its_backend_from_the_cluster_overrides_only(monkeypatch):
    """A role's machine detects, the cluster's overrides apply; the role's own environment
    switches do not (else roles of one cluster could compute differently)."""
    from specmesh.cluster.hosts.base import role_backend

    monkeypatch.setenv("SPECMESH_LAYER_OPS", "0")
    plain = role_backend(ClusterConfig.create())
    assert plain is cpu_backend(BackendOverrides())
    assert plain.layer_ops.on == (plain.features.compiler is not None)
    off = role_backend(ClusterConfig.create(backend=BackendOverrides(layer_ops=False)))
    assert not off.layer_ops.on and not off.compiled_stack.on
    assert "override" in off.layer_ops.why
