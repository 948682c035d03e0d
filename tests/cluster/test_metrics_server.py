"""cluster/metrics_server.py: a role's /metrics server binds and serves without a reverse DNS
lookup of its own address (which held every role start 10 s on a host whose DNS server does
not answer: issue 39's namespace hosts)."""

from __future__ import annotations

import socket

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from specmesh.cluster.metrics_server import start_metrics_server


def test_serves_the_registry_without_looking_its_address_up(monkeypatch):
    looked_up = []

    def no_dns(*args):  # what a resolver without an answering server amounts to
        looked_up.append(args)
        raise AssertionError(f"reverse DNS lookup of {args}")

    monkeypatch.setattr(socket, "getfqdn", no_dns)
    monkeypatch.setattr(socket, "gethostbyaddr", no_dns)
    registry = CollectorRegistry()
    Counter("specmesh_test_scrapes", "a counter", registry=registry).inc(3)
    server = start_metrics_server(registry, "127.0.0.1")
    try:
        assert server.server_port > 0 and server.server_name == "127.0.0.1"
        body = httpx.get(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10).text
        assert "specmesh_test_scrapes_total 3.0" in body
        assert looked_up == []
    finally:
        server.shutdown()
        server.server_close()


def test_an_address_not_on_this_host_is_refused():
    with pytest.raises(OSError):
        start_metrics_server(CollectorRegistry(), "192.0.2.1")  # TEST-NET-1: nobody's
