"""Latency of streamed requests in ``specmesh bench``: time to first token (TTFT) and mean
inter-token latency (ITL) percentiles per system and concurrency level, over the
:class:`cluster.runs.RequestLatency` each streamed request records (the served specmesh
systems and llama.cpp's ``llama-server``). ITL is per request, (last token - first token) /
(tokens - 1): a specmesh SSE chunk carries every token one verify step committed, so gaps
between chunks are not gaps between tokens. Pure functions; no torch, no Ray."""

from __future__ import annotations

from collections.abc import Sequence

from specmesh.cluster.runs import RunResult


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``xs``, interpolated linearly between the two
    nearest ranks (numpy's default ``linear`` method: rank ``q/100 * (n - 1)``).

    Raises:
        ValueError: an empty ``xs`` or ``q`` outside [0, 100].
    """
    if not xs:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must lie in [0, 100], got {q}")
    v = sorted(xs)
    rank = q / 100 * (len(v) - 1)
    lo = int(rank)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (rank - lo)


def latency_summary(runs: Sequence[RunResult]) -> dict | None:
    """TTFT and mean inter-token latency (:class:`cluster.runs.RequestLatency`) over every
    streamed request of ``runs`` (all repeats pooled), milliseconds: ``ttft_ms`` and
    ``itl_ms`` each ``{"p50", "p95"}`` (None without a request of two tokens or more),
    ``num_requests``, and the per-request values. None when no request was streamed."""
    lat = [x for r in runs for x in r.latencies]
    if not lat:
        return None
    ttft = [x.ttft_s * 1e3 for x in lat]
    itl = [x.itl_s * 1e3 for x in lat if x.itl_s is not None]

    def p(xs: list[float]) -> dict:
        return {"p50": percentile(xs, 50), "p95": percentile(xs, 95)} if xs else {
            "p50": None, "p95": None}

    return {"ttft_ms": p(ttft), "itl_ms": p(itl), "num_requests": len(lat),
            "itl": "per request: (last token - first token) / (tokens - 1)",
            "ttft_ms_all": ttft, "itl_ms_all": itl}
