"""Synthetic acceptance: the ablation harness of ``--verify-rule synthetic``
(docs/architecture.md, 'Verification rules').

A deployment that asks for it accepts drafts along a given acceptance curve instead of
verifying them, to measure what speculation would buy at that acceptance (vLLM offers the same
for benchmarking). It is a registered verification rule (decode/rules.py) that a deployment
picks (``verify_rule="synthetic"``, selectable) and that is not exact: off unless picked, and
then every response (``spec_stats.synthetic_acceptance``, flagged by the gateway from the
cluster's configuration) and the verifier's and gateway's metrics say it was used, since the
output is then no longer the target's. Nothing on the wire carries it.

The curve is per draft position: ``curve[j]`` is the share of verify steps with at least
``j + 1`` drafts that accept at least ``j + 1`` (vLLM's per-position acceptance,
``spec_decode_num_accepted_tokens_per_pos / num_drafts``), non-increasing; positions past it
keep the last conditional rate (a single value ``a`` is the geometric curve ``a, a^2, ...``).
The mean-accept-length form ``m`` is the geometric curve whose steps with ``kappa`` drafts
accept ``m`` drafts on average: ``sum_{i=1..kappa} alpha^i = m``.

Every request (greedy, seeded, sampled) is judged by the curve; the token after the accepted
drafts is the one the request's own mode picks at that row (argmax, coupled Gumbel-max keyed
by (seed, position), or a sample), so with a curve of 0 the output is exactly plain decoding.
Runs ``kernels.synthetic_accept``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch

from specmesh.decode.rules import RuleQuery, VerificationRule
from specmesh.decode.verification import RuleBatch
from specmesh.engine.sampling import sample_tokens
from specmesh.kernels.synthetic_accept import synthetic_accept

#: ``verify_rule`` value that selects synthetic acceptance
SYNTHETIC = "synthetic"


def check_curve(curve: Sequence[float]) -> tuple[float, ...]:
    """``curve`` as a tuple after checking it.

    Raises:
        ValueError: empty, a value outside ``[0, 1]`` (or not a number), or increasing.
    """
    out = tuple(float(c) for c in curve)
    if not out:
        raise ValueError("a synthetic acceptance curve needs at least one rate")
    if not all(0.0 <= c <= 1.0 for c in out):
        raise ValueError(f"synthetic acceptance rates must be in [0, 1], got {list(out)}")
    if any(b > a for a, b in pairwise(out)):
        raise ValueError(f"a per-position acceptance curve cannot increase, got {list(out)}")
    return out


def conditional_rates(curve: Sequence[float]) -> list[float]:
    """The conditional acceptance per position (``curve[j] / curve[j - 1]``; 0 after a 0),
    the input of ``kernels.synthetic_accept``.

    Raises:
        ValueError: see :func:`check_curve`.
    """
    c = check_curve(curve)
    rates, prev = [], 1.0
    for a in c:
        rates.append(a / prev if prev > 0 else 0.0)
        prev = a
    return [min(r, 1.0) for r in rates]


def curve_from_mean_accept_len(mean_accept_len: float, num_speculative_tokens: int,
                               ) -> tuple[float, ...]:
    """The geometric curve (``alpha^(j+1)``, ``num_speculative_tokens`` positions) whose verify
    steps with ``num_speculative_tokens`` drafts accept ``mean_accept_len`` on average.

    Raises:
        ValueError: ``num_speculative_tokens < 1`` or ``mean_accept_len`` outside
            ``[0, num_speculative_tokens]``.
    """
    k, m = int(num_speculative_tokens), float(mean_accept_len)
    if k < 1:
        raise ValueError("a synthetic mean accept length needs num_speculative_tokens >= 1")
    if not 0.0 <= m <= k:
        raise ValueError(f"the synthetic mean accept length must be in [0, {k}] (kappa), "
                         f"got {mean_accept_len}")
    lo, hi = 0.0, 1.0
    for _ in range(100):  # sum_{i=1..k} alpha^i rises with alpha: bisect
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(1, k + 1)) < m:
            lo = mid
        else:
            hi = mid
    alpha = (lo + hi) / 2
    return tuple(alpha ** (j + 1) for j in range(k))


def parse_curve(text: str) -> tuple[float, ...]:
    """``"0.8,0.6,0.4"`` -> ``(0.8, 0.6, 0.4)`` (checked).

    Raises:
        ValueError: not a comma list of numbers, or see :func:`check_curve`.
    """
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"synthetic acceptance must be a comma list of rates, got {text!r}") \
            from None
    return check_curve(values)


def synthetic_settings(verify_rule: str, rates: str | None, mean_accept_len: float | None,
                       num_speculative_tokens: int) -> dict:
    """The cluster settings of the rule's options: ``rates`` (``--synthetic-acceptance``, a
    comma list) or ``mean_accept_len`` (``--synthetic-mean-accept-len``) give the verifier's
    ``synthetic_acceptance`` curve, and the drafter sends no draft probabilities (the rule does
    not read them); ``{}`` when ``verify_rule`` picks another rule.

    Raises:
        ValueError: the rule without a curve, a curve with another rule, both forms, or a
            malformed curve.
    """
    if verify_rule != SYNTHETIC:
        if rates is not None or mean_accept_len is not None:
            raise ValueError("--synthetic-acceptance / --synthetic-mean-accept-len need "
                             f"--verify-rule {SYNTHETIC}")
        return {}
    if (rates is None) == (mean_accept_len is None):
        raise ValueError(f"--verify-rule {SYNTHETIC} needs one of --synthetic-acceptance RATES "
                         "or --synthetic-mean-accept-len M")
    try:
        curve = parse_curve(rates) if rates is not None else curve_from_mean_accept_len(
            mean_accept_len, num_speculative_tokens)
    except ValueError as err:
        raise ValueError(f"synthetic acceptance: {err}") from None
    return {"synthetic_acceptance": curve, "draft_probs": False}


class SyntheticRule(VerificationRule):
    """Accepts drafts along ``curve`` (module docstring); the extra token is the request's own
    mode's token at that row. Randomness: the batch's generator. Applies to every request of
    a deployment that picks it (before any other rule), chains only: the scheduler plans a
    draft tree's branch 0 as a chain. An empty ``curve`` makes the rule of a verifier that did
    not pick it (it never applies)."""

    name = SYNTHETIC
    priority = 100
    selectable = True
    exact = False
    help = ("the ablation harness: every request's drafts accepted along "
            "--synthetic-acceptance or --synthetic-mean-accept-len, not verified (responses "
            "and metrics say so)")

    def __init__(self, curve: Sequence[float] = ()) -> None:
        self.curve = check_curve(curve) if len(curve) else ()
        self._rates = torch.tensor(conditional_rates(self.curve) if self.curve else [],
                                   dtype=torch.float64)

    @classmethod
    def from_config(cls, config) -> SyntheticRule:  # noqa: ANN001
        return cls(config.synthetic_acceptance)

    @classmethod
    def check_config(cls, config) -> None:  # noqa: ANN001
        """The curve is given exactly when the rule is picked, and valid."""
        if (config.verify_rule == cls.name) != bool(config.synthetic_acceptance):
            raise ValueError(f"verify_rule {cls.name!r} needs a synthetic_acceptance curve, "
                             f"and a curve needs verify_rule {cls.name!r}")
        if config.synthetic_acceptance:
            check_curve(config.synthetic_acceptance)

    def applies(self, query: RuleQuery) -> bool:
        return query.verify_rule == self.name

    def verify(self, batch: RuleBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.curve:
            raise ValueError(f"the {self.name!r} rule runs without a synthetic_acceptance curve")
        counts = batch.num_draft_tokens()
        device = batch.target_logits.device
        rows = [k + 1 for k in counts]
        sampling = [sp for sp, n in zip(batch.sampling, rows) for _ in range(n)]
        base = [0] * len(counts) if batch.positions is None else batch.positions.tolist()
        positions = [p + j for p, n in zip(base, rows) for j in range(n)]
        target_token_ids = torch.tensor(
            sample_tokens(batch.target_logits, sampling, positions, batch.generator),
            dtype=torch.int64, device=device)
        uniform = torch.rand(len(batch.draft_token_ids), dtype=torch.float64, device=device,
                             generator=batch.generator)
        return synthetic_accept(batch.draft_token_ids, batch.cu_num_draft_tokens,
                                target_token_ids, uniform, self._rates.to(device))


__all__ = ["SYNTHETIC", "SyntheticRule", "check_curve", "conditional_rates",
           "curve_from_mean_accept_len", "parse_curve", "synthetic_settings"]
