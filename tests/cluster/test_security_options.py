"""The security and bounds options (cluster/security_options.py): ``--api-key`` or
``SPECMESH_API_KEY``, ``--protect-metrics``, the transport flags, the per-client limit, and the
ClusterConfig they make (the key kept out of its repr)."""

from __future__ import annotations

import argparse

import pytest

from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.security_options import (
    API_KEY_ENV, add_security_options, api_key_from, security_settings,
)


def _parse(*argv: str) -> dict:
    p = argparse.ArgumentParser()
    add_security_options(p)
    return security_settings(p.parse_args(list(argv)))


def test_defaults_open_and_auto(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert _parse() == {"api_key": None, "protect_metrics": False, "transport": "auto"}


def test_key_from_option_or_environment(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert _parse()["api_key"] == "from-env"
    assert _parse("--api-key", "given")["api_key"] == "given"
    monkeypatch.setenv(API_KEY_ENV, "")
    assert _parse()["api_key"] is None


def test_a_key_that_cannot_be_sent_in_a_header_is_refused_without_showing_it():
    with pytest.raises(SystemExit) as info:
        api_key_from("has space-secret")
    assert "secret" not in str(info.value)
    with pytest.raises(SystemExit):
        api_key_from("tab\there")


def test_transport_flags_and_limits():
    assert _parse("--insecure-transport")["transport"] == "insecure"
    assert _parse("--secure-transport")["transport"] == "curve"
    with pytest.raises(SystemExit):
        _parse("--secure-transport", "--insecure-transport")
    assert _parse("--protect-metrics")["protect_metrics"] is True
    assert _parse("--max-requests-per-client", "3")["max_requests_per_client"] == 3
    with pytest.raises(SystemExit):
        _parse("--max-requests-per-client", "-1")


def test_cluster_config_keeps_the_key_out_of_its_repr():
    cfg = ClusterConfig.create(api_key="sk-very-secret", transport="curve")
    assert cfg.api_key == "sk-very-secret" and "sk-very-secret" not in repr(cfg)
    assert cfg.transport == "curve" and cfg.max_requests_per_client == 256
    with pytest.raises(ValueError, match="transport"):
        ClusterConfig.create(transport="tls")
    with pytest.raises(ValueError, match="max_requests_per_client"):
        ClusterConfig.create(max_requests_per_client=-2)
