"""What ``specmesh bench`` makes of its runs, as dicts: the verifiers' counters and step
profiles around each pass, and the summary (medians, ratios, spec stats, output identity, step
profiles).

Counter snapshots are cumulative, so a pass's share is the difference of the snapshots taken
before and after it (:func:`snapshot_delta`, over the dicts that ``VerifierHost.stats()`` /
``StepProfile.as_dict()`` return). The summary is built from :class:`cluster.runs.RunResult`
lists. Pure functions; no torch, no Ray. The markdown tables and the plot of a summary:
benchmarks/harness/render.py.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from specmesh.cluster.runs import CLEAR_HISTORY_PATH, PredictionTokens, RunResult, same_outputs
from specmesh.protocol.spec_stats import SpecStats
from specmesh.protocol.step_profile import BUCKETS_S, PhaseStats

# -- latency of streamed requests ------------------------------------------------------------
#
# Time to first token (TTFT) and mean inter-token latency (ITL) percentiles per system and
# concurrency level, over the cluster.runs.RequestLatency each streamed request records (the
# served specmesh systems and llama.cpp's llama-server). ITL is per request, (last token - first
# token) / (tokens - 1): a specmesh SSE chunk carries every token one verify step committed, so
# gaps between chunks are not gaps between tokens.


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


# -- counters and step profiles of a pass -----------------------------------------------------

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
            "branch_hit_share": share(DRAFTER_PREFIX + "branch_hits", DRAFTER_PREFIX + "commits"),
            # the P/D seed (hidden states at the last prompt position) and the draft trees
            "seed_state_bytes_per_request": share("seed_state_bytes", "num_seed_states"),
            "tree_nodes_per_tree": share(DRAFTER_PREFIX + "tree_nodes",
                                         DRAFTER_PREFIX + "tree_segments")}


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


# -- the summary ------------------------------------------------------------------------------

#: Name of the baseline every ratio is taken against.
HF_BASELINE = "hf generate"


@dataclass(frozen=True)
class System:
    """One benchmarked system: ``kind`` is ``served`` (through the gateway), ``inprocess``
    (the workers in the bench process), ``hf`` or ``llama`` (llama.cpp's ``llama-server``);
    ``kappa`` its drafts per step (0 = none); ``plain`` the name of its kappa = 0 counterpart
    (None if it has none); ``method`` the label of its draft method (``--drafters``; for
    llama-server its speculation type; None for kappa = 0 and HF)."""

    name: str
    kind: str
    kappa: int = 0
    plain: str | None = None
    method: str | None = None
    #: the sweep's policy of a served system (``fixed`` for its fixed kappas, ``schedule`` /
    #: ``goodput`` adapting within ``kappa``); None outside the sweep
    policy: str | None = None


SERVED_PLAIN = "served k=0"
INPROCESS_PLAIN = "in-process k=0"
#: The plain llama.cpp ``llama-server`` system; its speculative one is ``llama-server TYPE``.
LLAMA_PLAIN = "llama-server"
#: The baselines ``--baselines`` may list.
BASELINES = ("hf", "llama-server")


def systems_for(kappa: int, concurrency: int, methods: Sequence[str] = ("ngram",),
                served_only: Sequence[str] = (), baselines: Sequence[str] = ("hf",),
                llama_spec_type: str | None = None) -> list[System]:
    """The systems of one concurrency level: specmesh served at kappa per draft method (its
    label in the name, e.g. ``served k=4 eagle``) and at kappa = 0 once, the same in-process
    (except for the ``served_only`` methods: thread-plan variants), then the ``baselines``:
    ``hf``, HF batched greedy and at concurrency 1 HF with prompt lookup (HF does not batch
    it); ``llama-server``, llama.cpp's server plain and, with kappa > 0, with its
    ``llama_spec_type`` speculation (``llama-server ngram-mod``). With kappa = 0 there are no
    per-method systems."""
    methods = list(methods) if kappa > 0 else []
    out = [System(f"served k={kappa} {m}", "served", kappa, SERVED_PLAIN, m) for m in methods]
    out.append(System(SERVED_PLAIN, "served", 0))
    out += [System(f"in-process k={kappa} {m}", "inprocess", kappa, INPROCESS_PLAIN, m)
            for m in methods if m not in served_only]
    out.append(System(INPROCESS_PLAIN, "inprocess", 0))
    if "hf" in baselines:
        out.append(System(HF_BASELINE, "hf"))
        if concurrency == 1:
            out.append(System(f"hf prompt lookup k={max(kappa, 1)}", "hf", max(kappa, 1)))
    if "llama-server" in baselines:
        out.append(System(LLAMA_PLAIN, "llama"))
        if kappa > 0 and llama_spec_type:
            out.append(System(f"{LLAMA_PLAIN} {llama_spec_type}", "llama", kappa, LLAMA_PLAIN,
                              llama_spec_type))
    return out


def sweep_systems(kappas: Sequence[int], policies: Sequence[str],
                  methods: Sequence[str] = ("ngram",)) -> list[System]:
    """The served systems of one level of the adaptive-speculation sweep: ``served k=0``, per
    draft method every fixed kappa > 0 (``served k=3 ngram``, policy ``fixed``) and every
    adaptive policy within the largest kappa (``served goodput ngram``); each speculative
    one's output is checked against ``served k=0``."""
    out = [System(SERVED_PLAIN, "served", 0, policy="fixed")]
    top = max(kappas)
    for m in methods:
        out += [System(f"served k={k} {m}", "served", k, SERVED_PLAIN, m, "fixed")
                for k in kappas if k > 0]
        out += [System(f"served {p} {m}", "served", top, SERVED_PLAIN, m, p) for p in policies]
    return out


def policy_vs_best_fixed(systems: dict[str, dict], level_systems: Sequence[System]
                         ) -> dict[str, dict]:
    """Per adaptive-policy system of one level (its :func:`summarize_system` dict by name in
    ``systems``): its median tokens/s over the best fixed kappa's of the same draft method,
    k = 0 included (the issue's "policy tokens/s / best fixed": at least 0.95 means the
    policy never makes speculation a loss). ``{name: {"policy", "method", "tokens_per_s",
    "best_fixed", "best_fixed_tokens_per_s", "ratio"}}``; a policy with no measured fixed
    system is left out."""
    out: dict[str, dict] = {}
    for s in level_systems:
        if s.policy in (None, "fixed") or s.name not in systems:
            continue
        fixed = [f.name for f in level_systems if f.policy == "fixed" and f.name in systems
                 and (f.kappa == 0 or f.method == s.method)]
        if not fixed:
            continue
        best = max(fixed, key=lambda n: systems[n]["median_tokens_per_s"])
        tps, best_tps = systems[s.name]["median_tokens_per_s"], \
            systems[best]["median_tokens_per_s"]
        out[s.name] = {"policy": s.policy, "method": s.method, "tokens_per_s": tps,
                       "best_fixed": best, "best_fixed_tokens_per_s": best_tps,
                       "ratio": tps / best_tps if best_tps else None}
    return out


def kappa_timeline(samples: Sequence[tuple[float, int, int, int]]) -> list[dict]:
    """The chosen kappa through a pass, from the verifier stats sampled during it: each sample
    ``(t, kappa, num_drafts, num_request_steps)`` (seconds since the pass began, the
    policy's kappa then -- the schedule's step kappa, else the configured one -- and the two
    cumulative counters, summed over verifiers) becomes ``{"t", "kappa", "drafts_per_step"}``,
    the last being the drafts verified per request step since the previous sample (what the
    goodput policy chose, per request; None when no step ran in between). The first sample
    is the baseline of the counters."""
    out = []
    for prev, cur in zip(samples, samples[1:]):
        steps = cur[3] - prev[3]
        out.append({"t": round(cur[0], 3), "kappa": cur[1],
                    "drafts_per_step": (cur[2] - prev[2]) / steps if steps > 0 else None})
    return out


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def draft_step_share(profile: dict | None) -> float | None:
    """Share of the verify steps with drafts: request-steps whose request had drafts to
    verify / all request-steps of the pass (from the verifier's step counters; None without
    steps)."""
    c = (profile or {}).get("counters", {})
    return c.get("num_request_steps_with_drafts", 0) / c["num_request_steps"] \
        if c.get("num_request_steps") else None


def accepted_per_step(spec: SpecStats, profile: dict | None) -> float | None:
    """Accepted drafts per verify step over all of the run's request-steps, drafts or not
    (SGLang's accept length less its bonus token): what a drafter adds to every step, where
    ``mean_accept_len`` (vLLM's) averages over the steps that had drafts only (None without
    the verifier's step counters)."""
    c = (profile or {}).get("counters", {})
    return spec.num_accepted_tokens / c["num_request_steps"] \
        if c.get("num_request_steps") else None


# -- by category (a prompt's ``category``: the workload set's chat, code-edit, ...) ----------


def prediction_totals(runs: Sequence[RunResult], indices: Collection[int] | None = None,
                      ) -> dict | None:
    """Accepted and rejected prediction tokens (OpenAI's Predicted Outputs usage) summed over
    ``runs`` (all repeats) and their requests at ``indices`` (None: all): ``{"accepted",
    "rejected", "num_requests"}`` (requests that reported them); None when none did."""
    total, n = PredictionTokens(), 0
    for r in runs:
        for i, p in enumerate(r.request_prediction):
            if p is not None and (indices is None or i in indices):
                total, n = total + p, n + 1
    return {**total.as_dict(), "num_requests": n} if n else None


def _category_tokens_per_s(run: RunResult, indices: list[int]) -> float | None:
    """One pass's tokens/s per client over the requests at ``indices``: their completion
    tokens / the sum of their times (send, or the start of their batch, to the last token);
    None without per-request tokens and times."""
    tokens = run.request_tokens
    if tokens is None or len(run.request_seconds) != len(tokens):
        return None
    seconds = sum(run.request_seconds[i] for i in indices)
    return sum(tokens[i] for i in indices) / seconds if seconds > 0 else None


def category_order(categories: Sequence[str]) -> list[str]:
    """The distinct categories in order of first appearance."""
    return list(dict.fromkeys(categories))


def category_summary(runs: Sequence[RunResult], categories: Sequence[str],
                     identical_k0: list[bool] | None, checked: bool) -> dict[str, dict]:
    """One system's runs split by the requests' ``categories`` (one per request, in request
    order), per category in order of first appearance: ``num_requests``;
    ``median_tokens_per_s`` (over repeats) and ``all_tokens_per_s`` of tokens/s per client
    (the category's completion tokens / the sum of its requests' times: at concurrency 1 the
    pass's throughput split by category, above it the rate one client sees; None for a
    system without per-request times); spec stats summed over repeats with their acceptance
    rate and mean accept length (None without per-request spec stats); the first repeat's
    ``identical_to_k0`` flags of the category (None without a kappa = 0 counterpart) and
    ``exact`` (None unless ``checked``); ``prediction_tokens`` (:func:`prediction_totals`).
    ``ratio_to_k0`` is filled by :func:`summarize_level`."""
    out: dict[str, dict] = {}
    for cat in category_order(categories):
        idx = [i for i, c in enumerate(categories) if c == cat]
        tps = [_category_tokens_per_s(r, idx) for r in runs]
        tps_known = [t for t in tps if t is not None]
        spec, has_spec = SpecStats(), False
        for r in runs:
            if len(r.request_spec) == len(categories):
                has_spec = True
                for i in idx:
                    spec.add(r.request_spec[i])
        flags = [identical_k0[i] for i in idx] if identical_k0 is not None else None
        out[cat] = {"num_requests": len(idx),
                    "median_tokens_per_s": _median(tps_known) if tps_known else None,
                    "all_tokens_per_s": tps_known,
                    "spec_stats": spec.as_dict() if has_spec else None,
                    "acceptance_rate": spec.acceptance_rate if has_spec else None,
                    "mean_accept_len": spec.mean_accept_len if has_spec else None,
                    "identical_to_k0": flags,
                    "exact": all(flags) if checked and flags is not None else None,
                    "prediction_tokens": prediction_totals(runs, set(idx)),
                    "ratio_to_k0": None}
    return out


# -- by LoRA adapter (the mixed-adapter load of ``--lora-modules``) ---------------------------

#: the row of the base model's requests in the per-adapter tables
BASE_MODEL_ROW = "base"


def mixed_adapter_prompts(prompts: Sequence[dict], adapters: Sequence[str]) -> list[dict]:
    """The served requests of a mixed-adapter load: every prompt on the base model and then
    on each of ``adapters`` in turn (so a pass sends them mixed, and each adapter is compared
    with the base on the same prompts): copies of the prompts whose ``model`` names the
    adapter (no ``model`` for the base). ``prompts`` unchanged without adapters."""
    if not adapters:
        return list(prompts)
    return [dict(p, model=a) if a else dict(p) for p in prompts for a in ("", *adapters)]


def request_adapters(requests: Sequence[dict]) -> list[str]:
    """Per request, the adapter it runs on (its ``model``; :data:`BASE_MODEL_ROW` for none)."""
    return [r.get("model") or BASE_MODEL_ROW for r in requests]


def adapter_summary(runs: Sequence[RunResult], adapters: Sequence[str],
                    identical_k0: list[bool] | None, checked: bool) -> dict[str, dict]:
    """One served system's runs split by the requests' LoRA ``adapters`` (one per request,
    :func:`request_adapters`), as :func:`category_summary` splits by category: per adapter
    its requests, tokens/s per client, acceptance rate, accepted drafts per verify step with
    drafts (``mean_accept_len``) and identity to kappa = 0; plus ``acceptance_vs_base``, its
    acceptance rate over the base model's (drafters draft from the base, so an adapter that
    changes the output accepts fewer: below 1; None without a base row or base drafts)."""
    rows = category_summary(runs, adapters, identical_k0, checked)
    base = rows.get(BASE_MODEL_ROW, {}).get("acceptance_rate")
    for row in rows.values():
        rate = row["acceptance_rate"]
        row["acceptance_vs_base"] = rate / base if base and rate is not None else None
    return rows


def summarize_system(system: System, runs: list[RunResult], level_runs: dict[str, list[RunResult]],
                     categories: Sequence[str] | None = None,
                     adapters: Sequence[str] | None = None) -> dict:
    """One system at one level: median and all tokens/s (completion tokens / wall seconds),
    spec stats summed over repeats, acceptance per draft position, the share of verify steps
    with drafts, output identity of the first repeat vs HF and vs its kappa = 0 counterpart
    (``exact``: every output identical to it; None for llama.cpp, whose identity is
    informative only), TTFT and inter-token latency percentiles of its streamed requests
    (:func:`latency_summary`; None when not streamed), Predicted Outputs tokens
    (:func:`prediction_totals`), whether each pass began with the drafters' history cleared
    (``history_cleared``, one per repeat, when asked), its step profile and, given the
    requests' ``categories``, the same split by category (:func:`category_summary`)."""
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
    # llama.cpp is a peer, not specmesh: its outputs are compared for information only
    checked = identical_k0 is not None and system.kind != "llama"
    out = {"kind": system.kind, "kappa": system.kappa, "method": system.method,
           "median_tokens_per_s": _median(tps), "all_tokens_per_s": tps,
           "num_tokens": [r.num_tokens for r in runs], "seconds": [r.seconds for r in runs],
           "spec_stats": spec.as_dict(), "acceptance_rate": spec.acceptance_rate,
           "mean_accept_len": spec.mean_accept_len,
           "accepted_per_pos": per_pos,
           "acceptance_per_position": acceptance_per_position(per_pos, spec.num_verify_steps),
           "verify_steps_with_drafts_share": draft_step_share(profile),
           "accepted_per_step": accepted_per_step(spec, profile),
           "identical_to_hf": (same_outputs(first, hf[0])
                               if hf and system.name != HF_BASELINE else None),
           "identical_to_k0": identical_k0,
           "exact": all(identical_k0) if checked else None,
           "latency": latency_summary(runs),
           "prediction_tokens": prediction_totals(runs),
           "texts": first.texts, "token_ids": first.token_ids}
    if any(r.history_cleared is not None for r in runs):
        out["history_cleared"] = [r.history_cleared for r in runs]
    if system.policy is not None:
        out["policy"] = system.policy
        # per repeat, the verifier's kappa sampled through the pass (bench.KappaSampler)
        out["kappa_timeline"] = [r.kappa_timeline for r in runs]
    if categories is not None:
        out["categories"] = category_summary(runs, categories, identical_k0, checked)
    if adapters is not None and system.kind == "served":
        out["adapters"] = adapter_summary(runs, adapters, identical_k0, checked)
    if profile is not None:
        out["profile"] = profile_summary(profile)
        out["profile_raw"] = profile
    return out


def summarize_level(level: int, runs: dict[str, list[RunResult]], systems: list[System],
                    categories: Sequence[str] | None = None,
                    adapters: Sequence[str] | None = None) -> dict:
    """Every system of one concurrency level plus the ratios that matter: each to HF, spec to
    plain, served to in-process (same kappa and method), served to llama.cpp
    (:func:`peer_ratios`); ``mismatches``: the speculative specmesh systems whose output
    differs from their kappa = 0 counterpart's (request indices). Given the level's request
    ``categories`` (one per request), each system is also split by category, with each
    category's tokens/s over its kappa = 0 counterpart's (``ratio_to_k0``), and
    ``categories`` lists them in order. Given the requests' LoRA ``adapters`` (a mixed-adapter
    load), each served system is split by adapter too (``ratio_to_k0`` per adapter), and
    ``adapters`` lists them in order."""
    out = {name: summarize_system(s, runs[s.name], runs, categories, adapters)
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
    ratios.update(peer_ratios(out))
    vs_fixed = policy_vs_best_fixed(out, systems)
    for name, row in vs_fixed.items():
        if row["ratio"] is not None:
            ratios[f"{name} / best fixed ({row['best_fixed']})"] = row["ratio"]
    for s in systems:
        if s.name in out and s.plain in out and categories is not None:
            for cat, row in out[s.name]["categories"].items():
                base = out[s.plain]["categories"][cat]["median_tokens_per_s"]
                if row["median_tokens_per_s"] is not None and base:
                    row["ratio_to_k0"] = row["median_tokens_per_s"] / base
    for s in systems:
        if s.name in out and s.plain in out and adapters is not None:
            for name, row in (out[s.name].get("adapters") or {}).items():
                base = (out[s.plain].get("adapters") or {}).get(name, {})
                base_tps = base.get("median_tokens_per_s")
                if row["median_tokens_per_s"] is not None and base_tps:
                    row["ratio_to_k0"] = row["median_tokens_per_s"] / base_tps
    plain_of = {s.name: s.plain for s in systems}
    mismatches = [{"concurrency": level, "system": name, "plain": plain_of[name],
                   "requests": [i for i, same in enumerate(s["identical_to_k0"]) if not same]}
                  for name, s in out.items() if s["exact"] is False]
    return {"concurrency": level, "num_requests": len(next(iter(runs.values()))[0].texts)
            if runs else 0, "systems": out, "ratios": ratios, "mismatches": mismatches,
            "categories": category_order(categories) if categories is not None else None,
            "adapters": category_order(adapters) if adapters is not None else None,
            "policy_vs_best_fixed": vs_fixed or None}


def peer_ratios(systems: dict[str, dict]) -> dict[str, float]:
    """specmesh served against llama.cpp at one level, from :func:`summarize_system` dicts
    by name: each served system's tokens/s over the best (fastest) llama-server system's, and
    its TTFT p50 over the lowest llama-server TTFT p50 (``TTFT p50 A / B``: below 1 is
    faster). Empty without llama-server systems."""
    llama = {n: s for n, s in systems.items() if s["kind"] == "llama"}
    served = {n: s for n, s in systems.items() if s["kind"] == "served"}
    out: dict[str, float] = {}
    if not llama:
        return out
    best = max(llama, key=lambda n: llama[n]["median_tokens_per_s"])
    if llama[best]["median_tokens_per_s"]:
        for n, s in served.items():
            out[f"{n} / best llama-server ({best})"] = (s["median_tokens_per_s"]
                                                        / llama[best]["median_tokens_per_s"])

    def ttft_p50(s: dict) -> float | None:
        return ((s.get("latency") or {}).get("ttft_ms") or {}).get("p50")

    timed = {n: ttft_p50(s) for n, s in llama.items() if ttft_p50(s)}
    if timed:
        fastest = min(timed, key=timed.__getitem__)
        for n, s in served.items():
            if ttft_p50(s) is not None:
                out[f"TTFT p50 {n} / {fastest}"] = ttft_p50(s) / timed[fastest]
    return out


def summarize(config: dict, runs: dict[int, dict[str, list[RunResult]]],
              systems: dict[int, list[System]],
              forward_cost: dict[str, dict] | None = None,
              categories: dict[int, list[str]] | None = None,
              adapters: dict[int, list[str]] | None = None) -> dict:
    """The whole bench: ``config`` (model, dtype, kappa, drafters, max_tokens, num_prompts,
    repeats, threads, ``notes``...), per level :func:`summarize_level` (split by the level's
    request ``categories`` when given: level -> one category per request; and by LoRA
    adapter, ``adapters``: level -> one adapter per request, a mixed-adapter load), the
    measured
    forward cost per
    level (``forward_cost``: concurrency as a string -> the
    :meth:`cluster.forward_cost.ForwardCost.as_dict` of a batch that size), for every
    profiled kappa > 0 system its step-cost check against its level's ratio, and
    ``mismatches``: every level's speculative systems whose output differs from kappa = 0
    (empty when every method is exact). ``forward_cost`` in the result is the smallest
    level's (batch 1 where the bench ran concurrency 1), ``forward_cost_by_level`` all."""
    levels = {}
    by_level = forward_cost or {}
    for level, level_runs in runs.items():
        lv = summarize_level(level, level_runs, systems[level],
                             (categories or {}).get(level), (adapters or {}).get(level))
        plain_of = {s.name: s.plain for s in systems[level]}
        cost = by_level.get(str(level))
        for name, s in lv["systems"].items():
            if s.get("profile_raw") and s["kappa"] > 0:
                plain = lv["systems"].get(plain_of.get(name) or "", {}).get("profile_raw")
                s["step_cost"] = step_cost_check(s["profile_raw"],
                                                 cost["ratio"] if cost else None, plain)
        levels[str(level)] = lv
    mismatches = [m for lv in levels.values() for m in lv["mismatches"]]
    first = by_level[min(by_level, key=int)] if by_level else None
    return {"config": config, "forward_cost": first, "forward_cost_by_level": by_level or None,
            "levels": levels, "mismatches": mismatches}


def history_notes(cleared: dict[str, list[bool]]) -> list[str]:
    """What the bench did about the drafters' cross-request memory, from the outcome of the
    clear before each served pass (cluster label -> one flag per pass: True cleared, False
    the gateway answered 404): a line for the clusters cleared before every pass and a loud
    one for those that could not be cleared. Empty without served passes."""
    done = [label for label, flags in cleared.items() if flags and all(flags)]
    failed = {label: flags for label, flags in cleared.items() if flags and not all(flags)}
    out = []
    if done:
        out.append(f"drafters' cross-request memory cleared through the gateway (POST "
                   f"{CLEAR_HISTORY_PATH}) before every served pass ({', '.join(done)}): no "
                   f"request was drafted from an earlier pass's output of its own prompt")
    for label, flags in failed.items():
        out.append(f"**drafters' cross-request memory NOT cleared on the {label} cluster "
                   f"({flags.count(False)} of {len(flags)} passes): its gateway has no "
                   f"{CLEAR_HISTORY_PATH} (HTTP 404, not supported by this server); a drafter "
                   f"that remembers earlier requests may draft from an earlier repeat of the "
                   f"same prompt**")
    return out


#: How the systems were warmed up (a line of every report's notes).
WARMUP_NOTE = ("warm-up: every served cluster (and llama-server) was sent each prompt once "
               "(4 tokens) before the timed passes, so every pass of every system finds the "
               "prompts in its prefix cache alike (with one warm-up prompt the first pass on "
               "each cluster prefilled cold: a policy's own cluster paid that in its only "
               "pass, the fixed kappas shared it)")


def run_notes(prompts: Sequence[dict], levels: Sequence[int], cleared: dict[str, list[bool]],
              predictions: bool) -> list[str]:
    """The config's ``notes``, header lines of the tables: the drafters' history
    (:func:`history_notes`; in-process drafters are cleared before every pass, by a call, so
    only the served ones can fail to be); the levels whose requests repeat prompts within a
    pass (concurrency above the number of prompts); and how the prompts' ``prediction`` was
    used (sent with ``predictions`` on the served kappa > 0 requests only, else not)."""
    out = [*history_notes(cleared), *([WARMUP_NOTE] if cleared else [])]
    for level in levels:
        if level > len(prompts):
            out.append(f"concurrency {level}: the {len(prompts)} prompts are cycled to "
                       f"{level} requests, so a pass repeats prompts and a drafter that "
                       f"remembers earlier requests may draft from the same prompt's output "
                       f"within the pass")
    with_pred = sum(1 for p in prompts if p.get("prediction"))
    if with_pred and predictions:
        out.append(f"Predicted Outputs: {with_pred} of {len(prompts)} prompts carry a "
                   f"prediction, sent as `prediction` (type content) on the served kappa > 0 "
                   f"requests; served k=0 stays plain decode (so identical k=K vs k=0 also "
                   f"shows a prediction changes no output); in-process, HF and llama-server "
                   f"run without it")
    elif with_pred:
        out.append(f"Predicted Outputs: {with_pred} of {len(prompts)} prompts carry a "
                   f"prediction, not sent (--predictions off, or no kappa > 0 system)")
    return out


def mismatch_lines(summary: dict) -> list[str]:
    """One loud line per speculative system whose output differs from its kappa = 0
    counterpart's (empty when every method is exact)."""
    return [f"OUTPUT MISMATCH at concurrency {m['concurrency']}: {m['system']} differs from "
            f"{m['plain']} on request(s) {', '.join(str(i) for i in m['requests'])}"
            for m in summary.get("mismatches", [])]
