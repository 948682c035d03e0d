"""Chain against parallel drafting on this machine, per draft method of a bench run
(``specmesh plan --from-bench``; issue 35 item 5): the acceptance at which a parallel drafter
ties no speculation and ties the chain, for the draft cost ``c`` the bench measured, and the
acceptance each method would need to tie each other one as measured.

Input: the bench's per-method table (``summary["per_method"]``,
benchmarks/harness/method_table.py): per method its measured ``c`` (the drafting a verify
step costs, in verify forwards), ``c_per_forward`` (one draft pass over a verify forward:
the chapter's c), draft forwards per step and acceptance per position. The chapter's model
(decode/speedup_model.py, batch 1, drafting and verifying in series):

- ``E`` = 1 + the sum of the shares of steps accepting at least i drafts, and ``alpha`` the
  geometric acceptance that commits as much (:func:`decode.speedup_model.fitted_alpha`);
- the method as run: a step costs ``1 + c`` verify forwards and commits ``E`` tokens:
  ``modelled_speedup = E / (1 + c)``;
- this machine's c as a chain and as a parallel drafter (``c_per_forward``): a chain at the
  method's alpha costs ``1 + kappa*c``, a parallel drafter ``1 + c``; the parallel drafter
  ties no speculation at :func:`~decode.speedup_model.tie_acceptance` ``(1, kappa, 1 + c)``
  and the chain at ``tie_acceptance(E(alpha) / (1 + kappa*c), kappa, 1 + c)`` (what
  ``specmesh plan`` prints for given figures, here with the measured ones);
- each other method B as measured: the geometric acceptance B would need, at its own
  measured cost ``1 + c_B``, to match this method's modelled speedup
  (``tie_acceptance(E / (1 + c), kappa, 1 + c_B)``), next to B's own fitted alpha.

Pure functions over the bench JSON; no torch.
"""

from __future__ import annotations

from specmesh.decode.speedup_model import (
    fitted_alpha,
    round_cost,
    tie_acceptance,
    tokens_per_round,
    tokens_per_round_positions,
)


def _as_chain_and_parallel(alpha: float, kappa: int, c: float) -> dict:
    """The chapter's chain-vs-parallel figures at per-pass cost ``c`` and acceptance
    ``alpha`` (:func:`decode.speedup_model.plan`'s ties, without its batch terms)."""
    chain = tokens_per_round(alpha, kappa) / round_cost(kappa, c, "chain")
    parallel = round_cost(kappa, c, "parallel")
    return {"c": c, "chain_speedup": chain,
            "parallel_ties_no_speculation_alpha": tie_acceptance(1.0, kappa, parallel),
            "parallel_ties_chain_alpha": tie_acceptance(chain, kappa, parallel)}


def method_ties(summary: dict) -> list[dict] | None:
    """Per row of the bench's per-method table (module doc): ``{"drafter", "c",
    "c_per_forward", "forwards_per_step", "alpha", "tokens_per_round", "modelled_speedup",
    "at_this_c" (None without ``c_per_forward``), "ties": [{"versus", "alpha",
    "own_alpha"}]}``; None when the file has no per-method table (a bench from before it)."""
    table = summary.get("per_method")
    if not table:
        return None
    kappa = int(table["kappa"])
    rows = []
    for r in table["rows"]:
        shares = list(r.get("acceptance_per_position") or [])
        shares = (shares + [0.0] * kappa)[:kappa] if shares else []  # positions never reached
        e = tokens_per_round_positions(shares)
        alpha = fitted_alpha(shares) if shares else None
        c, per_forward = r.get("c"), r.get("c_per_forward")
        rows.append({"drafter": r["method"], "c": c, "c_per_forward": per_forward,
                     "forwards_per_step": r.get("forwards_per_step"), "alpha": alpha,
                     "tokens_per_round": e if shares else None,
                     "modelled_speedup": e / (1.0 + c) if shares and c is not None else None,
                     "at_this_c": _as_chain_and_parallel(alpha, kappa, per_forward)
                     if alpha is not None and per_forward is not None else None,
                     "ties": []})
    for b in rows:  # what b needs, at its own measured cost, to tie each other method a
        if b["c"] is None:
            continue
        b["ties"] = [{"versus": a["drafter"],
                      "alpha": tie_acceptance(a["modelled_speedup"], kappa, 1.0 + b["c"]),
                      "own_alpha": b["alpha"]}
                     for a in rows if a is not b and a["modelled_speedup"] is not None]
    return rows


def _alpha(a: float | None) -> str:
    return "never (even alpha = 1)" if a is None else f"alpha {a:.3f}"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def render_ties(rows: list[dict] | None, kappa: int) -> list[str]:
    """:func:`method_ties` as text lines (a line saying why when there is no table)."""
    if rows is None:
        return ["no per-method table in the file (a bench from before it): no chain-vs-"
                "parallel ties"]
    lines = [f"chain vs parallel per method (kappa {kappa}; the bench's per-method table; "
             f"batch 1, drafting and verifying in series):"]
    for r in rows:
        speed = "-" if r["modelled_speedup"] is None else f"{r['modelled_speedup']:.2f}x"
        lines.append(f"  {r['drafter']}: {_num(r['forwards_per_step'], '.2f')} draft forwards "
                     f"per step, c {_num(r['c'])} ({_num(r['c_per_forward'])} per forward), "
                     f"alpha {_num(r['alpha'])}, E {_num(r['tokens_per_round'], '.2f')}: "
                     f"modelled {speed}")
        t = r["at_this_c"]
        if t is not None:
            lines.append(f"    at this c ({t['c']:.3f} per pass): a parallel drafter ties no "
                         f"speculation at {_alpha(t['parallel_ties_no_speculation_alpha'])} "
                         f"and this chain ({t['chain_speedup']:.2f}x at alpha "
                         f"{r['alpha']:.3f}) at {_alpha(t['parallel_ties_chain_alpha'])}")
        for tie in r["ties"]:
            lines.append(f"    ties {tie['versus']} (as measured) at its own c with "
                         f"{_alpha(tie['alpha'])} (has {_num(tie['own_alpha'])})")
    return lines


__all__ = ["method_ties", "render_ties"]
