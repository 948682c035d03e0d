"""The soak's checks and report (benchmarks/soak.py, issue 38, 'Must show'): what the request
outcomes (cluster/soak_load.py), the roles' stats after the load and their memory say, and
whether each bound holds.

The bounds (:func:`verdict`): 0 greedy outputs that differ from plain decode's (the verifier
alone decides every committed token, so speculation and faults may cost requests, never
change one); 0 seeded outputs that differ between two runs of the same prompt and seed; 0 KV
blocks or request states held once the load has ended; every failed request failed with an
error naming its cause, within ``FAIL_WITHIN_S`` of its last sign of life; every role's RSS
grew by less than ``RSS_GROWTH_BOUND`` after its warm-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from specmesh.cluster.soak_load import MALFORMED, Outcome

#: a failed request must carry its error within this many seconds of its last sign of life
FAIL_WITHIN_S = 10.0
#: most RSS growth of a role process after its warm-up (fraction)
RSS_GROWTH_BOUND = 0.05
#: request kinds whose output is checked against plain greedy decode
GREEDY = frozenset({"greedy", "greedy_stream", "chat"})


def reference_key(o: Outcome) -> tuple[str, str]:
    """The reference a greedy outcome is checked against: (``chat`` or ``completion``,
    prompt)."""
    return ("chat" if o.kind == "chat" else "completion", o.prompt)


def greedy_mismatches(outcomes: list[Outcome],
                      reference: dict[tuple[str, str], list[int]]) -> tuple[int, int]:
    """(checked, wrong): completed greedy outputs, and those whose token ids differ from the
    plain-decode ``reference`` for the same prompt (:func:`reference_key`).

    Raises:
        KeyError: a greedy prompt without a reference.
    """
    done = [o for o in outcomes if o.kind in GREEDY and o.ok]
    return len(done), sum(o.token_ids != reference[reference_key(o)] for o in done)


def seeded_mismatches(outcomes: list[Outcome]) -> tuple[int, int]:
    """(checked, wrong): completed seeded outputs, and those that differ from the first
    completed output of the same (prompt, seed)."""
    first: dict[tuple[str, int | None], list[int] | None] = {}
    checked = wrong = 0
    for o in outcomes:
        if o.kind != "seeded" or not o.ok:
            continue
        key = (o.prompt, o.seed)
        if key in first:
            checked += 1
            wrong += o.token_ids != first[key]
        else:
            first[key] = o.token_ids
    return checked, wrong


@dataclass
class Failures:
    """The failed requests: how many, how many without a cause from the server, how many
    that took longer than ``FAIL_WITHIN_S``, and a few examples of each cause."""

    count: int = 0
    without_cause: int = 0
    slow: int = 0
    causes: dict[str, int] = field(default_factory=dict)
    examples: list[dict] = field(default_factory=list)


def failure_delay(o: Outcome, kill_times: list[float]) -> float:
    """Seconds from what a failed request last heard or suffered to its error: the latest of
    its last sign of life (start, latest chunk) and the latest kill before its end (a request
    in flight when its verifier is killed must fail within the bound of the kill, however long
    it had run)."""
    last = o.ended - o.stall_s
    kills = [t for t in kill_times if t <= o.ended]
    return o.ended - max([last, *kills])


def failures(outcomes: list[Outcome], kill_times: list[float] = (),
             within_s: float = FAIL_WITHIN_S) -> Failures:
    """Summarise the failed outcomes (causes grouped by their first 80 characters); a failure
    is slow when its :func:`failure_delay` exceeds ``within_s``. ``kill_times``: when the soak
    killed a role (the outcomes' clock)."""
    f = Failures()
    for o in outcomes:
        if o.ok:
            continue
        f.count += 1
        f.without_cause += not o.cause
        delay = failure_delay(o, list(kill_times))
        f.slow += delay > within_s
        key = (o.cause or f"(no cause) {o.note}")[:80]
        f.causes[key] = f.causes.get(key, 0) + 1
        if (not o.cause or delay > within_s) and len(f.examples) < 10:
            f.examples.append(o.as_dict() | {"delay_s": round(delay, 2)})
    return f


def leftovers(stats: dict[str, dict]) -> dict[str, int]:
    """What the roles still hold for requests, from each role's ``stats()`` (instance id ->
    stats); all zero on an idle cluster: verifier KV blocks in use and request states,
    prefill KV blocks in use beyond its prefix cache's evictable ones, drafter request
    states, gateway requests in flight (summed over instances of a role)."""
    out = {"verifier_kv_blocks": 0, "verifier_requests": 0, "prefill_kv_blocks": 0,
           "drafter_requests": 0, "gateway_in_flight": 0}
    for iid, st in stats.items():
        if iid.startswith("verifier"):
            out["verifier_kv_blocks"] += round(st["kv_cache_usage"] * st["num_kv_blocks"])
            out["verifier_requests"] += len(st["requests"]) + st.get("num_waiting", 0)
        elif iid.startswith("prefill"):
            out["prefill_kv_blocks"] += st["num_used_kv_blocks"] - st["num_evictable_kv_blocks"]
        elif iid.startswith("drafter"):
            out["drafter_requests"] += st["num_requests"]
        elif iid.startswith("gateway"):
            out["gateway_in_flight"] += st["num_in_flight"]
    return out


@dataclass
class _Process:
    first_seen: float
    baseline: int | None = None
    baseline_at: float = 0.0
    last: int = 0
    last_at: float = 0.0


@dataclass
class RssTracker:
    """RSS of each role's process over the soak. A process's baseline is its first sample
    taken ``warmup_s`` after it was first seen (a restarted role is a new process with its
    own warm-up); its growth is (last - baseline) / baseline. ``rss(pid)`` reads a process's
    resident set size in bytes (psutil's ``memory_info().rss`` in the soak)."""

    rss: Callable[[int], int]
    warmup_s: float
    processes: dict[tuple[str, int], _Process] = field(default_factory=dict)
    current: dict[str, int] = field(default_factory=dict)

    def sample(self, pids: dict[str, int], now: float) -> None:
        """Read the RSS of every role's current process (instance id -> pid); a process that
        is gone (killed between the stats call and this one) is skipped."""
        for iid, pid in pids.items():
            try:
                value = self.rss(pid)
            except Exception:  # noqa: BLE001 - gone meanwhile (psutil.NoSuchProcess and kin)
                continue
            p = self.processes.setdefault((iid, pid), _Process(first_seen=now))
            self.current[iid] = pid
            p.last, p.last_at = value, now
            if p.baseline is None and now - p.first_seen >= self.warmup_s:
                p.baseline, p.baseline_at = value, now

    def growth(self) -> dict[str, dict]:
        """Per role instance, its current process's pid, baseline and last RSS (MiB), growth
        (fraction; None when the process has not lived past its warm-up) and the seconds
        between the two samples."""
        out = {}
        for iid, pid in sorted(self.current.items()):
            p = self.processes[(iid, pid)]
            g = None if p.baseline is None else (p.last - p.baseline) / p.baseline
            out[iid] = {"pid": pid, "baseline_mib": _mib(p.baseline), "last_mib": _mib(p.last),
                        "growth": g, "window_s": None if g is None else
                        round(p.last_at - p.baseline_at, 1)}
        return out


def _mib(n: int | None) -> float | None:
    return None if n is None else round(n / 2 ** 20, 1)


def verdict(report: dict) -> dict[str, bool]:
    """Each must-show bound of ``report`` (as :func:`build_report` makes it) -> whether it
    holds. A role whose process never lived past its warm-up has no growth figure and does
    not fail the RSS bound."""
    g = report["rss"]
    return {
        "0 wrong greedy outputs": report["greedy"]["wrong"] == 0,
        "0 wrong seeded outputs": report["seeded"]["wrong"] == 0,
        "0 leaked KV blocks or request states": not any(report["leftovers"].values()),
        "every failure names its cause": report["failures"]["without_cause"] == 0,
        f"every failure within {FAIL_WITHIN_S:g} s": report["failures"]["slow"] == 0,
        f"RSS growth < {RSS_GROWTH_BOUND:.0%} after warm-up": all(
            r["growth"] is None or r["growth"] < RSS_GROWTH_BOUND for r in g.values()),
        "some greedy outputs checked": report["greedy"]["checked"] > 0,
    }


def build_report(outcomes: list[Outcome], reference: dict[tuple[str, str], list[int]],
                 left: dict[str, int], rss: dict[str, dict], meta: dict,
                 kill_times: list[float] = ()) -> dict:
    """The soak's report: ``meta`` (settings, kills, curve, ...) plus requests by kind,
    greedy and seeded checks, failures (``kill_times``: :func:`failures`), leftovers, RSS
    growth and the verdict."""
    kinds: dict[str, dict[str, int]] = {}
    for o in outcomes:
        k = kinds.setdefault(o.kind, {"sent": 0, "ok": 0, "failed": 0})
        k["sent"] += 1
        k["ok" if o.ok else "failed"] += 1
    served = sum(o.ok and o.kind not in MALFORMED for o in outcomes)
    checked, wrong = greedy_mismatches(outcomes, reference)
    s_checked, s_wrong = seeded_mismatches(outcomes)
    f = failures(outcomes, kill_times)
    report = {**meta, "requests": len(outcomes), "served": served, "failed": f.count,
              "kinds": kinds,
              "accepted_draft_tokens": sum(o.accepted for o in outcomes),
              "greedy": {"checked": checked, "wrong": wrong},
              "seeded": {"checked": s_checked, "wrong": s_wrong},
              "failures": vars(f), "leftovers": left, "rss": rss}
    report["verdict"] = verdict(report)
    report["passed"] = all(report["verdict"].values())
    return report


def render(report: dict) -> str:
    """The report as a plain-text table."""
    lines = [f"soak: {report.get('minutes', '?')} min, model {report.get('model', '?')}, "
             f"curve {report.get('curve')}, kills {len(report.get('kills', []))}, "
             f"load average {report.get('load_average', '?')}",
             f"{'kind':16s}{'sent':>8s}{'ok':>8s}{'failed':>8s}"]
    for kind, k in sorted(report["kinds"].items()):
        lines.append(f"{kind:16s}{k['sent']:8d}{k['ok']:8d}{k['failed']:8d}")
    f = report["failures"]
    lines += [f"requests {report['requests']}, served {report['served']}, failed {f['count']} "
              f"(without cause {f['without_cause']}, over {FAIL_WITHIN_S:g} s {f['slow']}); "
              f"accepted draft tokens {report['accepted_draft_tokens']}",
              f"greedy checked {report['greedy']['checked']}, wrong {report['greedy']['wrong']}; "
              f"seeded checked {report['seeded']['checked']}, wrong {report['seeded']['wrong']}",
              "causes: " + "; ".join(f"{n}x {c}" for c, n in sorted(
                  f["causes"].items(), key=lambda kv: -kv[1])),
              "leftovers: " + ", ".join(f"{k} {v}" for k, v in report["leftovers"].items())]
    for iid, r in report["rss"].items():
        g = ("n/a (younger than its warm-up)" if r["growth"] is None
             else f"{r['growth']:+.1%} over {r.get('window_s')} s")
        lines.append(f"rss {iid:12s} pid {r['pid']:>7d}  {r['baseline_mib']} -> "
                     f"{r['last_mib']} MiB  {g}")
    for bound, ok in report["verdict"].items():
        lines.append(f"{'PASS' if ok else 'FAIL'}  {bound}")
    return "\n".join(lines)
