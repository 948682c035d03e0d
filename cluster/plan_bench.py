"""This machine's break-even batch per drafter, from a ``specmesh bench`` JSON
(``specmesh plan --from-bench``).

The chapter's model (decode/speedup_model.py) needs four numbers; a bench run measures each:

- ``t_star``, the knee of the verify forward's cost: ``--profile`` times a forward of 1 and of
  ``kappa + 1`` tokens per request at every concurrency (``forward_cost_by_level``,
  benchmarks/harness/method_table.py), points ``(N query tokens, ms)``. A least-squares line
  ``t(N) = a + b*N`` through them is the roofline ``a * max(1, N / t_star)`` smoothed at the
  knee, ``t_star = a / b``: the token count at which the forward's per-token compute equals
  its fixed cost (reading the weights once). ``t_T = a + b`` is a batch-1 decode step;
- ``E`` per drafter: 1 + its acceptance per draft position (the share of verify steps that
  accepted at least i + 1 drafts) at the smallest concurrency;
- the drafting cost the verifier pays, ``extra``: specmesh's drafters run in their own
  processes ahead of the verifier (the decoupled form), so what a round costs the verifier
  beyond its forward is the time it waited for tails (the ``tail_wait`` phase of its step
  profile), in ``t_T``; ``c`` (the drafter's ``propose`` time over ``t_T``) is reported too;
- ``kappa``: the bench's.

Break-even ``B = t_star * (E - extra) / (kappa + 1)`` (the chapter's roofline) and, from the
fitted line itself, where ``E * t(B) = t(B * (kappa + 1)) + extra``
(:func:`decode.speedup_model.break_even_linear`: on a CPU the forward grows with its tokens
from the first, so the line, not the roofline, is what was measured). Next to them, the
measured crossing: at
each concurrency the served ``kappa`` system's tokens/s over served ``kappa = 0``'s, and the
concurrency where that ratio crosses 1 (interpolated in log concurrency between the levels
around it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specmesh.cluster.plan_ties import method_ties
from specmesh.decode.speedup_model import (
    break_even_for_tokens,
    break_even_linear,
    conditional_acceptance,
    fitted_alpha,
    tokens_per_round_positions,
)


def knee(forward_cost_by_level: dict | None) -> dict | None:
    """``{"t_star", "step_ms", "fixed_ms", "per_token_ms", "points"}`` fitted to the bench's
    measured forwards (module doc); None without them (a bench run without ``--profile``).
    ``t_star`` is None when the fit finds no per-token cost (a flat or falling line)."""
    points = []
    for cost in (forward_cost_by_level or {}).values():
        batch = cost.get("batch", 1)
        points.append((float(batch), float(cost["single_ms"])))
        points.append((float(batch * cost["num_tokens"]), float(cost["multi_ms"])))
    if len({n for n, _ in points}) < 2:
        return None
    n_mean = sum(n for n, _ in points) / len(points)
    t_mean = sum(t for _, t in points) / len(points)
    slope = (sum((n - n_mean) * (t - t_mean) for n, t in points)
             / sum((n - n_mean) ** 2 for n, _ in points))
    fixed = t_mean - slope * n_mean
    t_star = fixed / slope if slope > 0 and fixed > 0 else None
    return {"t_star": t_star, "step_ms": fixed + slope, "fixed_ms": fixed,
            "per_token_ms": slope, "points": sorted(points)}


def _phase_ms(system: dict, phase: str) -> float | None:
    return (((system.get("profile") or {}).get("phases") or {}).get(phase) or {}).get("mean_ms")


def _systems(summary: dict, level: str, kind: str) -> dict[str, dict]:
    return {name: s for name, s in summary["levels"][level]["systems"].items()
            if s.get("kind") == kind}


def measured_crossing(ratios: Sequence[tuple[int, float]]) -> dict:
    """Where measured speedups (``(concurrency, ratio)``, ascending) cross 1: ``pays_at``
    (the concurrencies where speculation was at least as fast), ``batch`` (the concurrency
    where the ratio falls through 1 after the last level where it paid, log-linear between
    the two levels around it; None when it does not fall through within the levels run) and
    ``bound``: ``"below"`` (slower at every level: the break-even lies below the smallest),
    ``"above"`` (at least as fast at the largest level) or ``"crossed"``."""
    pays_at = [b for b, r in ratios if r >= 1]
    out: dict = {"pays_at": pays_at, "batch": None, "bound": None}
    if not ratios:
        return out
    if not pays_at:
        return dict(out, bound="below")
    if ratios[-1][1] >= 1:
        return dict(out, bound="above")
    i = max(j for j, (_, r) in enumerate(ratios) if r >= 1)
    (b0, r0), (b1, r1) = ratios[i], ratios[i + 1]
    x0, x1 = math.log(b0), math.log(b1)
    return dict(out, batch=math.exp(x0 + (r0 - 1) / (r0 - r1) * (x1 - x0)), bound="crossed")


def drafter_plan(summary: dict, label: str, fit: dict | None) -> dict:
    """One drafter's figures from a bench ``summary`` (module doc): per level its acceptance,
    ``E``, fitted ``alpha``, tail wait and measured speedup over served ``kappa = 0``; the
    modelled break-even batch (None without the forward-cost fit) and the measured crossing.
    Its served systems are used, else its in-process ones."""
    kappa = int(summary["config"]["kappa"])
    levels = sorted(summary["levels"], key=int)
    kind = "served" if any(
        s.get("method") == label and s.get("kappa", 0) > 0
        for s in _systems(summary, levels[0], "served").values()) else "inprocess"
    rows = []
    for level in levels:
        systems = _systems(summary, level, kind)
        spec = next((s for s in systems.values()
                     if s.get("method") == label and s.get("kappa", 0) > 0), None)
        plain = next((s for s in systems.values() if s.get("kappa", 0) == 0), None)
        if spec is None:
            continue
        shares = list(spec.get("acceptance_per_position") or [])
        ratio = (spec["median_tokens_per_s"] / plain["median_tokens_per_s"]
                 if plain and plain.get("median_tokens_per_s") else None)
        rows.append({"concurrency": int(level), "acceptance_per_position": shares,
                     "conditional_acceptance": conditional_acceptance(shares),
                     "tokens_per_round": tokens_per_round_positions(shares),
                     "alpha": fitted_alpha(shares), "tail_wait_ms": _phase_ms(spec, "tail_wait"),
                     "propose_ms": _phase_ms(spec, "drafter propose"),
                     "speedup_measured": ratio})
    out = {"drafter": label, "systems": kind, "kappa": kappa, "levels": rows,
           "break_even_batch": None, "break_even_batch_linear": None, "extra": None,
           "c": None,
           "measured": measured_crossing([(r["concurrency"], r["speedup_measured"])
                                          for r in rows if r["speedup_measured"] is not None])}
    if not rows:
        return out
    first = rows[0]
    if fit is not None and fit["step_ms"] > 0:
        step = fit["step_ms"]
        out["extra"] = (first["tail_wait_ms"] or 0.0) / step
        out["c"] = first["propose_ms"] / step if first["propose_ms"] is not None else None
        if fit["t_star"] is not None:
            out["break_even_batch"] = break_even_for_tokens(
                first["tokens_per_round"], kappa, fit["t_star"], out["extra"])
        out["break_even_batch_linear"] = break_even_linear(
            first["tokens_per_round"], kappa, fit["fixed_ms"], fit["per_token_ms"],
            first["tail_wait_ms"] or 0.0)
    return out


def machine_plan(summary: dict) -> dict:
    """Every drafter of a bench ``summary`` (its ``config.drafters``): ``{"model", "dtype",
    "kappa", "knee", "drafters": [drafter_plan...], "methods" (the chain-vs-parallel ties
    per method from the bench's per-method table, cluster/plan_ties.py; None without one),
    "notes"}``.

    Raises:
        ValueError: not a ``specmesh bench`` JSON, or one that ran no kappa > 0.
    """
    if not isinstance(summary, dict) or "levels" not in summary or "config" not in summary:
        raise ValueError("not a `specmesh bench --json` file (no 'config' / 'levels')")
    config = summary["config"]
    if int(config.get("kappa", 0)) < 1:
        raise ValueError("the bench ran kappa = 0 only: no drafter to plan for")
    labels = [d["label"] for d in config.get("drafters") or []] or [config.get("draft_method")]
    fit = knee(summary.get("forward_cost_by_level"))
    notes = []
    if fit is None:
        notes.append("no forward costs in the file (run `specmesh bench --profile`): the "
                     "modelled break-even needs them; the measured crossing is shown alone")
    elif fit["t_star"] is None:
        notes.append("the measured forwards show no per-token cost: no knee to fit")
    return {"model": config.get("model"), "dtype": config.get("dtype"),
            "kappa": int(config["kappa"]), "knee": fit,
            "drafters": [drafter_plan(summary, label, fit) for label in labels],
            "methods": method_ties(summary), "notes": notes}


__all__ = ["drafter_plan", "knee", "machine_plan", "measured_crossing"]
