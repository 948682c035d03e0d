"""``--device``: names accepted, GPU shares per model role."""

from __future__ import annotations

import pytest
import torch

from cluster.config import ClusterConfig
from cluster.launcher import model_role_gpus
from engine.devices import check_device, resolve_device


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
