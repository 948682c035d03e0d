"""Prometheus metrics of a role process (docs/architecture.md, 'Observability'), read from the
worker's plain counters
at scrape time. vLLM's names under the ``specmesh:`` prefix, so PromQL recipes carry over; the
verifier is the source of truth for the spec-decode counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from specmesh.cluster.metrics_server import start_metrics_server
from specmesh.decode.rules import outputs_exact
from specmesh.protocol.step_profile import BUCKETS_S, StepProfile


def _counter(name: str, doc: str, value: float, labels: dict[str, str]) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=list(labels))
    c.add_metric(list(labels.values()), float(value))
    return c


def _gauge(name: str, doc: str, value: float, labels: dict[str, str]) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=list(labels))
    g.add_metric(list(labels.values()), float(value))
    return g


def profile_families(profile: StepProfile, labels: dict[str, str]):
    """``profile`` as Prometheus families: ``specmesh:step_phase_seconds`` (a histogram with a
    ``phase`` label) and ``specmesh:step_profile_count`` (its counters, ``name`` label)."""
    snap = profile.as_dict()
    hist = HistogramMetricFamily("specmesh:step_phase_seconds",
                                 "Time per phase of a role's step", labels=[*labels, "phase"])
    for phase, st in snap["phases"].items():
        cumulative, buckets = 0, []
        for bound, n in zip([*BUCKETS_S, float("inf")], st["buckets"]):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        hist.add_metric([*labels.values(), phase], buckets, st["total_ms"] / 1e3)
    yield hist
    counts = CounterMetricFamily("specmesh:step_profile_count",
                                 "Step counters of a role (steps, steps with drafts, ...)",
                                 labels=[*labels, "name"])
    for name, n in snap["counters"].items():
        counts.add_metric([*labels.values(), name], float(n))
    yield counts


def drafter_corpus_families(worker, labels: dict[str, str]):
    """A drafter's corpora (docs/drafters.md, 'Corpora'): ``specmesh:drafter_corpora`` and
    ``specmesh:drafter_corpus_tokens`` (gauges: corpora held and their tokens) and, for a
    method that drafts from corpora, ``specmesh:drafter_proposed_draft_tokens`` and
    ``specmesh:drafter_corpus_draft_tokens`` (counters: draft tokens it proposed, and those it
    copied from a corpus; their ratio is the corpus's share of the drafts)."""
    st = worker.stats
    yield _gauge("specmesh:drafter_corpora", "Corpora the drafter holds", st.num_corpora,
                 labels)
    yield _gauge("specmesh:drafter_corpus_tokens", "Tokens of the corpora the drafter holds",
                 st.num_corpus_tokens, labels)
    p = worker.proposer
    if p.supports_corpus:
        yield _counter("specmesh:drafter_proposed_draft_tokens",
                       "Draft tokens the drafting method proposed", p.num_draft_tokens_proposed,
                       labels)
        yield _counter("specmesh:drafter_corpus_draft_tokens",
                       "Proposed draft tokens copied from a corpus", p.num_corpus_draft_tokens,
                       labels)


class RoleCollector:
    """Collects ``host.worker.stats`` (and the verifier's load) for one role host."""

    def __init__(self, host) -> None:
        self.host = host

    def collect(self):
        h = self.host
        labels = {"role": h.role, "instance": h.instance_id}
        st = h.worker.stats
        yield _counter("specmesh:protocol_errors", "Malformed or out-of-turn messages received",
                       st.num_protocol_errors, labels)
        mailbox = getattr(h, "mailbox", None)  # none: a worker driven in process, no socket
        if mailbox is not None:
            yield _counter("specmesh:transport_refused_peers",
                           "Connections refused at the CurveZMQ handshake: a key not in the "
                           "roster", mailbox.num_refused_peers, labels)
        yield from profile_families(h.worker.profile, labels)
        if h.role == "drafter":
            yield from drafter_corpus_families(h.worker, labels)
        if h.role == "prefill":
            yield _counter("specmesh:prefill_requests", "Prompts prefilled", st.num_requests,
                           labels)
            yield _counter("specmesh:prefix_cache_queries",
                           "Prompt tokens looked up in the prefill's prefix cache",
                           st.prefix_cache_queries, labels)
            yield _counter("specmesh:prefix_cache_hits",
                           "Prompt tokens whose KV the prefill's prefix cache held",
                           st.prefix_cache_hits, labels)
        if h.role != "verifier":
            return
        yield _counter("specmesh:spec_decode_num_drafts", "Verify steps x requests with drafts",
                       st.num_verify_steps, labels)
        yield _counter("specmesh:spec_decode_num_draft_tokens", "Draft tokens verified",
                       st.num_draft_tokens, labels)
        yield _counter("specmesh:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                       st.num_accepted_tokens, labels)
        per_pos = CounterMetricFamily("specmesh:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens by draft position",
                                      labels=[*labels, "position"])
        for pos, n in enumerate(st.num_accepted_tokens_per_pos):
            per_pos.add_metric([*labels.values(), str(pos)], float(n))
        yield per_pos
        cfg = h.worker.config
        synthetic = not outputs_exact(cfg.verify_rule)  # the ablation harness (decode/rules.py)
        yield _gauge("specmesh:spec_decode_synthetic_acceptance",
                     "1 when drafts are accepted by the synthetic-acceptance ablation harness "
                     "(--verify-rule synthetic), not verified", float(synthetic), labels)
        if synthetic:
            rates = GaugeMetricFamily("specmesh:spec_decode_synthetic_acceptance_rate",
                                      "The synthetic acceptance curve, by draft position",
                                      labels=[*labels, "position"])
            for pos, rate in enumerate(cfg.synthetic_acceptance):
                rates.add_metric([*labels.values(), str(pos)], float(rate))
            yield rates
        sched = h.worker.scheduler
        yield _gauge("specmesh:spec_decode_kappa", "Kappa (most drafts per request) of the "
                     "latest verify step: the adaptive schedule's under --speculative-policy "
                     "schedule, else the configured one", sched.current_kappa, labels)
        if sched.kappa_schedule is not None:
            yield _counter("specmesh:spec_decode_kappa_changes", "Moves of the adaptive "
                           "schedule's kappa", len(sched.kappa_schedule.changes), labels)
        gate = sched.speculation_gate
        if gate is not None:  # the goodput policy's speculation gate
            yield _gauge("specmesh:spec_decode_drafting", "1 while the speculation gate has "
                         "drafting on, 0 while it measured drafting as slower and paused it",
                         float(gate.on), labels)
            yield _counter("specmesh:spec_decode_gate_switches", "Switches of the speculation "
                           "gate (its probes included)", gate.stats.num_switches, labels)
        budget = getattr(sched, "confidence_budget", None)
        if budget is not None:  # --speculative-policy confidence (decode/confidence_budget.py)
            yield from _confidence_metrics(budget.stats, labels)
        yield _counter("specmesh:sibling_forks",
                       "Requests started on a sibling's prompt KV (the n choices of a prompt)",
                       st.num_sibling_forks, labels)
        yield _counter("specmesh:stale_tail_tokens", "Draft tail tokens discarded as stale",
                       st.num_stale_tail_tokens, labels)
        yield _counter("specmesh:seed_state_bytes", "Draft seed-state bytes received with "
                       "PrefillDone (hidden states of the last prompt position, draft seeds)",
                       st.seed_state_bytes, labels)
        yield _counter("specmesh:draft_seed_bytes", "Draft seed bytes received with "
                       "PrefillDone (the draft head's first step run at the prefill)",
                       st.draft_seed_bytes, labels)
        yield _counter("specmesh:bad_draft_seeds", "Malformed draft seeds ignored",
                       st.num_bad_draft_seeds, labels)
        kv = h.worker.kv.stats
        yield _counter("specmesh:kv_transfer_bytes", "KV bytes received from prefill",
                       kv.num_bytes, labels)
        yield _counter("specmesh:kv_transfer_seconds", "Time from PrefillRequest to complete KV",
                       kv.transfer_seconds, labels)
        load = h.worker.load
        yield _gauge("specmesh:num_requests_running", "Requests in the verify batch",
                     load["num_running"], labels)
        yield _gauge("specmesh:num_requests_waiting", "Requests queued for KV room",
                     load["num_waiting"], labels)
        bm = h.worker.block_manager
        yield _gauge("specmesh:kv_cache_usage_perc", "Fraction of KV blocks in use",
                     1 - bm.num_free_blocks / bm.num_blocks, labels)


def serve_role_metrics(host, addr: str) -> int:
    """Expose ``host``'s metrics on ``http://addr:<port>/metrics``; returns the bound port
    (cluster/metrics_server.py: no reverse DNS lookup of ``addr``, which held every role start
    10 s on a host without a DNS server that answers)."""
    registry = CollectorRegistry()
    registry.register(RoleCollector(host))
    return start_metrics_server(registry, addr).server_port


def _confidence_metrics(st, labels: dict[str, str]):  # noqa: ANN001, ANN202
    """The confidence budget's running sums: predicted vs realised accepted drafts of the
    steps it decided (decode/confidence_budget.py ConfidenceStats), for calibration."""
    yield _counter("specmesh:spec_decode_confidence_steps", "Verify steps the confidence "
                   "budget decided", st.num_steps, labels)
    yield _counter("specmesh:spec_decode_confidence_fallback_steps", "Verify steps the "
                   "confidence policy left to the goodput caps (no profiled cost table)",
                   st.num_fallback_steps, labels)
    yield _counter("specmesh:spec_decode_confidence_predicted_accepted", "Accepted drafts the "
                   "confidence budget predicted (sum of the admitted slots' scores)",
                   st.predicted_accepted, labels)
    yield _counter("specmesh:spec_decode_confidence_realised_accepted", "Accepted drafts of "
                   "the steps the confidence budget decided", st.realised_accepted, labels)

