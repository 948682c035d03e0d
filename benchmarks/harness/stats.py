"""Verifier counters and step profiles around one bench pass: snapshots are cumulative, so a
pass's share is the difference of the snapshots taken before and after it. Pure functions over
the dicts that ``VerifierHost.stats()`` / ``StepProfile.as_dict()`` return (no torch, no Ray)."""

from __future__ import annotations

from specmesh.protocol.step_profile import BUCKETS_S, PhaseStats

#: Verifier phases in the order the bench prints them (others follow, sorted).
PHASE_ORDER = ("ingest", "admit", "tail_wait", "plan", "forward", "forward_with_drafts",
               "forward_plain", "verify", "commit", "send")


def verifier_snapshot(worker_stats: dict) -> dict:
    """The counters the bench diffs, from a verifier's stats dict (or ``vars`` of its
    ``VerifierStats`` plus ``profile``): spec counters, per-position accepts, profile."""
    return {"num_draft_tokens": worker_stats.get("num_draft_tokens", 0),
            "num_accepted_tokens": worker_stats.get("num_accepted_tokens", 0),
            "num_verify_steps": worker_stats.get("num_verify_steps", 0),
            "num_accepted_tokens_per_pos": list(worker_stats.get("num_accepted_tokens_per_pos",
                                                                 [])),
            "profile": worker_stats.get("profile") or {"phases": {}, "counters": {}}}


#: Prefix of the drafter's phases and counters in a bench snapshot's profile.
DRAFTER_PREFIX = "drafter "


def with_drafter_profiles(snapshot: dict, drafter_profiles: list[dict]) -> dict:
    """``snapshot`` with the drafters' step profiles (``StepProfile.as_dict()``) summed into its
    profile, every phase and counter named ``"drafter <name>"``: e.g. ``drafter
    commit_to_tail``, how long a VerifyCommit takes to turn into the next DraftTailStream."""
    profile = snapshot["profile"]
    for d in drafter_profiles:
        profile = profile_sum(profile, {
            "phases": {DRAFTER_PREFIX + k: v for k, v in d.get("phases", {}).items()},
            "counters": {DRAFTER_PREFIX + k: v for k, v in d.get("counters", {}).items()}})
    return {**snapshot, "profile": profile}


def merge_snapshots(snaps: list[dict]) -> dict:
    """The sum of several verifiers' snapshots (a cluster with more than one verifier)."""
    out = verifier_snapshot({})
    for s in snaps:
        for k in ("num_draft_tokens", "num_accepted_tokens", "num_verify_steps"):
            out[k] += s[k]
        out["num_accepted_tokens_per_pos"] = add_lists(out["num_accepted_tokens_per_pos"],
                                                        s["num_accepted_tokens_per_pos"])
        out["profile"] = profile_sum(out["profile"], s["profile"])
    return out


def add_lists(a: list, b: list, sign: int = 1) -> list:
    """``a + sign * b`` element-wise, the shorter list padded with zeros."""
    n = max(len(a), len(b))
    a, b = list(a) + [0] * (n - len(a)), list(b) + [0] * (n - len(b))
    return [x + sign * y for x, y in zip(a, b)]


def _phase(d: dict | None) -> PhaseStats:
    p = PhaseStats()
    if d:
        p.count, p.sum_s = d["count"], d["total_ms"] / 1e3
        p.bucket_counts = list(d["buckets"])
    return p


def profile_sum(a: dict, b: dict, sign: int = 1) -> dict:
    """``a + sign * b`` of two ``StepProfile.as_dict()`` values, in the same shape (p50 and
    mean recomputed from the summed buckets)."""
    a_ph, b_ph = a.get("phases", {}), b.get("phases", {})
    phases = {}
    for name in list(a_ph) + [n for n in b_ph if n not in a_ph]:
        pa, pb = _phase(a_ph.get(name)), _phase(b_ph.get(name))
        p = PhaseStats(pa.count + sign * pb.count, pa.sum_s + sign * pb.sum_s,
                       add_lists(pa.bucket_counts, pb.bucket_counts, sign))
        if p.count:
            phases[name] = p.as_dict()
    counters = dict(a.get("counters", {}))
    for k, v in b.get("counters", {}).items():
        counters[k] = counters.get(k, 0) + sign * v
    return {"phases": phases, "counters": {k: v for k, v in counters.items() if v}}


def snapshot_delta(before: dict, after: dict) -> dict:
    """What happened between two snapshots of the same verifier(s)."""
    out = {k: after[k] - before[k]
           for k in ("num_draft_tokens", "num_accepted_tokens", "num_verify_steps")}
    out["num_accepted_tokens_per_pos"] = add_lists(after["num_accepted_tokens_per_pos"],
                                                    before["num_accepted_tokens_per_pos"], -1)
    out["profile"] = profile_sum(after["profile"], before["profile"], -1)
    return out


def acceptance_per_position(accepted_per_pos: list[int], num_verify_steps: int) -> list[float]:
    """vLLM's per-position acceptance: accepted drafts at draft position i / verify steps that
    carried drafts (so it falls with i, and a position a step did not draft counts as not
    accepted). Empty when no step carried drafts."""
    if not num_verify_steps:
        return []
    return [n / num_verify_steps for n in accepted_per_pos]


def bucket_quantile(bucket_counts: list[int], q: float) -> float | None:
    """The ``q``-quantile of a :data:`protocol.step_profile.BUCKETS_S` histogram, seconds,
    interpolated linearly inside the bucket that holds it (finer than the bucket bound
    ``PhaseStats.quantile`` returns); the last bound when it lies in the +Inf bucket, None
    with no observations."""
    total = sum(bucket_counts)
    if not total:
        return None
    rank, seen = q * total, 0
    for i, n in enumerate(bucket_counts):
        if n and seen + n >= rank:
            if i >= len(BUCKETS_S):
                return BUCKETS_S[-1]
            lo = BUCKETS_S[i - 1] if i else 0.0
            return lo + (BUCKETS_S[i] - lo) * (rank - seen) / n
        seen += n
    return BUCKETS_S[-1]


def profile_summary(profile: dict) -> dict:
    """Per-phase ``{p50_ms, mean_ms, count}`` in :data:`PHASE_ORDER` (p50 interpolated in its
    histogram bucket, :func:`bucket_quantile`) and the draft supply:
    ``steps_with_tail_share`` = verify steps where some request had usable drafts when the
    step was planned (the drafter's supply, before the goodput caps) / all verify steps;
    ``steps_with_drafts_share`` = verify steps that verified drafts (after the caps) / all
    verify steps; ``request_steps_with_tail_share`` and ``request_steps_with_drafts_share``
    the same per request-step, over request-steps that could have used drafts (kappa > 0).
    Shares are None with no steps."""
    phases = profile.get("phases", {})
    names = [n for n in PHASE_ORDER if n in phases] + sorted(set(phases) - set(PHASE_ORDER))
    c = profile.get("counters", {})

    def share(num: str, den: str) -> float | None:
        return c.get(num, 0) / c[den] if c.get(den) else None

    def p50_ms(ph: dict) -> float:
        q = bucket_quantile(ph["buckets"], 0.5)
        return q * 1e3 if q is not None else 0.0

    return {"phases": {n: {"p50_ms": p50_ms(phases[n]), "mean_ms": phases[n]["mean_ms"],
                           "count": phases[n]["count"]} for n in names},
            "steps_with_tail_share": share("num_steps_with_tail", "num_steps"),
            "steps_with_drafts_share": share("num_steps_with_drafts", "num_steps"),
            "request_steps_with_tail_share": share("num_request_steps_with_tail",
                                                   "num_request_steps_spec_eligible"),
            "request_steps_with_drafts_share": share("num_request_steps_with_drafts",
                                                     "num_request_steps_spec_eligible"),
            # the drafter's commits whose bonus token it had prepared a branch for
            "branch_hit_share": share(DRAFTER_PREFIX + "branch_hits", DRAFTER_PREFIX + "commits")}


def step_cost_check(profile: dict, forward_cost_ratio: float | None,
                    plain_profile: dict | None = None, tolerance: float = 1.1) -> dict:
    """Mean verify forward with drafts (from ``profile``) vs without (ms), and the bound the
    with-drafts forward must stay under: ``tolerance * forward_cost_ratio * mean without``,
    where the ratio is the measured (kappa+1)-token / 1-token forward cost. The without-drafts
    mean comes from ``plain_profile`` (the kappa = 0 run of the same system and level: same
    batch, many steps) when it has plain forwards, else from ``profile``'s own plain steps
    (``without_drafts_from`` says which). ``within_bound`` is None when a mean or the ratio is
    missing."""
    def plain_mean(p: dict | None) -> float | None:
        return (p or {}).get("phases", {}).get("forward_plain", {}).get("mean_ms")

    with_d = profile.get("phases", {}).get("forward_with_drafts", {}).get("mean_ms")
    without, source = plain_mean(plain_profile), "kappa=0 run"
    if without is None:
        without, source = plain_mean(profile), "own plain steps"
    bound = (tolerance * forward_cost_ratio * without
             if without is not None and forward_cost_ratio else None)
    return {"with_drafts_mean_ms": with_d, "without_drafts_mean_ms": without,
            "without_drafts_from": source if without is not None else None,
            "forward_cost_ratio": forward_cost_ratio, "tolerance": tolerance,
            "bound_ms": bound,
            "within_bound": (with_d <= bound) if with_d is not None and bound is not None
            else None}
