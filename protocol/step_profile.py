"""Where a role's time goes, per phase of its step (docs/architecture.md, 'Observability').

A :class:`StepProfile` keeps, per named phase (``ingest``, ``plan``, ``tail_wait``,
``forward``, ``verify``, ``commit``, ``send`` on the verifier; ``commit_to_tail`` on the
drafter; ``tokenize`` / ``detokenize`` on the gateway, ...), a count, a sum and fixed histogram
buckets of the observed durations. Fixed buckets make it cheap (no per-observation allocation),
mergeable across processes, and exportable as a Prometheus histogram at scrape time. Plain
Python, no torch: every role, the gateway included, can use it.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from contextlib import contextmanager
from dataclasses import dataclass, field

#: Upper bounds of the histogram buckets, seconds (a last +Inf bucket is implicit). From 50 us
#: (a message send) to 5 s (a long prefill).
BUCKETS_S: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0,
)


@dataclass
class PhaseStats:
    """Observations of one phase: ``bucket_counts[i]`` counts durations <= ``BUCKETS_S[i]``
    (not cumulative; the last entry counts those above every bound)."""

    count: int = 0
    sum_s: float = 0.0
    bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.sum_s += seconds
        self.bucket_counts[bisect_left(BUCKETS_S, seconds)] += 1

    def quantile(self, q: float) -> float:
        """Approximate ``q``-quantile, seconds: the upper bound of the bucket holding it
        (``inf`` when it lies past the last bound; 0 with no observations)."""
        if self.count == 0:
            return 0.0
        rank, seen = q * self.count, 0
        for i, n in enumerate(self.bucket_counts):
            seen += n
            if seen >= rank and n:
                return BUCKETS_S[i] if i < len(BUCKETS_S) else float("inf")
        return float("inf")

    def as_dict(self) -> dict:
        """count, total_ms, mean_ms, p50_ms, p90_ms (bucket bounds), buckets (raw counts)."""
        mean = self.sum_s / self.count if self.count else 0.0
        return {"count": self.count, "total_ms": self.sum_s * 1e3, "mean_ms": mean * 1e3,
                "p50_ms": self.quantile(0.5) * 1e3, "p90_ms": self.quantile(0.9) * 1e3,
                "buckets": list(self.bucket_counts)}


class StepProfile:
    """Durations per phase. Not thread-safe by design: one owner thread observes; readers on
    other threads (metrics, Ray calls) get a consistent-enough copy from :meth:`as_dict`."""

    def __init__(self) -> None:
        self.phases: dict[str, PhaseStats] = {}
        self.counters: dict[str, int] = {}

    def observe(self, phase: str, seconds: float) -> None:
        """Record one duration of ``phase``, seconds."""
        stats = self.phases.get(phase)
        if stats is None:
            stats = self.phases[phase] = PhaseStats()
        stats.observe(seconds)

    @contextmanager
    def phase(self, name: str):
        """Time the ``with`` body as one observation of ``name``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.observe(name, time.perf_counter() - t0)

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the plain counter ``name`` (e.g. steps that had a usable tail)."""
        self.counters[name] = self.counters.get(name, 0) + n

    def as_dict(self) -> dict:
        """``{"phases": {name: PhaseStats.as_dict()}, "counters": {name: int}}``."""
        return {"phases": {k: v.as_dict() for k, v in list(self.phases.items())},
                "counters": dict(self.counters)}
