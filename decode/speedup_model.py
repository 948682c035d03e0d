"""The economics of speculation in closed form: what a round of ``kappa`` drafts brings, what it
costs, and the batch past which it stops paying (pure Python; ``specmesh plan``).

Units: time in target decode steps at batch 1 (``t_T = 1``); ``c = t_D / t_T`` is one draft
pass's cost; batch sizes and ``t_star`` in sequences / query tokens. Source: the speculative
decoding chapter (/work/shared/reference/speculative_decoding_zoo.txt, its section 6.2 results
as quoted in 'Parallel drafting', 'Two honesty checks' and the SGLang schedule's preamble) and
Leviathan et al. (arXiv 2211.17192) for the geometric acceptance model:

- ``E(alpha, kappa) = (1 - alpha^(kappa+1)) / (1 - alpha)``: tokens a round commits on average
  when each draft is accepted with probability ``alpha`` once the ones before it were (the
  bonus / recovered token included; ``kappa + 1`` at ``alpha = 1``);
- a round's cost at batch 1: ``1 + kappa*c`` (chain: ``kappa`` sequential draft passes),
  ``1 + c`` (parallel: one pass emits every draft) and ``max(kappa*c, 1)`` (decoupled: a chain
  drafter running ahead on its own hardware, so a round waits for the slower of the two);
  speedup ``S = E / cost``;
- batch ``B`` (the roofline model the chapter's break-even rests on): a target forward over
  ``N`` query tokens costs ``max(1, N / t_star)`` (memory-bound up to the knee ``t_star``,
  compute-bound past it), a draft pass likewise ``max(1, B / t_star)`` times its own cost;
  plain decode runs ``B`` tokens a step, a round ``B * (kappa + 1)``. While plain decode is
  memory-bound (``B <= t_star``) ``S(B) = E / (B*(kappa+1)/t_star + extra)`` with ``extra``
  the drafting cost (``kappa*c`` chain, ``c`` parallel, 0 decoupled), so speculation breaks
  even at ``B = t_star * (E - extra) / (kappa + 1)`` (chain 150, parallel 175 at the chapter's
  ``c = 0.165, kappa = 3, alpha = 0.7, t_star = 295``), and far past the knee every forward
  scales with the batch: ``S_inf = E / ((kappa + 1) + extra)`` (0.61 parallel), below 1
  whenever ``E <= kappa + 1``: speculation never pays at high batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

#: The ways a round can draft (see the module doc): their cost at batch 1 and past it.
DRAFTING = ("chain", "parallel", "decoupled")
#: Bisection steps of :func:`tie_acceptance` (2^-60: far below any printed digit).
BISECTION_STEPS = 60


def tokens_per_round(alpha: float, kappa: int) -> float:
    """``E``: expected tokens one round of ``kappa`` drafts commits at per-draft acceptance
    ``alpha`` (geometric model), ``(1 - alpha^(kappa+1)) / (1 - alpha)``; ``kappa + 1`` at
    ``alpha = 1``.

    Raises:
        ValueError: ``alpha`` outside [0, 1] or ``kappa < 0``.
    """
    _check(alpha, kappa)
    if alpha == 1.0:
        return float(kappa + 1)
    return (1.0 - alpha ** (kappa + 1)) / (1.0 - alpha)


def tokens_per_round_positions(accepted_share: Sequence[float]) -> float:
    """``E`` from measured acceptance per draft position: ``accepted_share[i]`` is the share
    of rounds that accepted at least ``i + 1`` drafts (the bench's ``acceptance_per_position``,
    vLLM's accepted tokens per position over drafts), so ``E = 1 + sum(accepted_share)``."""
    return 1.0 + sum(accepted_share)


def conditional_acceptance(accepted_share: Sequence[float]) -> list[float]:
    """Per-position acceptance ``alpha_i`` (the chance draft ``i`` is accepted once the ones
    before it were) from the shares of rounds accepting at least ``i + 1`` drafts: ``p_0``,
    ``p_1 / p_0``, ... (0 after a position no round reached)."""
    out, prev = [], 1.0
    for p in accepted_share:
        out.append(p / prev if prev > 0 else 0.0)
        prev = p
    return out


def fitted_alpha(accepted_share: Sequence[float]) -> float:
    """The single ``alpha`` whose geometric model commits what the measured shares do:
    ``tokens_per_round(alpha, len(shares)) == tokens_per_round_positions(shares)``
    (bisection; 0 with no positions)."""
    kappa = len(accepted_share)
    if kappa == 0:
        return 0.0
    target = min(tokens_per_round_positions(accepted_share), kappa + 1.0)
    return _bisect(lambda a: tokens_per_round(a, kappa) - target)


def round_cost(kappa: int, c: float, drafting: str = "chain", batch: float = 1.0,
               t_star: float | None = None) -> float:
    """Cost of one round of ``kappa`` drafts for ``batch`` sequences, in batch-1 target steps:
    the verify forward ``max(1, batch*(kappa+1)/t_star)`` and the drafting, ``kappa`` draft
    passes (chain) or one (parallel) of ``c * max(1, batch/t_star)`` each, added (chain,
    parallel) or overlapped (decoupled: the slower of drafting and verifying). ``t_star``
    None: the batch-1 costs ``1 + kappa*c``, ``1 + c``, ``max(kappa*c, 1)``.

    Raises:
        ValueError: an unknown ``drafting``, a negative ``c`` or a ``t_star`` <= 0.
    """
    if drafting not in DRAFTING:
        raise ValueError(f"drafting must be one of {', '.join(DRAFTING)}, got {drafting!r}")
    if c < 0:
        raise ValueError(f"the draft cost ratio c must be >= 0, got {c}")
    verify = _forward(batch * (kappa + 1), t_star)
    draft_pass = c * _forward(batch, t_star)
    if drafting == "chain":
        return verify + kappa * draft_pass
    if drafting == "parallel":
        return verify + (draft_pass if kappa else 0.0)
    return max(kappa * draft_pass, verify)


def speedup(alpha: float, kappa: int, c: float, drafting: str = "chain", batch: float = 1.0,
            t_star: float | None = None) -> float:
    """Throughput over plain decode at ``batch``: ``E * plain step / round cost`` (a plain
    step costs ``max(1, batch/t_star)`` and commits one token per sequence). At batch 1:
    ``E / (1 + kappa*c)`` (chain), ``E / (1 + c)`` (parallel), ``E / max(kappa*c, 1)``
    (decoupled)."""
    plain = _forward(batch, t_star)
    return tokens_per_round(alpha, kappa) * plain / round_cost(kappa, c, drafting, batch, t_star)


def drafting_extra(kappa: int, c: float, drafting: str) -> float:
    """The drafting cost a round adds to its verify forward while both are memory-bound
    (batch-1 target steps): ``kappa*c`` (chain), ``c`` (parallel), 0 (decoupled: hidden
    behind the verify forward while ``kappa*c`` stays below it)."""
    round_cost(kappa, c, drafting)  # checks the arguments
    return {"chain": kappa * c, "parallel": c if kappa else 0.0, "decoupled": 0.0}[drafting]


def break_even_batch(alpha: float, kappa: int, c: float, t_star: float,
                     drafting: str = "chain", extra: float | None = None) -> float:
    """The batch past which speculation is slower than plain decode:
    ``t_star * (E - extra) / (kappa + 1)`` (the chapter's ``T*(E - kappa c)/(kappa + 1)``,
    ``extra`` as :func:`drafting_extra` unless given, e.g. measured). Exact under the
    roofline model of the module doc: the result never exceeds ``t_star`` (``E <= kappa + 1``),
    where plain decode is still memory-bound. 0 when speculation does not pay even at batch 1
    (``E - extra <= 1``, or a decoupled drafter slower than ``E`` verify steps).

    Raises:
        ValueError: ``t_star <= 0`` or an invalid argument of :func:`round_cost`.
    """
    e = tokens_per_round(alpha, kappa)
    if extra is None:
        extra = drafting_extra(kappa, c, drafting)
        if drafting == "decoupled" and kappa * c >= e:
            return 0.0  # the drafter alone takes longer than the tokens are worth
    return break_even_for_tokens(e, kappa, t_star, extra)


def break_even_for_tokens(tokens: float, kappa: int, t_star: float, extra: float) -> float:
    """:func:`break_even_batch` for a measured ``E`` (``tokens`` a round commits, e.g.
    :func:`tokens_per_round_positions`): ``t_star * (tokens - extra) / (kappa + 1)``, 0 when
    ``tokens - extra <= 1``.

    Raises:
        ValueError: ``t_star <= 0``.
    """
    if not t_star > 0:
        raise ValueError(f"t_star must be > 0, got {t_star}")
    if tokens - extra <= 1.0:
        return 0.0
    return t_star * (tokens - extra) / (kappa + 1)


def break_even_linear(tokens: float, kappa: int, fixed: float, per_token: float,
                      extra: float = 0.0) -> float | None:
    """The break-even batch under a measured linear forward cost instead of the roofline:
    ``t(N) = fixed + per_token * N`` (a CPU has no flat memory-bound region: its forwards
    grow with the tokens from the first), drafting ``extra`` per round (same unit). Plain
    decode at batch ``B`` commits ``B`` tokens in ``t(B)``, a round ``B * tokens`` in
    ``t(B * (kappa + 1)) + extra``; equal at
    ``B = (fixed * (tokens - 1) - extra) / (per_token * (kappa + 1 - tokens))``.
    0 when speculation does not pay even at batch 1's limit (the numerator <= 0); None when it
    never stops paying under this line (every draft accepted, or no per-token cost)."""
    top = fixed * (tokens - 1.0) - extra
    if top <= 0:
        return 0.0
    bottom = per_token * (kappa + 1 - tokens)
    if bottom <= 1e-12:
        return None
    return top / bottom


def asymptotic_speedup(alpha: float, kappa: int, c: float, drafting: str = "chain") -> float:
    """``S_inf``: the speedup far past the knee, where every forward scales with the batch:
    ``E / ((kappa + 1) + kappa*c)`` (chain), ``E / ((kappa + 1) + c)`` (parallel),
    ``E / max(kappa*c, kappa + 1)`` (decoupled); at most 1 (``E <= kappa + 1``)."""
    e = tokens_per_round(alpha, kappa)
    if drafting == "decoupled":
        return e / max(kappa * c, kappa + 1.0)
    return e / ((kappa + 1) + drafting_extra(kappa, c, drafting))


def tie_acceptance(target: float, kappa: int, cost: float) -> float | None:
    """The acceptance at which a round of ``kappa`` drafts costing ``cost`` (batch-1 target
    steps) reaches speedup ``target``: ``E(alpha, kappa) / cost == target``, by bisection
    (``E`` rises with ``alpha``; the chapter's own solver). None when even ``alpha = 1``
    falls short; 0 when ``alpha = 0`` already reaches it. E.g. a parallel drafter
    (``cost = 1 + c``) ties no speculation at ``target = 1`` and a chain at the chain's
    speedup."""
    if tokens_per_round(1.0, kappa) < target * cost:
        return None
    if tokens_per_round(0.0, kappa) >= target * cost:
        return 0.0
    return _bisect(lambda a: tokens_per_round(a, kappa) - target * cost)


@dataclass(frozen=True)
class PlanRow:
    """One drafting mode at one ``kappa`` and ``alpha``: ``tokens_per_round`` (E),
    ``round_cost`` and ``speedup`` at batch 1, ``break_even_batch`` (0: never pays) and
    ``asymptotic_speedup`` (S_inf)."""

    drafting: str
    kappa: int
    alpha: float
    tokens_per_round: float
    round_cost: float
    speedup: float
    break_even_batch: float
    asymptotic_speedup: float

    def as_dict(self) -> dict:
        return asdict(self)


def plan_row(alpha: float, kappa: int, c: float, t_star: float,
             drafting: str = "chain") -> PlanRow:
    """Every figure of one drafting mode (see :class:`PlanRow`)."""
    return PlanRow(drafting, kappa, alpha, tokens_per_round(alpha, kappa),
                   round_cost(kappa, c, drafting), speedup(alpha, kappa, c, drafting),
                   break_even_batch(alpha, kappa, c, t_star, drafting),
                   asymptotic_speedup(alpha, kappa, c, drafting))


def plan(alpha: float, kappa: int, c: float, t_star: float,
         parallel_alpha: float | None = None) -> dict:
    """The ``specmesh plan`` report: a row per drafting mode (the parallel drafter at
    ``parallel_alpha``, default ``alpha``: its drafts never saw each other, so its acceptance
    is usually lower) and the acceptances at which a parallel drafter ties no speculation and
    ties the chain at ``alpha``."""
    pa = alpha if parallel_alpha is None else parallel_alpha
    rows = [plan_row(alpha, kappa, c, t_star, "chain"),
            plan_row(pa, kappa, c, t_star, "parallel"),
            plan_row(alpha, kappa, c, t_star, "decoupled")]
    parallel_cost = round_cost(kappa, c, "parallel")
    return {"inputs": {"alpha": alpha, "parallel_alpha": pa, "kappa": kappa, "c": c,
                       "t_star": t_star},
            "rows": [r.as_dict() for r in rows],
            "parallel_ties_no_speculation_alpha": tie_acceptance(1.0, kappa, parallel_cost),
            "parallel_ties_chain_alpha": tie_acceptance(rows[0].speedup, kappa, parallel_cost)}


def _forward(num_tokens: float, t_star: float | None) -> float:
    """A forward over ``num_tokens`` query tokens, in batch-1 steps (module doc)."""
    if t_star is None:
        return 1.0
    if not t_star > 0:
        raise ValueError(f"t_star must be > 0, got {t_star}")
    return max(1.0, num_tokens / t_star)


def _bisect(f: Callable[[float], float]) -> float:
    """The root in [0, 1] of ``f``, increasing with ``f(0) <= 0 <= f(1)`` (the upper end of
    the last bracket)."""
    low, high = 0.0, 1.0
    for _ in range(BISECTION_STEPS):
        middle = (low + high) / 2
        if f(middle) < 0:
            low = middle
        else:
            high = middle
    return high


def _check(alpha: float, kappa: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if kappa < 0:
        raise ValueError(f"kappa must be >= 0, got {kappa}")


__all__ = ["DRAFTING", "PlanRow", "asymptotic_speedup", "break_even_batch",
           "break_even_for_tokens", "break_even_linear",
           "conditional_acceptance", "drafting_extra", "fitted_alpha", "plan", "plan_row",
           "round_cost", "speedup", "tie_acceptance", "tokens_per_round",
           "tokens_per_round_positions"]
