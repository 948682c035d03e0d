"""What ``specmesh bench`` makes of its runs: the summary (medians, ratios, spec stats, output
identity, step profiles), the markdown tables and the plot. Pure functions over
:class:`cluster.runs.RunResult` lists and the summary dict; no torch, no Ray."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.bench_stats import (
    acceptance_per_position,
    add_lists,
    profile_sum,
    profile_summary,
    step_cost_check,
)
from cluster.runs import RunResult
from protocol.spec_stats import SpecStats

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
                ) -> list[System]:
    """The systems of one concurrency level: specmesh served at kappa per draft method (its
    label in the name, e.g. ``served k=4 eagle``) and at kappa = 0 once, the same in-process,
    HF batched greedy, and at concurrency 1 HF with prompt lookup (HF does not batch it).
    With kappa = 0 there are no per-method systems."""
    methods = list(methods) if kappa > 0 else []
    out = [System(f"served k={kappa} {m}", "served", kappa, SERVED_PLAIN, m) for m in methods]
    out.append(System(SERVED_PLAIN, "served", 0))
    out += [System(f"in-process k={kappa} {m}", "inprocess", kappa, INPROCESS_PLAIN, m)
            for m in methods]
    out += [System(INPROCESS_PLAIN, "inprocess", 0), System(HF_BASELINE, "hf")]
    if concurrency == 1:
        out.append(System(f"hf prompt lookup k={max(kappa, 1)}", "hf", max(kappa, 1)))
    return out


def same_outputs(a: RunResult, b: RunResult) -> list[bool]:
    """Per request: identical output? Token ids when both runs have them, else texts."""
    if a.token_ids is not None and b.token_ids is not None:
        return [x == y for x, y in zip(a.token_ids, b.token_ids)]
    return [x == y for x, y in zip(a.texts, b.texts)]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def draft_step_share(profile: dict | None) -> float | None:
    """Share of the verify steps with drafts: request-steps whose request had drafts to
    verify / all request-steps of the pass (from the verifier's step counters; None without
    steps)."""
    c = (profile or {}).get("counters", {})
    return c.get("num_request_steps_with_drafts", 0) / c["num_request_steps"] \
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
              systems: dict[int, list[System]], forward_cost: dict | None = None) -> dict:
    """The whole bench: ``config`` (model, dtype, kappa, drafters, max_tokens, num_prompts,
    repeats, threads, ...), per level :func:`summarize_level`, the measured forward cost
    (:meth:`cluster.forward_cost.ForwardCost.as_dict`), for every profiled kappa > 0 system
    its step-cost check against that ratio, and ``mismatches``: every level's speculative
    systems whose output differs from kappa = 0 (empty when every method is exact)."""
    levels = {}
    for level, level_runs in runs.items():
        lv = summarize_level(level, level_runs, systems[level])
        plain_of = {s.name: s.plain for s in systems[level]}
        for name, s in lv["systems"].items():
            if s.get("profile_raw") and s["kappa"] > 0:
                plain = lv["systems"].get(plain_of.get(name) or "", {}).get("profile_raw")
                s["step_cost"] = step_cost_check(s["profile_raw"],
                                                 forward_cost["ratio"] if forward_cost else None,
                                                 plain)
        levels[str(level)] = lv
    mismatches = [m for lv in levels.values() for m in lv["mismatches"]]
    return {"config": config, "forward_cost": forward_cost, "levels": levels,
            "mismatches": mismatches}


def mismatch_lines(summary: dict) -> list[str]:
    """One loud line per speculative system whose output differs from its kappa = 0
    counterpart's (empty when every method is exact)."""
    return [f"OUTPUT MISMATCH at concurrency {m['concurrency']}: {m['system']} differs from "
            f"{m['plain']} on request(s) {', '.join(str(i) for i in m['requests'])}"
            for m in summary.get("mismatches", [])]


def _frac(flags: list[bool] | None) -> str:
    return "" if flags is None else f"{sum(flags)}/{len(flags)}"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "" if x is None else format(x, fmt)


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} ms"


def thread_plan_text(cfg: dict) -> str:
    """The thread plan of a run's config: torch threads per served role and of the bench
    process (in-process systems and HF)."""
    roles = ", ".join(f"{r} {n}" for r, n in (cfg.get("threads") or {}).items())
    text = f"served roles: {roles}" if roles else "served roles: n/a"
    if cfg.get("bench_threads") is not None:
        text += f"; bench process (in-process, HF): {cfg['bench_threads']}"
    return text


def _per_pos(acc: list[float]) -> str:
    return " / ".join(f"{a:.2f}" for a in acc)


def _identical_k0(s: dict) -> str:
    text = _frac(s["identical_to_k0"])
    return f"**{text} MISMATCH**" if s.get("exact") is False else text


def markdown(summary: dict) -> str:
    """A header (model, dtype, kappa, draft methods, thread plan, how the served clusters ran,
    and a loud line per output mismatch), then a table per concurrency level: system, tokens/s
    (median), ratio to HF, acceptance rate, mean accept length, acceptance per draft
    position, share of verify steps with drafts, identical outputs (vs HF; kappa=K vs
    kappa=0), then the level's ratios; the step profiles and the step-cost check when the
    summary has them."""
    cfg = summary["config"]
    drafters = ", ".join(d["label"] for d in cfg.get("drafters", [])) or cfg.get(
        "draft_method", "")
    lines = [f"# specmesh bench: {cfg['model']} ({cfg['dtype']}), kappa={cfg['kappa']}"
             + (f", drafters {drafters}" if drafters else "")
             + f", max_tokens={cfg['max_tokens']}, {cfg['num_prompts']} prompts, "
             f"{cfg['repeats']} repeat(s)", "", f"- thread plan: {thread_plan_text(cfg)}"]
    if cfg.get("served_clusters"):
        lines.append(f"- served clusters: {cfg['served_clusters']}")
    lines.append("")
    loud = mismatch_lines(summary)
    if loud:
        lines += [f"**{m}**" for m in loud] + [""]
    for level in summary["levels"].values():
        lines += [f"## concurrency {level['concurrency']} ({level['num_requests']} requests)",
                  "", "| system | tokens/s | x HF | acceptance | mean accept len | "
                  "acceptance per position | steps with drafts | identical to HF | "
                  "identical k=K vs k=0 |", "|---" * 9 + "|"]
        for name, s in level["systems"].items():
            spec = s["kappa"] > 0 and s["kind"] != "hf"  # HF reports no spec stats
            lines.append(
                f"| {name} | {s['median_tokens_per_s']:.2f} | {_num(s['ratio_to_hf'])} | "
                f"{_num(s['acceptance_rate']) if spec else ''} | "
                f"{_num(s['mean_accept_len']) if spec else ''} | "
                f"{_per_pos(s.get('acceptance_per_position') or []) if spec else ''} | "
                f"{_num(s.get('verify_steps_with_drafts_share'), '.0%') if spec else ''} | "
                f"{_frac(s['identical_to_hf'])} | {_identical_k0(s)} |")
        lines.append("")
        lines += [f"- {k}: {v:.2f}x" for k, v in level["ratios"].items()]
        lines.append("")
        lines += profile_markdown(level)
    if summary.get("forward_cost"):
        fc = summary["forward_cost"]
        lines += [f"forward cost ({fc['num_tokens']}-token / 1-token forward after "
                  f"{fc['context_len']} tokens): {fc['multi_ms']:.2f} / {fc['single_ms']:.2f} ms "
                  f"= {fc['ratio']:.2f}x", ""]
    return "\n".join(lines)


def profile_markdown(level: dict) -> list[str]:
    """The verifier step profile of the level's kappa > 0 systems that have one: a row per
    phase (p50 / mean ms), the share of verify steps with a usable tail, and the check of
    the mean verify forward with drafts against 1.1 x forward-cost ratio x without drafts."""
    profiled = {n: s for n, s in level["systems"].items() if s.get("profile")}
    if not profiled:
        return []
    names = list(profiled)
    phases: list[str] = []
    for s in profiled.values():
        phases += [p for p in s["profile"]["phases"] if p not in phases]
    lines = [f"### verifier step profile, concurrency {level['concurrency']} (p50 / mean ms)",
             "", "| phase | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for p in phases:
        cells = []
        for n in names:
            ph = profiled[n]["profile"]["phases"].get(p)
            cells.append(f"{ph['p50_ms']:.2f} / {ph['mean_ms']:.2f} (n={ph['count']})"
                         if ph else "")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    lines.append("| steps with a usable tail | " + " | ".join(
        _num(profiled[n]["profile"]["steps_with_tail_share"], ".0%") for n in names) + " |")
    lines.append("| request-steps with a usable tail | " + " | ".join(
        _num(profiled[n]["profile"]["request_steps_with_tail_share"], ".0%")
        for n in names) + " |")
    lines.append("")
    for n in names:
        c = profiled[n].get("step_cost")
        if not c:
            continue
        ok = {True: "within", False: "OVER", None: "n/a"}[c["within_bound"]]
        lines.append(f"- {n}: mean verify forward with drafts {_ms(c['with_drafts_mean_ms'])}, "
                     f"without {_ms(c['without_drafts_mean_ms'])} ({c['without_drafts_from']}); "
                     f"bound {c['tolerance']} x "
                     f"ratio {_num(c['forward_cost_ratio']) or 'n/a'} x without = "
                     f"{_ms(c['bound_ms'])} ({ok})")
    lines.append("")
    return lines


def write_plot(summary: dict, path: str) -> None:
    """A PNG at ``path``: tokens/s vs concurrency per system (left) and acceptance rate per
    draft position of every kappa > 0 specmesh system per level (right). Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    levels = list(summary["levels"].values())
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names: list[str] = []
    for lv in levels:
        names += [n for n in lv["systems"] if n not in names]
    for n in names:
        pts = [(lv["concurrency"], lv["systems"][n]["median_tokens_per_s"])
               for lv in levels if n in lv["systems"]]
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=n)
    ax1.set_xscale("log", base=2)
    ax1.set_xticks([lv["concurrency"] for lv in levels], [str(lv["concurrency"]) for lv in levels])
    ax1.set_xlabel("concurrency (clients / batch size)")
    ax1.set_ylabel("tokens/s (median)")
    ax1.set_title("throughput")
    ax1.legend(fontsize=7)
    for lv in levels:
        for n, s in lv["systems"].items():
            acc = s.get("acceptance_per_position") or []
            if s["kind"] != "hf" and s["kappa"] > 0 and acc:
                ax2.plot(range(1, len(acc) + 1), acc, marker="o",
                         label=f"{n}, C={lv['concurrency']}")
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("accepted / verify steps with drafts")
    ax2.set_ylim(0, 1.05)
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_title("acceptance per draft position")
    if ax2.lines:
        ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
