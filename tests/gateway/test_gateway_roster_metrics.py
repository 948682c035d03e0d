"""One scrape of the gateway carries every role's series (docs/architecture.md, 'Observability'):
the roles'
expositions are fetched concurrently, relabelled with the roster's role and instance, merged
with the gateway's own families (one family per name); a role that does not answer in time is
left out and counted per role. Fake role endpoints on 127.0.0.1 (and a fake transport for the
order of the fetches), no Ray."""

from __future__ import annotations

import asyncio
import socket

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from specmesh.gateway.metrics import GatewayMetrics
from specmesh.gateway.roster_metrics import MetricsTarget, RosterMetrics, targets_from_roster

#: seconds after which a wait for something that must happen fails as hung
HANG_S = 60.0


def _role_endpoint(role: str, instance: str, kv: float, accepted: list[int]):
    """A role's own /metrics (as cluster/metrics.py labels it), on a free port."""
    reg = CollectorRegistry()
    usage = Gauge("specmesh:kv_cache_usage_perc", "KV usage", ["role", "instance"], registry=reg)
    usage.labels(role, instance).set(kv)
    per_pos = Counter("specmesh:spec_decode_num_accepted_tokens_per_pos", "per position",
                      ["role", "instance", "position"], registry=reg)
    for pos, n in enumerate(accepted):
        per_pos.labels(role, instance, str(pos)).inc(n)
    errors = Counter("specmesh:protocol_errors", "errors", ["role", "instance"], registry=reg)
    errors.labels(role, instance).inc(len(accepted))
    # a role's endpoint may carry other series: only specmesh:* ones are relayed
    Gauge("process_fake_bytes", "not ours", registry=reg).set(1)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=reg)
    return server, f"http://127.0.0.1:{server.server_port}/metrics"


def _samples(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def test_targets_come_from_the_roster_without_the_gateway_itself():
    roster = [{"instance_id": "verifier-0", "role": "verifier", "metrics_url": "http://a"},
              {"instance_id": "gateway-0", "role": "gateway", "url": "http://g"},
              {"instance_id": "drafter-0", "role": "drafter", "metrics_url": "http://d"}]
    assert targets_from_roster(roster, skip="gateway-0") == [
        MetricsTarget("verifier", "verifier-0", "http://a"),
        MetricsTarget("drafter", "drafter-0", "http://d")]


def test_one_scrape_carries_every_role_relabelled_and_a_silent_role_is_counted():
    v_server, v_url = _role_endpoint("verifier", "verifier-0", 0.25, [7, 3, 1])
    # the roster says "prefill-0": labels are the roster's, whatever the role exposes
    p_server, p_url = _role_endpoint("prefill", "stale-name", 0.0, [])
    hang = socket.socket()  # accepts connections (backlog) and never answers
    hang.bind(("127.0.0.1", 0))
    hang.listen(8)
    hang_url = f"http://127.0.0.1:{hang.getsockname()[1]}/metrics"
    try:
        gw = GatewayMetrics(CollectorRegistry())
        gw.requests.labels(endpoint="/v1/completions", status="200").inc()
        gw.roster.timeout_s = 0.5
        gw.roster.set_targets([MetricsTarget("verifier", "verifier-0", v_url),
                               MetricsTarget("prefill", "prefill-0", p_url),
                               MetricsTarget("drafter", "drafter-0", hang_url)])
        text = asyncio.run(gw.exposition()).decode()
        got = _samples(text)
        # the verifier's KV usage and per-position acceptance, labelled by role and instance
        vl = (("instance", "verifier-0"), ("role", "verifier"))
        assert got["specmesh:kv_cache_usage_perc", vl] == 0.25
        for pos, n in enumerate([7, 3, 1]):
            key = tuple(sorted((*vl, ("position", str(pos)))))
            assert got["specmesh:spec_decode_num_accepted_tokens_per_pos_total", key] == n
        pl = (("instance", "prefill-0"), ("role", "prefill"))
        assert got["specmesh:protocol_errors_total", pl] == 0
        assert ("specmesh:protocol_errors_total", vl) in got
        assert not any(name.startswith("process_fake") for name, _ in got)
        # the gateway's own series are there too, and each family is declared once
        assert got["specmesh:gateway_requests_total", (("endpoint", "/v1/completions"),
                                                       ("status", "200"))] == 1
        types = [ln for ln in text.splitlines() if ln.startswith("# TYPE ")]
        assert len(types) == len(set(types))
        # the silent drafter is left out and counted (that it holds up no other role: below)
        assert not any(dict(labels).get("role") == "drafter" and not name.startswith(
            "specmesh:metrics_scrape_errors") for name, labels in got)
        dl = (("instance", "drafter-0"), ("role", "drafter"))
        assert got["specmesh:metrics_scrape_errors_total", dl] == 1
        # values equal a direct scrape of the role's own endpoint (which stays)
        direct = _samples(httpx.get(v_url, timeout=5).text)
        for (name, labels), value in direct.items():
            if name.startswith("specmesh:") and not name.endswith("_created"):
                assert got[name, labels] == value, name
    finally:
        hang.close()
        v_server.shutdown()
        p_server.shutdown()


def test_roles_are_fetched_concurrently_each_under_the_scrape_timeout():
    """No role waits for another: every fetch is under way before any is answered (so a silent
    role costs a scrape its own timeout, not the sum of all), each request carries the scrape
    timeout, and a fetch that times out is counted and left out."""
    targets = [MetricsTarget("verifier", "verifier-0", "http://v/metrics"),
               MetricsTarget("prefill", "prefill-0", "http://p/metrics"),
               MetricsTarget("drafter", "drafter-0", "http://d/metrics")]
    asked: list[str] = []
    timeouts: list[dict] = []
    all_asked = asyncio.Event()

    async def role(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.host)
        timeouts.append(request.extensions["timeout"])
        if len(asked) == len(targets):
            all_asked.set()
        # one at a time, the first fetch would wait here for ever (HANG_S: fail, not hang)
        await asyncio.wait_for(all_asked.wait(), HANG_S)
        if request.url.host == "d":
            raise httpx.ReadTimeout("no answer in time", request=request)
        return httpx.Response(200, text="# TYPE specmesh:kv_cache_usage_perc gauge\n"
                                        "specmesh:kv_cache_usage_perc 0.5\n")

    roster = RosterMetrics(CollectorRegistry(), timeout_s=0.5,
                           transport=httpx.MockTransport(role))
    roster.set_targets(targets)
    got = _samples(asyncio.run(roster.exposition()).decode())
    assert sorted(asked) == ["d", "p", "v"]
    assert timeouts == [{"connect": 0.5, "read": 0.5, "write": 0.5, "pool": 0.5}] * 3
    usage = {dict(labels)["role"] for name, labels in got
             if name == "specmesh:kv_cache_usage_perc"}
    assert usage == {"verifier", "prefill"}
    errors = {dict(labels)["role"]: v for (name, labels), v in got.items()
              if name == "specmesh:metrics_scrape_errors_total"}
    assert errors == {"drafter": 1}


def test_no_roster_no_fetch():
    reg = CollectorRegistry()
    roster = RosterMetrics(reg)
    text = asyncio.run(roster.exposition()).decode()
    assert "specmesh:metrics_scrape_errors" in text  # declared, no samples yet
