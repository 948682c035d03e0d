"""``--device``: names accepted, GPU shares per model role."""

from __future__ import annotations

import pytest
import torch

from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.launcher import model_role_gpus
from specmesh.engine.devices import check_device, resolve_device


def test_device_names():
    for ok in ("auto", "cpu", "cuda", "cuda:1"):
        assert check_device(ok) == ok
    for bad in ("gpu", "cuda:", "cuda:x", "tpu"):
        with pytest.raises(ValueError, match="unknown device"):
            check_device(bad)
    with pytest.raises(ValueError, match="unknown device"):
        ClusterConfig.create(device="gpu")
    assert resolve_device("cpu") == torch.device("cpu")
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_device("cuda")


def test_model_role_gpus():
    cfg = ClusterConfig.create()
    assert model_role_gpus(cfg, 0, 2) == 0
    assert model_role_gpus(cfg, 1, 2) == 0.5
    assert model_role_gpus(cfg, 4, 2) == 1.0
    assert model_role_gpus(ClusterConfig.create(device="cpu"), 4, 2) == 0


def test_auto_dtype_rule_is_the_exact_dtype_on_cpu(tmp_path):
    """Unmeasured, ``auto`` on CPU is float32 whatever the CPU's bf16 support: the exact
    dtype (cluster/auto.py measures the candidates and picks the fastest exact one)."""
    from specmesh.engine.devices import cpu_flags, default_dtype, resolve_dtype

    assert default_dtype("cpu") == "float32"
    assert resolve_dtype("float64", "cpu") == "float64"
    assert resolve_dtype("auto", "cpu") == "float32"
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == set()


def test_cli_dtype_auto_is_resolved_in_the_cluster_config():
    import argparse

    from specmesh.cluster.options import add_cluster_options, cluster_config
    from specmesh.engine.devices import default_dtype

    p = argparse.ArgumentParser()
    add_cluster_options(p)
    cfg = cluster_config(p.parse_args(["--device", "cpu"]))
    assert cfg.dtype == default_dtype("cpu")
    assert cluster_config(p.parse_args(["--dtype", "float32"])).dtype == "float32"
