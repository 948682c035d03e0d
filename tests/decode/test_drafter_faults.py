"""Issue 9 scenarios 2 and 5: a drafter gone for good, silent, not draining its messages, or
dropping a request's state must never make the verifier wait for that request's tails, block
its loop or change its output: the drafter tells the verifier (DraftNeedSync / DraftClose), a
silent drafter is not waited for after ``drafter_silence_s``, a failed send puts its requests
on plain decode, and they are re-synced with DraftSync when the drafter is back."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from specmesh.cluster.inprocess import InProcessCluster
from specmesh.drafter.config import DrafterConfig
from specmesh.drafter.worker import DrafterWorker
from helpers.models import tiny_llama
from helpers.proposers import OracleProposer
from specmesh.protocol.messages import GenerateRequest, SamplingParams, TokenStream
from specmesh.protocol.transport import PeerUnavailable
from specmesh.protocol.zmq_transport import ZmqMailbox

PROMPTS = [[5, 6, 7, 8], [9, 9, 9, 9], [12, 13, 14]]
MAX_TOKENS = 24
SP = SamplingParams(max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def tiny():
    _, m, cfg = tiny_llama(seed=4, dtype=torch.float64, vocab_size=64)
    ref = InProcessCluster(m, cfg, num_speculative_tokens=0, num_kv_blocks=64, block_size=4)
    want = [r.token_ids for r in ref.generate(PROMPTS, SP)]
    return m, cfg, want


def _cluster(tiny, **kw):
    m, cfg, want = tiny
    return InProcessCluster(m, cfg, num_speculative_tokens=3, num_kv_blocks=64, block_size=4,
                            proposer=OracleProposer(PROMPTS, want), adaptive_drafts=False,
                            **kw)


def _submit(c):
    for i, p in enumerate(PROMPTS):
        c.client.send("verifier-0", GenerateRequest(request_id=f"r{i}", prompt_token_ids=p,
                                                  sampling=SP))


def _pump(c, out, n=1, drafter=True):
    for _ in range(n):
        if drafter:
            c.drafter.step()
        c.prefill.step()
        c.verifier.step()
        for env in c.client.drain():
            if isinstance(env.msg, TokenStream):
                out.setdefault(env.msg.request_id, []).extend(env.msg.token_ids)


def _done(c, out):
    return not c.verifier.requests and len(out) == len(PROMPTS)


# -- scenario 5: the drafter tells the verifier when it drops a request -------------------


def test_a_full_drafter_closes_the_request_and_the_verifier_runs_it_plain(tiny):
    c = _cluster(tiny)
    c.drafter.config = DrafterConfig(method="ngram", window=4, max_segment=4, max_requests=1)
    out = {}
    _submit(c)
    for _ in range(200):
        _pump(c, out)
        if c.verifier.stats.num_drafter_closes == 2:
            break
    running = [r for r in c.verifier.requests.values() if r.drafter is None]
    assert c.verifier.stats.num_drafter_closes == 2 and len(running) == 2
    assert not any(r.tail_in_flight for r in running)  # nothing is waited for
    for _ in range(200):
        if _done(c, out):
            break
        _pump(c, out)
    assert [out[f"r{i}"] for i in range(3)] == tiny[2]
    assert c.verifier.stats.num_accepted_tokens > 0  # the one the drafter kept


def test_a_commit_for_a_request_the_drafter_lost_is_answered_and_re_synced(tiny):
    c = _cluster(tiny)
    out = {}
    _submit(c)
    _pump(c, out, 4)
    assert "r0" in c.drafter.requests
    c.drafter._drop("r0")  # the drafter lost the state (a restart of its proposer, a bug...)
    _pump(c, out, 3)
    assert c.drafter.stats.num_need_sync >= 1
    assert "r0" in c.drafter.requests  # re-synced by the verifier's DraftSync
    before = c.verifier.stats.num_accepted_tokens
    for _ in range(200):
        if _done(c, out):
            break
        _pump(c, out)
    assert [out[f"r{i}"] for i in range(3)] == tiny[2]
    assert c.verifier.stats.num_accepted_tokens > before


def test_a_protocol_error_at_the_drafter_is_answered_with_need_sync(tiny):
    import msgspec

    from specmesh.protocol.codec import encode
    from specmesh.protocol.messages import VerifyCommit

    c = _cluster(tiny)
    out = {}
    _submit(c)
    _pump(c, out, 4)
    frames = encode(VerifyCommit(request_id="r1", pre_commit_len=1, committed_token_ids=[1]))
    body = msgspec.msgpack.decode(frames[0])
    body["pre_commit_len"] = "not an int"
    c.verifier.mailbox.send_frames("drafter-0", [msgspec.msgpack.encode(body)])
    c.drafter.step()
    assert c.drafter.stats.num_protocol_errors == 1
    assert "r1" not in c.drafter.requests and c.drafter.stats.num_need_sync == 1
    for _ in range(200):
        if _done(c, out):
            break
        _pump(c, out)
    assert [out[f"r{i}"] for i in range(3)] == tiny[2]


# -- scenario 2: a drafter gone, silent or not draining ----------------------------------


def test_a_silent_drafter_is_not_waited_for_after_the_bound(tiny):
    import dataclasses

    c = _cluster(tiny, drafter_silence_s=0.3)
    cfg = dataclasses.replace(c.verifier.config, tail_wait_fraction=20.0)
    c.verifier.config = c.verifier.scheduler.config = cfg
    out = {}
    _submit(c)
    _pump(c, out, 3)
    c.verifier.scheduler.step_time_ema_s = 0.02  # a budget of 0.4 s per step
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.5:  # the drafter stops answering
        _pump(c, out, drafter=False)
    waits = c.verifier.stats.num_tail_waits
    assert waits >= 1
    _pump(c, out, 5, drafter=False)
    # no per-step wait any more: a step that waits for a tail counts it before it blocks
    # (VerifierWorker._wait_for_tails), so the count, not a clock, shows there was none
    assert c.verifier.stats.num_tail_waits == waits
    _pump(c, out, 1)  # heard from again: waited for again (it answers at once)
    for _ in range(200):
        if _done(c, out):
            break
        _pump(c, out)
    assert [out[f"r{i}"] for i in range(3)] == tiny[2]


def test_a_gone_drafter_puts_its_requests_on_plain_decode_and_they_resync_on_its_return(
        tiny):
    m, cfg, want = tiny
    c = _cluster(tiny)
    out = {}
    _submit(c)
    _pump(c, out, 4)
    c.drafter.mailbox.close()  # gone: every send to it fails
    _pump(c, out, 4, drafter=False)
    assert c.verifier.stats.num_drafters_lost >= 1
    assert all(r.drafter is None and not r.tail_in_flight for r in c.verifier.requests.values())
    before = c.verifier.stats.num_accepted_tokens
    # back (Ray restarted it): a new incarnation says Hello, the host calls resync_drafter
    c.drafter = DrafterWorker(DrafterConfig(method="ngram", window=4, max_segment=4),
                              c.hub.mailbox("drafter-0"), OracleProposer(PROMPTS, want))
    c.verifier.resync_drafter("drafter-0")
    assert all(r.drafter == "drafter-0" for r in c.verifier.requests.values()), [
        (r.request_id, r.status, r.drafter, r.lost_drafter) for r in c.verifier.requests.values()]
    for _ in range(200):
        if _done(c, out):
            break
        _pump(c, out)
    assert [out[f"r{i}"] for i in range(3)] == want
    assert c.verifier.stats.num_accepted_tokens > before


def test_a_send_to_a_peer_that_is_not_draining_fails_instead_of_blocking():
    nobody = ZmqMailbox("nobody", "drafter")
    endpoint = nobody.endpoint
    nobody.close()  # nothing listens there any more: messages queue up to the mark
    mb = ZmqMailbox("verifier-0", "verifier", hwm=10)
    result = {}

    def flood():
        try:
            for _ in range(1000):
                mb.send("drafter-0", GenerateRequest(request_id="x", prompt_token_ids=[1],
                                                     sampling=SP))
        except PeerUnavailable as err:
            result["err"] = err

    try:
        mb.connect("drafter-0", endpoint)
        t = threading.Thread(target=flood, daemon=True)
        t.start()
        t.join(5)
        assert not t.is_alive(), "send blocked the sending thread"
        assert "not draining" in str(result["err"])
    finally:
        mb.close()


def test_running_requests_without_a_drafter_are_opened_on_one_that_joins(tiny):
    """Every drafter left the roster (their requests run plain); a drafter that joins later
    (a restart that re-registered, or ``specmesh launch drafter``) gets DraftSync for the
    running requests, which accept drafts again; the output is unchanged."""
    m, cfg, want = tiny
    c = _cluster(tiny)
    out = {}
    _submit(c)
    _pump(c, out, 3)
    prefill = list(c.verifier.prefill_peers)
    c.verifier.set_roster(prefill, [])  # the only drafter left the roster
    running = [r for r in c.verifier.requests.values() if r.status.name == "RUNNING"]
    assert running and all(r.drafter is None for r in running)
    syncs = {r.request_id: r.num_draft_syncs for r in running}
    _pump(c, out, 2, drafter=False)
    before = sum(r.spec.num_accepted_tokens for r in c.verifier.requests.values())
    c.verifier.set_roster(prefill, ["drafter-0"])  # it is back / a new one joined
    for r in c.verifier.requests.values():
        if r.request_id in syncs:
            assert r.drafter == "drafter-0" and r.num_draft_syncs == syncs[r.request_id] + 1
    accepted = dict.fromkeys(syncs, 0)
    for _ in range(200):
        for r in c.verifier.requests.values():
            if r.request_id in accepted:
                accepted[r.request_id] = r.spec.num_accepted_tokens
        if _done(c, out):
            break
        _pump(c, out)
    assert [out[f"r{i}"] for i in range(3)] == want
    assert sum(accepted.values()) > before


def test_a_drafter_whose_connection_drops_is_lost_after_the_grace_and_back_on_its_hello(tiny):
    """The transport reports the drafter's connection down: within ``drafter_lost_grace_s``
    nothing changes; after it the requests run plain (no tail owed) and, when the same
    drafter acknowledges Hello again, they are re-synced there and accept drafts again."""
    m, cfg, want = tiny
    patient = _cluster(tiny, drafter_lost_grace_s=60.0)
    out = {}
    _submit(patient)
    _pump(patient, out, 3)
    patient.verifier.peer_disconnected("drafter-0")
    _pump(patient, out, 2)
    assert patient.verifier.stats.num_drafters_lost == 0
    assert all(r.drafter == "drafter-0" for r in patient.verifier.requests.values()
               if r.status.name == "RUNNING")

    c = _cluster(tiny, drafter_lost_grace_s=0.0)
    out = {}
    _submit(c)
    _pump(c, out, 3)
    c.verifier.peer_disconnected("drafter-0")
    _pump(c, out, 2, drafter=False)
    running = [r for r in c.verifier.requests.values() if r.status.name == "RUNNING"]
    assert running and c.verifier.stats.num_drafters_lost == 1
    assert all(r.drafter is None and r.lost_drafter == "drafter-0" and not r.tail_in_flight
               for r in running)
    syncs = {r.request_id: r.num_draft_syncs for r in running}
    before = sum(r.spec.num_accepted_tokens for r in running)
    c.verifier.drafter_back("drafter-0")
    assert all(r.drafter == "drafter-0" and r.num_draft_syncs == syncs[r.request_id] + 1
               for r in running)
    accepted = {}
    for _ in range(200):
        for r in running:
            accepted[r.request_id] = r.spec.num_accepted_tokens
        if _done(c, out):
            break
        _pump(c, out)
    assert [out[f"r{i}"] for i in range(3)] == want
    assert sum(accepted.values()) > before


def test_a_lost_drafters_requests_are_re_opened_on_another_drafter(tiny):
    """With a second drafter in the roster, a lost drafter's running requests get DraftSync
    there at once (not plain decode until the health check deregisters the first)."""
    from specmesh.protocol.messages import DraftSync

    c = _cluster(tiny)
    other = c.hub.mailbox("drafter-1")
    out = {}
    _submit(c)
    _pump(c, out, 3)
    running = [r for r in c.verifier.requests.values() if r.status.name == "RUNNING"]
    assert running and all(r.drafter == "drafter-0" for r in running)
    c.verifier.set_roster(list(c.verifier.prefill_peers), ["drafter-0", "drafter-1"])
    syncs = {r.request_id: r.num_draft_syncs for r in running}
    c.verifier.lifecycle.lose_drafter("drafter-0")
    assert all(r.drafter == "drafter-1" and r.lost_drafter is None
               and r.num_draft_syncs == syncs[r.request_id] + 1 for r in running)
    got = [e.msg for e in other.drain() if isinstance(e.msg, DraftSync)]
    assert sorted(m.request_id for m in got) == sorted(syncs)
    for m in got:  # the committed prefix is the truth the new drafter aligns to
        assert m.committed_token_ids == c.verifier.requests[m.request_id].output_token_ids
