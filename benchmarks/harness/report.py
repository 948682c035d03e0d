"""What ``specmesh bench`` makes of its runs: the summary (medians, ratios, spec stats, output
identity, step profiles) as a dict. Pure functions over :class:`cluster.runs.RunResult` lists;
no torch, no Ray. The markdown tables and the plot of a summary: benchmarks/harness/render.py."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from specmesh.benchmarks.harness.stats import (
    acceptance_per_position,
    add_lists,
    profile_sum,
    profile_summary,
    step_cost_check,
)
from specmesh.cluster.runs import RunResult, same_outputs
from specmesh.protocol.spec_stats import SpecStats

#: Name of the baseline every ratio is taken against.
HF_BASELINE = "hf generate"


@dataclass(frozen=True)
class System:
    """One benchmarked system: ``kind`` is ``served`` (through the gateway), ``inprocess``
    (the workers in the bench process) or ``hf``; ``kappa`` its drafts per step (0 = none);
    ``plain`` the name of its kappa = 0 counterpart (None if it has none); ``method`` the
    label of its draft method (``--drafters``; None for kappa = 0 and HF)."""

    name: str
    kind: str
    kappa: int = 0
    plain: str | None = None
    method: str | None = None


SERVED_PLAIN = "served k=0"
INPROCESS_PLAIN = "in-process k=0"


def systems_for(kappa: int, concurrency: int, methods: Sequence[str] = ("ngram",),
                served_only: Sequence[str] = ()) -> list[System]:
    """The systems of one concurrency level: specmesh served at kappa per draft method (its
    label in the name, e.g. ``served k=4 eagle``) and at kappa = 0 once, the same in-process
    (except for the ``served_only`` methods: thread-plan variants), HF batched greedy, and at
    concurrency 1 HF with prompt lookup (HF does not batch it). With kappa = 0 there are no
    per-method systems."""
    methods = list(methods) if kappa > 0 else []
    out = [System(f"served k={kappa} {m}", "served", kappa, SERVED_PLAIN, m) for m in methods]
    out.append(System(SERVED_PLAIN, "served", 0))
    out += [System(f"in-process k={kappa} {m}", "inprocess", kappa, INPROCESS_PLAIN, m)
            for m in methods if m not in served_only]
    out += [System(INPROCESS_PLAIN, "inprocess", 0), System(HF_BASELINE, "hf")]
    if concurrency == 1:
        out.append(System(f"hf prompt lookup k={max(kappa, 1)}", "hf", max(kappa, 1)))
    return out


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def draft_step_share(profile: dict | None) -> float | None:
    """Share of the verify steps with drafts: request-steps whose request had drafts to
    verify / all request-steps of the pass (from the verifier's step counters; None without
    steps)."""
    c = (profile or {}).get("counters", {})
    return c.get("num_request_steps_with_drafts", 0) / c["num_request_steps"] \
        if c.get("num_request_steps") else None


def accepted_per_step(spec: SpecStats, profile: dict | None) -> float | None:
    """Accepted drafts per verify step over all of the run's request-steps, drafts or not
    (SGLang's accept length less its bonus token): what a drafter adds to every step, where
    ``mean_accept_len`` (vLLM's) averages over the steps that had drafts only (None without
    the verifier's step counters)."""
    c = (profile or {}).get("counters", {})
    return spec.num_accepted_tokens / c["num_request_steps"] \
        if c.get("num_request_steps") else None


def summarize_system(system: System, runs: list[RunResult], level_runs: dict[str, list[RunResult]],
                     ) -> dict:
    """One system at one level: median and all tokens/s (completion tokens / wall seconds),
    spec stats summed over repeats, acceptance per draft position, the share of verify steps
    with drafts, output identity of the first repeat vs HF and vs its kappa = 0 counterpart
    (``exact``: every output identical to it), and its step profile."""
    spec = SpecStats()
    per_pos: list[int] = []
    profile: dict | None = None
    for r in runs:
        spec.add(r.spec)
        per_pos = add_lists(per_pos, r.accepted_per_pos)
        if r.profile is not None:
            profile = profile_sum(profile or {}, r.profile)
    per_pos = per_pos[:system.kappa]  # the verifier counts up to its max kappa; K are drafted
    first = runs[0]
    hf = level_runs.get(HF_BASELINE)
    plain = level_runs.get(system.plain) if system.plain else None
    tps = [r.tokens_per_s for r in runs]
    identical_k0 = same_outputs(first, plain[0]) if plain else None
    out = {"kind": system.kind, "kappa": system.kappa, "method": system.method,
           "median_tokens_per_s": _median(tps), "all_tokens_per_s": tps,
           "num_tokens": [r.num_tokens for r in runs], "seconds": [r.seconds for r in runs],
           "spec_stats": spec.as_dict(), "acceptance_rate": spec.acceptance_rate,
           "mean_accept_len": spec.mean_accept_len,
           "accepted_per_pos": per_pos,
           "acceptance_per_position": acceptance_per_position(per_pos, spec.num_verify_steps),
           "verify_steps_with_drafts_share": draft_step_share(profile),
           "accepted_per_step": accepted_per_step(spec, profile),
           "identical_to_hf": (same_outputs(first, hf[0])
                               if hf and system.name != HF_BASELINE else None),
           "identical_to_k0": identical_k0,
           "exact": all(identical_k0) if identical_k0 is not None else None,
           "texts": first.texts, "token_ids": first.token_ids}
    if profile is not None:
        out["profile"] = profile_summary(profile)
        out["profile_raw"] = profile
    return out


def summarize_level(level: int, runs: dict[str, list[RunResult]], systems: list[System]) -> dict:
    """Every system of one concurrency level plus the ratios that matter: each to HF, spec to
    plain, served to in-process (same kappa and method); ``mismatches``: the speculative
    systems whose output differs from their kappa = 0 counterpart's (request indices)."""
    out = {name: summarize_system(s, runs[s.name], runs)
           for s in systems if (name := s.name) in runs}
    hf = out.get(HF_BASELINE, {}).get("median_tokens_per_s")
    for s in out.values():
        s["ratio_to_hf"] = s["median_tokens_per_s"] / hf if hf else None
    ratios = {}
    by_kind = {(s.kind, s.kappa, s.method): s.name for s in systems if s.name in out}
    for s in systems:
        if s.name not in out:
            continue
        if s.plain and s.plain in out and out[s.plain]["median_tokens_per_s"]:
            ratios[f"{s.name} / {s.plain}"] = (out[s.name]["median_tokens_per_s"]
                                               / out[s.plain]["median_tokens_per_s"])
        twin = by_kind.get(("inprocess", s.kappa, s.method)) if s.kind == "served" else None
        if twin and out[twin]["median_tokens_per_s"]:
            ratios[f"{s.name} / {twin}"] = (out[s.name]["median_tokens_per_s"]
                                            / out[twin]["median_tokens_per_s"])
    plain_of = {s.name: s.plain for s in systems}
    mismatches = [{"concurrency": level, "system": name, "plain": plain_of[name],
                   "requests": [i for i, same in enumerate(s["identical_to_k0"]) if not same]}
                  for name, s in out.items() if s["exact"] is False]
    return {"concurrency": level, "num_requests": len(next(iter(runs.values()))[0].texts)
            if runs else 0, "systems": out, "ratios": ratios, "mismatches": mismatches}


def summarize(config: dict, runs: dict[int, dict[str, list[RunResult]]],
              systems: dict[int, list[System]],
              forward_cost: dict[str, dict] | None = None) -> dict:
    """The whole bench: ``config`` (model, dtype, kappa, drafters, max_tokens, num_prompts,
    repeats, threads, ...), per level :func:`summarize_level`, the measured forward cost per
    level (``forward_cost``: concurrency as a string -> the
    :meth:`cluster.forward_cost.ForwardCost.as_dict` of a batch that size), for every
    profiled kappa > 0 system its step-cost check against its level's ratio, and
    ``mismatches``: every level's speculative systems whose output differs from kappa = 0
    (empty when every method is exact). ``forward_cost`` in the result is the smallest
    level's (batch 1 where the bench ran concurrency 1), ``forward_cost_by_level`` all."""
    levels = {}
    by_level = forward_cost or {}
    for level, level_runs in runs.items():
        lv = summarize_level(level, level_runs, systems[level])
        plain_of = {s.name: s.plain for s in systems[level]}
        cost = by_level.get(str(level))
        for name, s in lv["systems"].items():
            if s.get("profile_raw") and s["kappa"] > 0:
                plain = lv["systems"].get(plain_of.get(name) or "", {}).get("profile_raw")
                s["step_cost"] = step_cost_check(s["profile_raw"],
                                                 cost["ratio"] if cost else None, plain)
        levels[str(level)] = lv
    mismatches = [m for lv in levels.values() for m in lv["mismatches"]]
    first = by_level[min(by_level, key=int)] if by_level else None
    return {"config": config, "forward_cost": first, "forward_cost_by_level": by_level or None,
            "levels": levels, "mismatches": mismatches}


def mismatch_lines(summary: dict) -> list[str]:
    """One loud line per speculative system whose output differs from its kappa = 0
    counterpart's (empty when every method is exact)."""
    return [f"OUTPUT MISMATCH at concurrency {m['concurrency']}: {m['system']} differs from "
            f"{m['plain']} on request(s) {', '.join(str(i) for i in m['requests'])}"
            for m in summary.get("mismatches", [])]
