"""A drafter's corpus series (cluster/metrics.py): corpora held and their tokens, and the share
of proposed draft tokens copied from a corpus, read from the worker at scrape time."""

from __future__ import annotations

import time
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import specmesh.drafter.proposers  # noqa: F401
from specmesh.cluster.metrics import RoleCollector
from specmesh.drafter.config import DrafterConfig
from specmesh.drafter.worker import DrafterWorker
from specmesh.protocol.messages import DrafterCorpus, DrafterCorpusResult
from specmesh.protocol.transport import InProcHub

from helpers.proposers import OracleProposer


def _scrape(worker) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(RoleCollector(SimpleNamespace(role="drafter", instance_id="drafter-0",
                                                    worker=worker)))
    text = generate_latest(registry).decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.startswith("specmesh:drafter_")}


def test_corpus_series_follow_the_drafter():
    hub = InProcHub()
    v = hub.mailbox("verifier-0")
    d = DrafterWorker(DrafterConfig(window=4, max_segment=4), hub.mailbox("drafter-0"))
    assert _scrape(d) == {"specmesh:drafter_corpora": 0, "specmesh:drafter_corpus_tokens": 0,
                          "specmesh:drafter_proposed_draft_tokens_total": 0,
                          "specmesh:drafter_corpus_draft_tokens_total": 0}
    v.send("drafter-0", DrafterCorpus(op="load", op_id=1, name="docs",
                                      token_ids=[10, 11, 12, 13, 14]))
    deadline = time.monotonic() + 10
    while not [e for e in v.drain() if isinstance(e.msg, DrafterCorpusResult)]:
        assert time.monotonic() < deadline
        d.step(0.05)
    d.proposer.propose("r", [1, 2, 3, 1, 2], 2)  # in-context: [3, 1]
    d.proposer.propose("r", [9, 10, 11], 3)  # from the corpus: [12, 13, 14]
    assert _scrape(d) == {"specmesh:drafter_corpora": 1, "specmesh:drafter_corpus_tokens": 5,
                          "specmesh:drafter_proposed_draft_tokens_total": 5,
                          "specmesh:drafter_corpus_draft_tokens_total": 3}


def test_a_method_without_corpora_exports_the_gauges_only():
    d = DrafterWorker(DrafterConfig(window=4, max_segment=4), InProcHub().mailbox("drafter-0"),
                      OracleProposer([], []))
    assert set(_scrape(d)) == {"specmesh:drafter_corpora", "specmesh:drafter_corpus_tokens"}
