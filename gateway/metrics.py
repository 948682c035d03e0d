"""Prometheus metrics of the gateway (docs/architecture.md, 'Observability': vLLM's names under the
``specmesh:`` prefix).

Each app gets its own :class:`prometheus_client.CollectorRegistry` so tests can build several
apps in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specmesh.gateway.roster_metrics import RosterMetrics
from specmesh.cluster.metrics import profile_families
from specmesh.protocol.step_profile import StepProfile

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class _BackendCollector:
    """Reads the backend's own counters (in flight, protocol errors) at scrape time."""

    def __init__(self, backend) -> None:
        self._backend = backend

    def collect(self):
        in_flight = getattr(self._backend, "num_in_flight", None)
        if in_flight is not None:
            g = GaugeMetricFamily("specmesh:gateway_num_requests_in_flight",
                                  "Requests sent to a verifier and not finished")
            g.add_metric([], float(in_flight))
            yield g
        errors = getattr(self._backend, "num_protocol_errors", None)
        if errors is not None:
            c = CounterMetricFamily("specmesh:gateway_protocol_errors",
                                    "Malformed messages received by the gateway")
            c.add_metric([], float(errors))
            yield c


class _ProfileCollector:
    def __init__(self, profile: StepProfile) -> None:
        self._profile = profile

    def collect(self):
        yield from profile_families(self._profile, {"role": "gateway"})


class GatewayMetrics:
    """The gateway's counters and histograms in one (per-app) registry; ``roster`` adds every
    role's series to the gateway's ``/metrics`` (:meth:`exposition`)."""

    def __init__(self, registry: CollectorRegistry | None = None, backend=None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("specmesh:gateway_requests", "HTTP generation requests",
                                ["endpoint", "status"], registry=r)
        self.queue_full = Counter("specmesh:gateway_queue_full",
                                  "Requests refused with HTTP 429 (verifier queue full)",
                                  registry=r)
        self.request_success = Counter("specmesh:request_success",
                                       "Finished requests by finish reason",
                                       ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("specmesh:prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.generation_tokens = Counter("specmesh:generation_tokens",
                                         "Output tokens received from verifiers", registry=r)
        self.spec_num_drafts = Counter("specmesh:gateway_spec_decode_num_drafts",
                                       "Verify steps that included drafts", registry=r)
        self.spec_draft_tokens = Counter("specmesh:gateway_spec_decode_num_draft_tokens",
                                         "Draft tokens verified", registry=r)
        self.spec_accepted_tokens = Counter("specmesh:gateway_spec_decode_num_accepted_tokens",
                                            "Draft tokens accepted", registry=r)
        # per LoRA adapter (engine/lora.py; "base": no adapter): an adapter that changes the
        # output costs acceptance, since drafters draft from the base
        self.lora_draft_tokens = Counter(
            "specmesh:lora_spec_decode_num_draft_tokens", "Draft tokens verified, per LoRA "
            "adapter", ["lora_name"], registry=r)
        self.lora_accepted_tokens = Counter(
            "specmesh:lora_spec_decode_num_accepted_tokens", "Draft tokens accepted, per LoRA "
            "adapter", ["lora_name"], registry=r)
        self.synthetic_acceptance = Counter(
            "specmesh:gateway_spec_decode_synthetic_acceptance_requests",
            "Requests whose drafts the synthetic-acceptance ablation harness accepted (not "
            "verified: their output is not the target's)", registry=r)
        self.ttft = Histogram("specmesh:time_to_first_token_seconds",
                              "Time from request arrival to the first output token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("specmesh:inter_token_latency_seconds",
                             "Time between output tokens (a delta's gap spread over its tokens)",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("specmesh:e2e_request_latency_seconds",
                             "Time from request arrival to its end", buckets=_E2E_BUCKETS,
                             registry=r)
        if backend is not None:
            r.register(_BackendCollector(backend))
        #: tokenize / detokenize / sse time of this gateway (issue 10's step profile)
        self.profile = StepProfile()
        r.register(_ProfileCollector(self.profile))
        #: the roles whose series one scrape of the gateway carries (set from the roster)
        self.roster = RosterMetrics(r)

    async def exposition(self) -> bytes:
        """What ``/metrics`` serves: this registry's families and every roster role's."""
        return await self.roster.exposition()

    def observe_finished(self, finish_reason: str, prompt_tokens: int, output_tokens: int,
                         num_drafts: int, draft_tokens: int, accepted_tokens: int,
                         e2e_s: float, synthetic_acceptance: bool = False,
                         lora_name: str = "") -> None:
        """Account one request that reached the verifier and ended (``synthetic_acceptance``:
        its drafts were accepted by the ablation harness; ``lora_name``: its LoRA adapter, ""
        the base model)."""
        if synthetic_acceptance:
            self.synthetic_acceptance.inc()
        self.request_success.labels(finished_reason=finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        self.spec_num_drafts.inc(num_drafts)
        self.spec_draft_tokens.inc(draft_tokens)
        self.spec_accepted_tokens.inc(accepted_tokens)
        self.lora_draft_tokens.labels(lora_name=lora_name or "base").inc(draft_tokens)
        self.lora_accepted_tokens.labels(lora_name=lora_name or "base").inc(accepted_tokens)
        self.e2e.observe(e2e_s)
