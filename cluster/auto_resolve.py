"""The facts ``auto`` decides on, gathered on this machine, and the settings they give
(decision logic: ``cluster/auto.py``).

:func:`resolve_settings` turns the command-line options into the cluster's decided settings
(dtype, max_model_len, drafter, each with its reason); the drivers (``specmesh serve``,
``demo``, ``bench``, ``launch``) call it once with ``measure=True`` before any role starts and
build the :class:`~cluster.config.ClusterConfig` from the result, so every role runs the same
values. :func:`auto_dtype` is what ``--dtype auto`` picks for a model here, with the
measurement behind it (the function ``specmesh env`` can report).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from specmesh.cluster.auto import (
    CPU_CANDIDATES,
    AutoCache,
    DtypeChoice,
    Setting,
    check_max_model_len,
    choose_dtype,
    default_max_model_len,
    follow_settled,
    proposal,
    settled_reason,
)
from specmesh.cluster.config import ClusterConfig, default_threads
from specmesh.cluster.drafter_option import auto_drafter, parse_drafter
from specmesh.engine.devices import cpu_identity, default_dtype, resolve_device
from specmesh.engine.forward_probe import (
    PROBE_CONTEXT_LEN,
    PROBE_STATISTIC,
    PROBE_VERIFY_TOKENS,
    measure_dtypes,
)
from specmesh.engine.kv_cache import num_blocks_for_memory
from specmesh.engine.weights_cache import cache_root

#: KV tokens per block the roles use (no command-line option: ClusterConfig's default)
BLOCK_SIZE: int = ClusterConfig.__dataclass_fields__["block_size"].default


def auto_cache() -> AutoCache:
    """The measurements' cache: ``auto/`` in the weights cache (``$SPECMESH_CACHE_DIR``)."""
    return AutoCache(cache_root() / "auto")


def dtype_key(model: str | None, num_threads: int) -> dict:
    """What a dtype measurement is valid for: the model's files, this CPU, the torch version,
    the verifier's thread count and the probe's shape.

    Raises:
        FileNotFoundError: the model cannot be found.
    """
    from specmesh.engine.loader import model_fingerprint  # the engine's model: triton kernels

    return {"what": "dtype", "model": model_fingerprint(model), "cpu": cpu_identity(),
            "torch": torch.__version__, "threads": int(num_threads),
            "probe": [PROBE_CONTEXT_LEN, PROBE_VERIFY_TOKENS, PROBE_STATISTIC],
            "candidates": [[c.dtype, c.exact] for c in CPU_CANDIDATES]}


def auto_dtype(model: str | None = None, device: str = "auto", num_threads: int | None = None,
               measure: bool = True, cache: AutoCache | None = None) -> DtypeChoice:
    """What ``--dtype auto`` runs ``model`` in here, and why. On a GPU: bfloat16 (a rule, not
    measured). On CPU: the fastest exact candidate (:func:`cluster.auto.choose_dtype`) from a
    measurement of every candidate on ``num_threads`` threads (default: the verifier's share
    of the default plan), cached per model, CPU, torch version and threads; with
    ``measure=False`` a cached measurement or, where there is none, the rule (the exact
    candidate), never a new measurement.

    Raises:
        FileNotFoundError: the model cannot be found (measuring only).
        ValueError: an unknown device.
    """
    if resolve_device(device).type == "cuda":
        return DtypeChoice(default_dtype(device), "a GPU: bfloat16 (a rule, not measured)",
                           "rule")
    threads = num_threads or default_threads()["verifier"]
    cache = auto_cache() if cache is None else cache
    try:
        key = dtype_key(model, threads)
    except FileNotFoundError:
        if measure:
            raise
        key = None
    if not measure:
        return choose_dtype(CPU_CANDIDATES, lambda dtypes: {d: "serve, demo, bench and launch "
                                                             "measure at first start"
                                                             for d in dtypes}, cache, key)

    def run(dtypes: list[str]) -> dict[str, Any]:
        print(f"[specmesh] --dtype auto: measuring {', '.join(dtypes)} forwards on {threads} "
              f"threads (first start on this model and CPU; cached)", flush=True)
        return measure_dtypes(model, dtypes, threads)

    return choose_dtype(CPU_CANDIDATES, run, cache, key)



def auto_max_model_len(model: str | None, dtype: str, kv_cache_mb: int,
                       given: int | None = None, block_size: int = BLOCK_SIZE) -> Setting:
    """``--max-model-len``: ``given`` when it fits, else the model's context bounded by the KV
    tokens a role's ``kv_cache_mb`` holds in ``dtype``
    (:func:`cluster.auto.default_max_model_len`).

    Raises:
        SystemExit: a ``given`` value the model or the KV memory cannot hold, or a KV memory
            that holds no request.
        FileNotFoundError: the model cannot be found.
    """
    from specmesh.engine.loader import model_config  # the engine's model: triton kernels

    config = model_config(model, dtype)
    kv_tokens = num_blocks_for_memory(config, block_size, dtype, kv_cache_mb << 20) * block_size
    model_max = config.max_position_embeddings
    if given is not None:
        why = check_max_model_len(given, model_max, kv_tokens)
        if why:
            raise SystemExit(why)
        return Setting(int(given), "given", True)
    try:
        value, why = default_max_model_len(model_max, kv_tokens)
    except ValueError as err:
        raise SystemExit(f"--kv-cache-mb {kv_cache_mb}: {err}") from None
    return Setting(value, f"{why}; --kv-cache-mb {kv_cache_mb} holds {kv_tokens} tokens",
                   False)


def resolve_settings(args: argparse.Namespace, measure: bool = False,
                     settled: dict | None = None, role: str | None = None,
                     plans: tuple[dict, dict] | None = None) -> dict[str, Setting]:
    """The dtype, max_model_len and drafter the options in ``args`` give, each with why:
    a given value as is, ``auto`` resolved (dtype: :func:`auto_dtype`, measured only with
    ``measure``; drafter: :func:`auto_drafter` over ``plans``; context:
    :func:`auto_max_model_len`). ``settled``: the controller's settings (name -> Setting
    dict), whose dtype an ``auto`` here takes instead of measuring; ``role``: the role
    launched (the gateway runs no model: its dtype is not measured).

    Raises:
        SystemExit: a model that cannot be found, an impossible ``--max-model-len``, or a
            malformed ``--drafter``.
    """
    model, device = args.model, args.device
    settled = settled or {}
    try:
        if args.dtype != "auto":
            dtype = Setting(args.dtype, "given", True)
        elif "dtype" in settled:
            dtype = Setting(settled["dtype"]["value"],
                            settled_reason(Setting.from_dict(settled["dtype"])))
        elif role == "gateway":
            dtype = Setting(default_dtype(device), "the gateway runs no model (its dtype is "
                            "not compared with the verifiers')")
        else:
            threads = plans[1]["verifier"] if plans else None
            choice = auto_dtype(model, device, threads, measure=measure)
            dtype = Setting(choice.dtype, choice.reason)
        given_len = getattr(args, "max_model_len", None)
        max_len = auto_max_model_len(model, dtype.value, args.kv_cache_mb, given_len)
    except FileNotFoundError as err:
        raise SystemExit(f"--model: {err}") from None
    flags = vars(args)  # the methods' own flags (e.g. --ngram-tree-width)
    if (args.drafter or "auto").strip() == "auto":
        spec, why = auto_drafter(model, device, plans)
        drafter = Setting(list(parse_drafter(spec, model, flags)), why)
    else:
        drafter = Setting(list(parse_drafter(args.drafter, model, flags)), "given", True)
    return {"dtype": dtype, "max_model_len": max_len, "drafter": drafter}


def config_settings(cfg: Any) -> dict[str, dict]:
    """The decided settings a :class:`~cluster.config.ClusterConfig` carries, as the
    controller keeps them (a cluster started whole records them there too)."""
    why = "the value the cluster was started with"
    return {"dtype": Setting(cfg.dtype, why).as_dict(),
            "max_model_len": Setting(cfg.max_model_len, why).as_dict(),
            "drafter": Setting([cfg.drafter.method, dict(cfg.drafter.method_kwargs)],
                               why).as_dict()}


def launch_settings(args: argparse.Namespace, settle: Callable[[dict], dict], role: str,
                    plans: tuple[dict, dict] | None = None) -> dict[str, Setting]:
    """The settings of one role joined with ``specmesh launch``, decided once for the cluster:
    ``settle`` is the controller's :meth:`~cluster.controller.Controller.settle` (``{}`` reads
    what is settled). What the cluster settled already is taken where ``args`` say ``auto``
    (no measurement then); the rest is resolved here, proposed, and the controller's answer
    followed (:func:`cluster.auto.follow_settled`).

    Raises:
        SystemExit: a value given explicitly that differs from the settled one (the role would
            be refused by its peers), or any error of :func:`resolve_settings`.
    """
    settled = settle({})
    ours = resolve_settings(args, measure=True, settled=settled, role=role, plans=plans)
    settled = settle(proposal(ours, role))
    try:
        return follow_settled(ours, settled, role)
    except ValueError as err:
        raise SystemExit(f"specmesh launch {role}: {err}") from None
