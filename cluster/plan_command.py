"""``specmesh plan``: when speculation pays, before deploying it. The chapter's economics
(decode/speedup_model.py) for the acceptance, draft cost, kappa and forward-cost knee given on
the command line, as a table or ``--json``; with ``--from-bench`` the same break-even from a
``specmesh bench --profile`` JSON, per drafter, for the machine the bench ran on
(cluster/plan_bench.py), and per method of its per-method table the chain-vs-parallel tie
acceptance for the measured c (cluster/plan_ties.py)."""

from __future__ import annotations

import argparse

from specmesh.cluster.plan_ties import render_ties
from specmesh.decode.speedup_model import plan


def add_plan_options(p: argparse.ArgumentParser) -> None:
    """The options of ``specmesh plan`` (defaults: the chapter's Llama-3-8B / 1B-draft example
    on an H100)."""
    p.add_argument("--acceptance", type=float, default=0.70, metavar="ALPHA",
                   help="alpha: the chance a draft is accepted once the ones before it were "
                        "(default 0.70)")
    p.add_argument("--parallel-acceptance", type=float, default=None, metavar="ALPHA",
                   help="alpha of a parallel drafter (its drafts never saw each other: usually "
                        "lower; default: --acceptance)")
    p.add_argument("--kappa", type=int, default=3,
                   help="drafts per round (num_speculative_tokens; default 3)")
    p.add_argument("--draft-cost", type=float, default=0.165, metavar="C",
                   help="c = t_draft / t_target: one draft pass over one target decode step "
                        "(default 0.165)")
    p.add_argument("--t-star", type=float, default=295.0, metavar="TOKENS",
                   help="T*: query tokens at which the target forward turns compute-bound "
                        "(default 295)")
    p.add_argument("--from-bench", default=None, metavar="FILE.json",
                   help="a `specmesh bench --profile --json` file: this machine's break-even "
                        "batch per drafter, from its measured acceptance and forward costs, "
                        "and per method the chain-vs-parallel tie acceptance for its "
                        "measured c")
    p.add_argument("--json", action="store_true", help="the report as JSON")


def plan_report(args: argparse.Namespace) -> dict:
    """The report of the command-line figures.

    Raises:
        SystemExit: a value out of range, with the reason.
    """
    try:
        return plan(args.acceptance, args.kappa, args.draft_cost, args.t_star,
                    parallel_alpha=args.parallel_acceptance)
    except ValueError as err:
        raise SystemExit(f"specmesh plan: {err}") from None


def _batch(b: float | None) -> str:
    if b is None:
        return "-"
    return "never pays" if b == 0 else f"{b:.0f}"


def render_plan(report: dict) -> str:
    """The report of :func:`decode.speedup_model.plan` as a table."""
    i = report["inputs"]
    lines = [f"kappa {i['kappa']}, c {i['c']:g} (draft pass / target step), T* {i['t_star']:g} "
             f"tokens",
             f"{'drafting':<10} {'alpha':>6} {'E':>6} {'round cost':>10} {'speedup':>8} "
             f"{'break-even B':>12} {'S_inf':>6}"]
    for r in report["rows"]:
        lines.append(f"{r['drafting']:<10} {r['alpha']:>6.3f} {r['tokens_per_round']:>6.3f} "
                     f"{r['round_cost']:>10.3f} {r['speedup']:>7.2f}x "
                     f"{_batch(r['break_even_batch']):>12} {r['asymptotic_speedup']:>6.2f}")

    def alpha(a: float | None) -> str:
        return "never (even alpha = 1)" if a is None else f"alpha {a:.3f}"

    chain = report["rows"][0]
    lines.append(f"a parallel drafter ties no speculation at "
                 f"{alpha(report['parallel_ties_no_speculation_alpha'])} and the chain "
                 f"({chain['speedup']:.2f}x at alpha {chain['alpha']:g}) at "
                 f"{alpha(report['parallel_ties_chain_alpha'])}")
    lines.append("chain: kappa draft passes then the verify; parallel: one pass drafts all; "
                 "decoupled: a chain drafter on its own hardware, overlapped with the verify")
    return "\n".join(lines)


def render_machine(report: dict) -> str:
    """The report of :func:`cluster.plan_bench.machine_plan` as text: the knee, per drafter
    its break-even batch, then per method the chain-vs-parallel ties (cluster/plan_ties.py)."""
    fit = report["knee"]
    lines = [f"{report['model']} ({report['dtype']}), kappa {report['kappa']}"]
    if fit is not None:
        t_star = f"{fit['t_star']:.1f} tokens" if fit["t_star"] is not None else "none"
        lines.append(f"verify forward: {fit['fixed_ms']:.2f} ms + {fit['per_token_ms']:.3f} "
                     f"ms/token (batch-1 step {fit['step_ms']:.2f} ms), T* {t_star}")
    lines += [f"note: {n}" for n in report["notes"]]
    for d in report["drafters"]:
        lines.append(f"drafter {d['drafter']} ({d['systems']}):")
        for r in d["levels"]:
            s = r["speedup_measured"]
            lines.append(f"  C={r['concurrency']:<3} E {r['tokens_per_round']:.2f} "
                         f"(alpha {r['alpha']:.2f}), tail wait "
                         f"{r['tail_wait_ms'] or 0.0:.2f} ms/step, measured "
                         f"{'-' if s is None else f'{s:.2f}x'} over kappa 0")
        extra = "" if d["extra"] is None else f" (drafting the verifier waits for: " \
                                               f"{d['extra']:.3f} steps)"
        lines.append(f"  break-even batch, model (roofline, T*): "
                     f"{_batch(d['break_even_batch'])}{extra}")
        if fit is not None:
            linear = d["break_even_batch_linear"]
            lines.append(f"  break-even batch, model (the fitted line): "
                         f"{'never' if linear is None else _batch(linear)}")
        m = d["measured"]
        pays = ", ".join(f"C={b}" for b in m["pays_at"]) or "no level"
        measured = {"crossed": f"{m['batch']:.1f} (pays at {pays})" if m["batch"] else "-",
                    "below": "below the smallest concurrency run",
                    "above": "above the largest concurrency run",
                    None: "-"}[m["bound"]]
        lines.append(f"  break-even batch, measured: {measured}")
    lines += render_ties(report.get("methods"), report["kappa"])
    return "\n".join(lines)


__all__ = ["add_plan_options", "plan_report", "render_machine", "render_plan"]
