"""The drafter's side of DrafterCorpus (drafter/corpus_loader.py through the DrafterWorker, on an
in-process hub): chunks are put together and the corpus drafts from; an operation relayed by
two verifiers is applied once and answered to both; an older operation never undoes a newer
one; broken chunk sequences, failing and unsupported methods are answered, never fatal; and
drafting goes on while a corpus is being loaded."""

from __future__ import annotations

import threading
import time

import specmesh.drafter.proposers  # noqa: F401
from specmesh.drafter.config import DrafterConfig
from specmesh.drafter.proposers.ngram import NgramProposer
from specmesh.drafter.worker import DrafterWorker
from specmesh.protocol.messages import (
    DrafterCorpus,
    DrafterCorpusResult,
    DraftSync,
    DraftTailStream,
    SamplingParams,
)
from specmesh.protocol.transport import InProcHub

from helpers.proposers import OracleProposer

PASSAGE = list(range(1000, 1030))


def _setup(proposer=None, verifiers=("verifier-0",)):
    hub = InProcHub()
    vs = [hub.mailbox(v) for v in verifiers]
    d = DrafterWorker(DrafterConfig(window=4, max_segment=4), hub.mailbox("drafter-0"),
                      proposer)
    return vs, d


def _load(v, name, tokens, op_id, chunk=4):
    parts = [tokens[i:i + chunk] for i in range(0, len(tokens), chunk)]
    for i, part in enumerate(parts):
        v.send("drafter-0", DrafterCorpus(op="load", op_id=op_id, name=name, token_ids=part,
                                          chunk_index=i, num_chunks=len(parts)))


def _results(v, d, n=1, timeout_s=10.0):
    """Step the drafter until ``v`` got ``n`` DrafterCorpusResults."""
    got = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        assert time.monotonic() < deadline, f"only {got}"
        d.step(0.05)
        got += [e.msg for e in v.drain() if isinstance(e.msg, DrafterCorpusResult)]
    return got


def test_a_chunked_load_is_drafted_from_and_dropped():
    (v,), d = _setup()
    _load(v, "docs", [7, 7] + PASSAGE, op_id=5)
    (res,) = _results(v, d)
    assert (res.op, res.op_id, res.name, res.drafter, res.status, res.num_tokens) == \
        ("load", 5, "docs", "drafter-0", "applied", 32)
    assert d.proposer.corpora() == {"docs": 32}
    assert (d.stats.num_corpora, d.stats.num_corpus_tokens) == (1, 32)
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=[1, 2, 3, 1000],
                                  committed_token_ids=[1001], sampling=SamplingParams()))
    d.step()
    (seg,) = [e.msg for e in v.drain() if isinstance(e.msg, DraftTailStream)]
    assert seg.draft_token_ids == PASSAGE[2:6]
    v.send("drafter-0", DrafterCorpus(op="drop", op_id=6, name="docs", token_ids=[]))
    (res,) = _results(v, d)
    assert (res.status, res.num_tokens) == ("applied", 0) and d.proposer.corpora() == {}
    assert d.stats.num_corpora == 0
    v.send("drafter-0", DrafterCorpus(op="drop", op_id=7, name="docs", token_ids=[]))
    assert _results(v, d)[0].status == "unknown"


class CountingNgram(NgramProposer):
    """An n-gram proposer that counts its corpus operations."""

    def __init__(self) -> None:
        super().__init__()
        self.loads = 0

    def load_corpus(self, name, token_ids):
        self.loads += 1
        super().load_corpus(name, token_ids)


def test_the_same_load_from_two_verifiers_is_applied_once_and_answered_to_both():
    p = CountingNgram()
    (v0, v1), d = _setup(p, ("verifier-0", "verifier-1"))
    _load(v0, "docs", PASSAGE, op_id=9)
    _load(v1, "docs", PASSAGE, op_id=9)
    a, b = _results(v0, d)[0], _results(v1, d)[0]
    assert a == b and a.status == "applied" and p.loads == 1
    _load(v1, "docs", PASSAGE, op_id=9)  # again, once done: answered alike, not re-applied
    assert _results(v1, d)[0] == a and p.loads == 1


def test_an_older_operation_never_undoes_a_newer_one():
    """verifier-1 relays load 3 late, after verifier-0 relayed load 3 and drop 4: the corpus
    stays dropped and the late load is answered superseded."""
    (v0, v1), d = _setup(None, ("verifier-0", "verifier-1"))
    _load(v0, "docs", PASSAGE, op_id=3)
    assert _results(v0, d)[0].status == "applied"
    v0.send("drafter-0", DrafterCorpus(op="drop", op_id=4, name="docs", token_ids=[]))
    assert _results(v0, d)[0].status == "applied"
    _load(v1, "docs", PASSAGE, op_id=3)
    (late,) = _results(v1, d)
    assert late.status == "superseded" and "operation 4" in late.error
    assert d.proposer.corpora() == {}


def test_a_queued_load_overtaken_by_a_drop_is_not_applied():
    """Load 3 and drop 4 arrive before the load ran: the load is skipped (superseded)."""
    p = SlowNgram()
    (v,), d = _setup(p)
    _load(v, "other", [1, 2], op_id=1)  # holds the background thread
    d.step()
    assert p.started.wait(10)
    _load(v, "docs", PASSAGE, op_id=3)
    v.send("drafter-0", DrafterCorpus(op="drop", op_id=4, name="docs", token_ids=[]))
    d.step()
    p.release.set()
    got = _results(v, d, 3)
    assert [(r.name, r.op, r.status) for r in got] == [
        ("other", "load", "applied"), ("docs", "load", "superseded"), ("docs", "drop", "unknown")]
    assert p.corpora() == {"other": 2}


def test_chunks_out_of_order_are_refused_and_the_drafter_goes_on():
    (v,), d = _setup()
    v.send("drafter-0", DrafterCorpus(op="load", op_id=1, name="docs", token_ids=[1, 2],
                                      chunk_index=1, num_chunks=2))
    (res,) = _results(v, d)
    assert res.status == "error" and "chunk 1 of 2" in res.error and "chunk 0" in res.error
    v.send("drafter-0", DrafterCorpus(op="load", op_id=2, name="docs", token_ids=[1, 2],
                                      chunk_index=0, num_chunks=3))
    v.send("drafter-0", DrafterCorpus(op="load", op_id=2, name="docs", token_ids=[3, 4],
                                      chunk_index=2, num_chunks=3))
    (res,) = _results(v, d)
    assert res.status == "error" and "chunk 1 of 3" in res.error
    v.send_frames("drafter-0", [b"\xc1garbage"])  # a malformed message: counted
    d.step()
    assert d.stats.num_protocol_errors == 1 and d.proposer.corpora() == {}
    _load(v, "docs", PASSAGE, op_id=3)  # a whole load still works
    assert _results(v, d)[0].status == "applied"


class FailingNgram(NgramProposer):
    def load_corpus(self, name, token_ids):
        raise RuntimeError("disk on fire")


def test_a_failing_load_is_an_error_answer():
    (v,), d = _setup(FailingNgram())
    _load(v, "docs", PASSAGE, op_id=1)
    (res,) = _results(v, d)
    assert res.status == "error" and "disk on fire" in res.error


def test_a_method_without_corpora_answers_unsupported_and_clears_nothing():
    (v,), d = _setup(OracleProposer([], []))
    _load(v, "docs", PASSAGE, op_id=1)
    v.send("drafter-0", DrafterCorpus(op="drop", op_id=2, name="docs", token_ids=[]))
    v.send("drafter-0", DrafterCorpus(op="clear_history", op_id=3, name="", token_ids=[]))
    got = _results(v, d, 3)
    assert [(r.op, r.status) for r in got] == [("load", "unsupported"), ("drop", "unsupported"),
                                              ("clear_history", "applied")]
    assert "oracle-test" in got[0].error and "no cross-request memory" in got[0].error


class History(NgramProposer):
    def __init__(self) -> None:
        super().__init__()
        self.cleared = 0

    def clear_history(self):
        self.cleared += 1


def test_clear_history_reaches_the_proposer_once_per_operation():
    p = History()
    (v0, v1), d = _setup(p, ("verifier-0", "verifier-1"))
    for v in (v0, v1):
        v.send("drafter-0", DrafterCorpus(op="clear_history", op_id=11, name="",
                                          token_ids=[]))
    assert _results(v0, d)[0].status == _results(v1, d)[0].status == "applied"
    assert p.cleared == 1


class SlowNgram(NgramProposer):
    """Its load waits for ``release``: the corpus is still being indexed meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.started = threading.Event()

    def load_corpus(self, name, token_ids):
        self.started.set()
        assert self.release.wait(30)
        super().load_corpus(name, token_ids)


def test_drafting_never_waits_for_a_load():
    p = SlowNgram()
    (v,), d = _setup(p)
    _load(v, "docs", PASSAGE, op_id=1)
    d.step()
    assert p.started.wait(10)
    # the load is in progress: a request is drafted (in-context) all the same
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=[5, 6, 7, 5, 6],
                                  committed_token_ids=[7], sampling=SamplingParams()))
    t0 = time.monotonic()
    d.step()
    assert time.monotonic() - t0 < 5
    (seg,) = [e.msg for e in v.drain() if isinstance(e.msg, DraftTailStream)]
    assert seg.draft_token_ids == [5, 6, 7]
    assert not [e for e in v.drain() if isinstance(e.msg, DrafterCorpusResult)]
    p.release.set()
    assert _results(v, d)[0].status == "applied"


def test_a_malformed_operation_is_a_protocol_error_that_changes_nothing():
    """A DrafterCorpus header without token ids and with an empty name never reaches the
    loader: the drafter counts a protocol error and goes on."""
    (v,), d = _setup()
    v.send_frames("drafter-0", [b"\x84\xa3tag\x32\xa2op\xa4load\xa5op_id\x01\xa4name\xa0"])
    d.step()
    assert d.stats.num_protocol_errors == 1 and not d.corpus.held
    assert d.corpus.num_operations == 0
