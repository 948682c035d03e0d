"""One scrape for the whole cluster (docs/architecture.md, 'Observability'): the gateway's
``/metrics`` carries
every role's ``specmesh:*`` series, so a user points Prometheus at one target.

On each scrape the gateway fetches the exposition of every role in its roster (each role
registers its own ``metrics_url`` with the controller; that endpoint stays for direct
scraping) concurrently with httpx and a short timeout, parses it with prometheus_client's
parser, sets the ``role`` and ``instance`` labels of every sample to the roster's, and merges
the families with its own (one ``# TYPE`` per family, as Prometheus requires). A role that does
not answer in time (or answers garbage) is left out of that scrape and counted in
``specmesh:metrics_scrape_errors_total{role, instance}``. The same scheme as Prometheus
federation, done by the gateway so the user runs no second Prometheus.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import httpx
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

#: how long a scrape waits for a role's exposition, seconds
ROLE_SCRAPE_TIMEOUT_S = 2.0
PREFIX = "specmesh:"


class MetricsTarget(NamedTuple):
    """A role's own metrics endpoint, as the roster lists it."""

    role: str
    instance: str
    url: str


def targets_from_roster(roster: Iterable[dict], skip: str = "") -> list[MetricsTarget]:
    """The metrics endpoints of the roster's roles (entries with a ``metrics_url``), except
    instance ``skip`` (the gateway itself, whose series are its own registry's)."""
    return [MetricsTarget(r["role"], r["instance_id"], r["metrics_url"]) for r in roster
            if r.get("metrics_url") and r["instance_id"] != skip]


def relabel(text: str, role: str, instance: str) -> Iterator[Metric]:
    """The ``specmesh:*`` families of exposition ``text`` with every sample's ``role`` and
    ``instance`` labels set to ``role`` / ``instance``.

    Raises:
        ValueError: ``text`` is not the Prometheus text format.
    """
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(PREFIX):
            continue
        out = Metric(family.name, family.documentation, family.type, family.unit)
        for s in family.samples:
            out.add_sample(s.name, {**s.labels, "role": role, "instance": instance}, s.value,
                           s.timestamp, s.exemplar)
        yield out


def merge_families(families: Iterable[Metric]) -> list[Metric]:
    """One family per name, its samples those of every family of that name in order (the first
    one's type and help text; a family whose type differs is dropped with a warning)."""
    merged: dict[str, Metric] = {}
    for fam in families:
        have = merged.get(fam.name)
        if have is None:
            have = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        elif have.type != fam.type:
            log.warning("metric %s: type %s from a role conflicts with %s; dropped", fam.name,
                        fam.type, have.type)
            continue
        have.samples.extend(fam.samples)
    return list(merged.values())


class _Families:
    """A collector of fixed families (what ``generate_latest`` needs)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


class RosterMetrics:
    """The roles' series for the gateway's ``/metrics``. ``set_targets`` (from the roster, any
    thread) says whom to scrape; :meth:`exposition` (async, the ``/metrics`` handler) returns
    the gateway registry's families merged with every target's, relabelled.

    Args:
        registry: the gateway's registry; ``specmesh:metrics_scrape_errors_total`` is added to
            it (labels ``role``, ``instance``).
        timeout_s: how long a scrape waits for each role (all are fetched concurrently).
        transport: the HTTP transport of the fetches (None: httpx's own; a test passes
            ``httpx.MockTransport``).
    """

    def __init__(self, registry: CollectorRegistry,
                 timeout_s: float = ROLE_SCRAPE_TIMEOUT_S,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.registry = registry
        self.timeout_s = timeout_s
        self.transport = transport
        self._targets: tuple[MetricsTarget, ...] = ()
        self.scrape_errors = Counter("specmesh:metrics_scrape_errors",
                                     "Role metrics endpoints that did not answer a scrape of "
                                     "the gateway in time (or answered garbage)",
                                     ["role", "instance"], registry=registry)

    @property
    def targets(self) -> tuple[MetricsTarget, ...]:
        return self._targets

    def set_targets(self, targets: Iterable[MetricsTarget]) -> None:
        self._targets = tuple(targets)

    async def _fetch(self, client: httpx.AsyncClient, t: MetricsTarget) -> list[Metric]:
        try:
            resp = await client.get(t.url)
            resp.raise_for_status()
            return list(relabel(resp.text, t.role, t.instance))
        except Exception as err:  # noqa: BLE001 - timeout, refused, 5xx, not an exposition
            log.warning("metrics of %s %s at %s not scraped: %s", t.role, t.instance, t.url,
                        err)
            self.scrape_errors.labels(role=t.role, instance=t.instance).inc()
            return []

    async def role_families(self) -> list[Metric]:
        """Every target's ``specmesh:*`` families, relabelled (fetched concurrently; one that
        fails or times out is counted and left out)."""
        targets = self._targets
        if not targets:
            return []
        async with httpx.AsyncClient(timeout=self.timeout_s, transport=self.transport) as client:
            results = await asyncio.gather(*(self._fetch(client, t) for t in targets))
        return [fam for fams in results for fam in fams]

    async def exposition(self) -> bytes:
        """The gateway's own registry and every role's series, in the text format."""
        roles = await self.role_families()  # before collecting: scrape errors count now
        families = merge_families([*self.registry.collect(), *roles])
        return generate_latest(_Families(families))
