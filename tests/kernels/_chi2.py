"""Pearson's chi-square goodness-of-fit test for the statistical tests of the sampling kernels
(scipy's when installed, else the regularized upper incomplete gamma function below)."""

from __future__ import annotations

import math
from collections.abc import Sequence

try:  # pragma: no cover - depends on the environment
    from scipy.stats import chi2 as _scipy_chi2
except ImportError:  # pragma: no cover
    _scipy_chi2 = None


def _gamma_q(a: float, x: float) -> float:
    """Regularized upper incomplete gamma ``Q(a, x)`` (series for ``x < a + 1``, else Lentz's
    continued fraction; Numerical Recipes §6.2)."""
    if x <= 0:
        return 1.0
    log_prefix = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_prefix))
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(log_prefix) * h


def chi2_sf(statistic: float, dof: int) -> float:
    """Survival function of the chi-square distribution with ``dof`` degrees of freedom."""
    if _scipy_chi2 is not None:
        return float(_scipy_chi2.sf(statistic, dof))
    return _gamma_q(dof / 2, statistic / 2)


def chi2_pvalue(counts: Sequence[float], probs: Sequence[float]) -> float:
    """p-value of observed ``counts`` against the distribution ``probs`` (normalized here).

    Categories with expected count 0 must have no observations (else the p-value is 0);
    categories with expected count < 5 are merged into one bin.
    """
    n = float(sum(counts))
    total_p = float(sum(probs))
    stat, dof = 0.0, -1
    merged_obs = merged_exp = 0.0
    for obs, p in zip(counts, probs, strict=True):
        expected = n * p / total_p
        if expected == 0:
            if obs:
                return 0.0
            continue
        if expected < 5:
            merged_obs += obs
            merged_exp += expected
            continue
        stat += (obs - expected) ** 2 / expected
        dof += 1
    if merged_exp > 0:
        stat += (merged_obs - merged_exp) ** 2 / merged_exp
        dof += 1
    if dof <= 0:
        return 1.0
    return chi2_sf(stat, dof)
