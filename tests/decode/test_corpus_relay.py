"""The verifier relays corpus operations (decode/corpus_relay.py): every drafter gets each
chunk, the gateway learns who got an operation and gets every drafter's answer, a drafter that
joins later gets the corpora held, chunks out of order are refused; and through the in-process
workers on a tiny model, a corpus posted between two runs of a prompt turns no accepted drafts
into accepted ones, with the output of plain decode both times."""

from __future__ import annotations

import time

import pytest
import torch
from helpers.models import tiny_llama

from specmesh.cluster.inprocess import VERIFIER, InProcessCluster
from specmesh.decode.corpus_relay import CorpusRelay
from specmesh.protocol.messages import (
    DrafterCorpus,
    DrafterCorpusRelayed,
    DrafterCorpusResult,
    SamplingParams,
)


class Wire:
    """A fake send: records (peer, message); peers in ``down`` fail."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []
        self.down: set[str] = set()

    def __call__(self, peer: str, msg: object) -> bool:
        if peer in self.down:
            return False
        self.sent.append((peer, msg))
        return True

    def take(self) -> list[tuple[str, object]]:
        out, self.sent = self.sent, []
        return out


def _chunks(name, tokens, op_id, size=2):
    parts = [tokens[i:i + size] for i in range(0, len(tokens), size)]
    return [DrafterCorpus(op="load", op_id=op_id, name=name, token_ids=p, chunk_index=i,
                          num_chunks=len(parts)) for i, p in enumerate(parts)]


def test_a_load_goes_to_every_drafter_and_the_gateway_hears_who_got_it():
    wire, drafters = Wire(), ["drafter-0", "drafter-1"]
    relay = CorpusRelay(wire, lambda: drafters)
    chunks = _chunks("docs", [1, 2, 3, 4, 5], op_id=8)
    wire.down.add("drafter-1")  # unreachable: not reported as having it
    for c in chunks:
        relay.on_operation("gateway-0", c)
    sent = wire.take()
    assert [m for p, m in sent if p == "drafter-0"] == chunks
    (report,) = [m for p, m in sent if p == "gateway-0"]
    assert report == DrafterCorpusRelayed(op="load", op_id=8, name="docs",
                                          drafters=["drafter-0"])
    assert set(relay.corpora) == {"docs"} and relay.num_relayed == 1
    # answers go back to the gateway of the operation; unknown operations are dropped
    ok = DrafterCorpusResult(op="load", op_id=8, name="docs", drafter="drafter-0",
                             status="applied", num_tokens=5)
    assert relay.on_result("drafter-0", ok) and wire.take() == [("gateway-0", ok)]
    stray = DrafterCorpusResult(op="load", op_id=99, name="x", drafter="drafter-0",
                                status="applied")
    assert not relay.on_result("drafter-0", stray) and not wire.take()


def test_a_drafter_that_joins_later_gets_the_corpora_held_and_loads_in_flight():
    wire, drafters = Wire(), ["drafter-0"]
    relay = CorpusRelay(wire, lambda: drafters)
    for c in _chunks("docs", [1, 2, 3], op_id=1):
        relay.on_operation("gateway-0", c)
    coming = _chunks("more", [4, 5, 6, 7], op_id=2)
    relay.on_operation("gateway-0", coming[0])
    wire.take()
    drafters.append("drafter-1")
    relay.drafter_joined("drafter-1")
    assert [m for _, m in wire.take()] == _chunks("docs", [1, 2, 3], op_id=1) + coming[:1]
    relay.on_operation("gateway-0", coming[1])
    sent = wire.take()
    assert {p for p, m in sent if m == coming[1]} == {"drafter-0", "drafter-1"}
    (report,) = [m for p, m in sent if isinstance(m, DrafterCorpusRelayed)]
    assert report.drafters == ["drafter-0", "drafter-1"]


def test_a_drop_forgets_the_corpus_and_is_relayed_clear_history_too():
    wire, drafters = Wire(), ["drafter-0"]
    relay = CorpusRelay(wire, lambda: drafters)
    for c in _chunks("docs", [1, 2, 3], op_id=1):
        relay.on_operation("gateway-0", c)
    wire.take()
    drop = DrafterCorpus(op="drop", op_id=2, name="docs", token_ids=[])
    clear = DrafterCorpus(op="clear_history", op_id=3, name="", token_ids=[])
    relay.on_operation("gateway-0", drop)
    relay.on_operation("gateway-1", clear)
    assert wire.take() == [
        ("drafter-0", drop), ("gateway-0", DrafterCorpusRelayed(
            op="drop", op_id=2, name="docs", drafters=["drafter-0"])),
        ("drafter-0", clear), ("gateway-1", DrafterCorpusRelayed(
            op="clear_history", op_id=3, name="", drafters=["drafter-0"]))]
    assert relay.corpora == {}
    relay.drafter_joined("drafter-9")
    assert wire.take() == []
    # an older drop does not forget a newer load
    for c in _chunks("docs", [1, 2], op_id=10):
        relay.on_operation("gateway-0", c)
    relay.on_operation("gateway-0", DrafterCorpus(op="drop", op_id=9, name="docs",
                                                  token_ids=[]))
    assert set(relay.corpora) == {"docs"}


def test_chunks_out_of_order_are_refused_and_not_relayed():
    wire = Wire()
    relay = CorpusRelay(wire, lambda: ["drafter-0"])
    chunks = _chunks("docs", [1, 2, 3, 4, 5], op_id=4)
    relay.on_operation("gateway-0", chunks[0])
    relay.on_operation("gateway-0", chunks[2])
    relay.on_operation("gateway-0", chunks[1])
    sent = wire.take()
    assert [m for p, m in sent if p == "drafter-0"] == chunks[:1]
    reports = [m for p, m in sent if p == "gateway-0"]
    assert len(reports) == 2 and all(r.drafters == [] for r in reports)
    assert "chunk 2 of 3 of load 4 came where chunk 1 of 3 was due" in reports[0].error
    assert "chunk 0" in reports[1].error and relay.corpora == {}


# ------------------------------------------------------------------------------------------
# Through the in-process workers (gateway mailbox -> verifier -> drafter and back)
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    _, m, cfg = tiny_llama(seed=5, dtype=torch.float64, vocab_size=96)
    return m, cfg


def _run_op(c: InProcessCluster, msgs: list[DrafterCorpus], timeout_s: float = 20.0):
    """Send ``msgs`` from the gateway's mailbox and step the workers until the drafter's
    answer to the last one is back; returns (relay reports, results)."""
    for m in msgs:
        c.client.send(VERIFIER, m)
    reports, results = [], []
    deadline = time.monotonic() + timeout_s
    while not any(r.op_id == msgs[-1].op_id for r in results):
        assert time.monotonic() < deadline, (reports, results)
        c.verifier.step()
        c.drafter.step(0.01)
        for env in c.client.drain():
            if isinstance(env.msg, DrafterCorpusRelayed):
                reports.append(env.msg)
            elif isinstance(env.msg, DrafterCorpusResult):
                results.append(env.msg)
    return reports, results


def test_operations_reach_the_drafter_and_answers_come_back(model):
    m, cfg = model
    c = InProcessCluster(m, cfg, num_speculative_tokens=3, num_kv_blocks=32, block_size=4)
    reports, results = _run_op(c, _chunks("docs", [5, 6, 7, 8, 9], op_id=1))
    assert [r.drafters for r in reports] == [["drafter-0"]]
    assert [(r.drafter, r.status, r.num_tokens) for r in results] == [("drafter-0", "applied",
                                                                      5)]
    assert c.drafter.proposer.corpora() == {"docs": 5}
    # the verifier takes corpus operations from gateways only, answers from drafters only
    c.drafter.mailbox.send(VERIFIER, DrafterCorpus(op="drop", op_id=2, name="docs",
                                                   token_ids=[]))
    c.client.send(VERIFIER, results[0])
    before = c.verifier.stats.num_ignored_messages
    c.verifier.step()
    assert c.verifier.stats.num_ignored_messages == before + 2
    assert c.drafter.proposer.corpora() == {"docs": 5}
    _, results = _run_op(c, [DrafterCorpus(op="drop", op_id=3, name="docs", token_ids=[])])
    assert results[-1].status == "applied" and c.drafter.proposer.corpora() == {}


def test_a_corpus_posted_between_two_runs_makes_drafts_accepted(model):
    """Issue 32's must-show, in process: the corpus is the prompt's plain greedy output,
    which the prompt does not contain (its n-grams never repeat: the n-gram drafter has
    nothing to draft from the context). Before the corpus no draft is accepted; after it
    some are; the output is plain decode's both times."""
    m, cfg = model
    sp = SamplingParams(max_tokens=24)
    plain = InProcessCluster(m, cfg, num_speculative_tokens=0, num_kv_blocks=64, block_size=4)
    prompt, want = _prompt_without_repeats(plain, sp)
    c = InProcessCluster(m, cfg, num_speculative_tokens=3, num_kv_blocks=64, block_size=4)
    (before,) = c.generate([prompt], sp)
    assert before.token_ids == want and before.spec.num_accepted_tokens == 0
    _run_op(c, _chunks("answer", want, op_id=1, size=5))
    (after,) = c.generate([prompt], sp)
    assert after.token_ids == want
    assert after.spec.num_accepted_tokens > 0
    assert c.drafter.proposer.num_corpus_draft_tokens > 0


def _prompt_without_repeats(plain: InProcessCluster, sp: SamplingParams):
    """A prompt whose prompt + plain greedy output has no repeated bigram (so in-context
    n-gram lookup drafts nothing), and that output."""
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(3, 96, (6,), generator=g).tolist()
        (out,) = plain.generate([prompt], sp)
        seq = prompt + out.token_ids
        bigrams = list(zip(seq, seq[1:]))
        if len(out.token_ids) == sp.max_tokens and len(set(bigrams)) == len(bigrams):
            return prompt, out.token_ids
    raise AssertionError("no prompt without repeated bigrams in 200 tries")
