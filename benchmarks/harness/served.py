"""The served specmesh systems of ``specmesh bench``: C concurrent ``openai`` clients through
the gateway of a running cluster, kappa switched on the same cluster with
``ClusterHandle.set_num_speculative_tokens``; the verifiers' counters and step profiles (their
``stats`` actor method) are read before and after each pass, so a pass gets its own
per-position accepts and profile."""

from __future__ import annotations

from specmesh.benchmarks.harness.stats import (merge_snapshots, snapshot_delta, verifier_snapshot,
                                 with_drafter_profiles)
from specmesh.cluster.runs import RunResult, run_openai_concurrent


def served_snapshot(handle) -> dict:
    """The summed counters and step profiles of the cluster's verifiers, with the drafters'
    step profiles under ``drafter <phase>`` (one Ray call each)."""
    import ray

    stats = ray.get([a.stats.remote() for a in handle.verifiers()])
    drafted = ray.get([a.stats.remote() for a in handle.drafters()])
    return with_drafter_profiles(merge_snapshots([verifier_snapshot(s) for s in stats]),
                                 [d.get("profile") or {} for d in drafted])


def run_served(handle, client, model: str, prompts: list[dict], max_tokens: int, kappa: int,
               concurrency: int, system: str) -> RunResult:
    """Set kappa on every verifier, then send ``prompts`` from ``concurrency`` clients
    (:func:`cluster.runs.run_openai_concurrent`); adds the verifiers' per-position accepts and
    step profile over the pass. Tokens/s = completion tokens / wall seconds of the pass."""
    handle.set_num_speculative_tokens(kappa)
    before = served_snapshot(handle)
    res = run_openai_concurrent(client, model, prompts, max_tokens, system, concurrency)
    delta = snapshot_delta(before, served_snapshot(handle))
    res.accepted_per_pos = delta["num_accepted_tokens_per_pos"]
    res.profile = delta["profile"]
    return res
