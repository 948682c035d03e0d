"""``--kv-cache-dtype`` (vLLM's option) from the command line to the roles: every cluster command
takes it, the ClusterConfig keeps it and refuses what a model cannot have, the prefill /
verifier host builds its cache in it (twice the blocks of a float32 cache in the same MiB), and
every role announces it in its Hello identity."""

from __future__ import annotations

import pytest
import torch

from specmesh.cluster.cli import build_parser
from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.hosts.base import loaded_runner
from specmesh.cluster.options import cluster_config
from specmesh.engine.loader import model_identity


@pytest.mark.parametrize("command", ["serve", "demo", "bench", "launch verifier", "generate"])
def test_every_model_command_takes_the_option(command):
    extra = ["--prompt", "hi"] if command == "generate" else []
    args = build_parser().parse_args(command.split() + extra
                                     + ["--dtype", "float32", "--kv-cache-dtype", "bfloat16"])
    assert args.kv_cache_dtype == "bfloat16"
    default = build_parser().parse_args(command.split() + extra)
    assert default.kv_cache_dtype == "auto"


def test_the_cluster_config_keeps_it():
    args = build_parser().parse_args(["serve", "--dtype", "float32", "--device", "cpu",
                                      "--kv-cache-dtype", "float16", "--drafter", "ngram"])
    assert cluster_config(args).kv_cache_dtype == "float16"
    with pytest.raises(SystemExit):  # not a choice
        build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])


@pytest.mark.parametrize("settings, match", [
    ({"dtype": "bfloat16", "kv_cache_dtype": "float16"}, "needs a float32 model"),
    ({"dtype": "float64", "kv_cache_dtype": "bfloat16"}, "needs a float32 model"),
    ({"dtype": "float32", "kv_cache_dtype": "bfloat16", "device": "cuda"}, "CPU only"),
    ({"dtype": "float32", "kv_cache_dtype": "int8"}, "unknown kv_cache_dtype"),
])
def test_the_cluster_config_refuses_what_the_model_cannot_have(settings, match):
    with pytest.raises(ValueError, match=match):
        ClusterConfig(**settings)
    ClusterConfig(dtype="bfloat16", kv_cache_dtype="bfloat16")  # its own dtype: fine


def test_roles_build_and_announce_the_cache(tiny_model_dir):
    base = dict(model=tiny_model_dir, dtype="float32", device="cpu", kv_cache_mb=1)
    _, runner32, bm32 = loaded_runner(ClusterConfig(**base))
    _, runner16, bm16 = loaded_runner(ClusterConfig(**base, kv_cache_dtype="bfloat16"))
    assert runner32.kv_cache.dtype == torch.float32 and runner16.kv_cache.dtype == torch.bfloat16
    assert runner16.model.dtype == torch.float32
    assert runner16.kv_cache.num_blocks == 2 * runner32.kv_cache.num_blocks
    assert bm16.num_free_blocks == runner16.kv_cache.num_blocks
    assert model_identity(tiny_model_dir, "float32", 16, "bfloat16")["kv_cache_dtype"] == \
        "bfloat16"
    assert model_identity(tiny_model_dir, "float32", 16)["kv_cache_dtype"] == "float32"
