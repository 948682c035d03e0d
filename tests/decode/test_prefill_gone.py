"""Issue 9 scenario 1: a prefill worker gone for good, restarted (a new incarnation, a new port)
or refusing our Hello can send no more frames for the transfers it held: a cancelled
transfer's blocks are freed without waiting for an acknowledgement nobody will send, a running
one is retried once on another prefill worker (or its request fails with a clear error), KV
usage returns to zero and new requests are admitted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specmesh.cluster.hosts.verifier import VerifierHost
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.engine.block_manager import BlockManager
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.runner import ModelRunner
from helpers.models import tiny_llama
from specmesh.prefill.config import PrefillConfig
from specmesh.prefill.worker import PrefillWorker
from specmesh.protocol.messages import Abort, GenerateRequest, SamplingParams, TokenStream

SP = SamplingParams(max_tokens=6)
BLOCKS = 32
PROMPTS = [[3, 4, 5, 6], [9, 8, 7], [11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def tiny():
    _, m, cfg = tiny_llama(seed=8, dtype=torch.float64, vocab_size=64)
    want = [r.token_ids for r in InProcessCluster(m, cfg, num_speculative_tokens=0,
                                                  num_kv_blocks=BLOCKS, block_size=4)
            .generate(PROMPTS, SP)]
    return m, cfg, want


def _cluster(m, cfg, second_prefill: bool, max_num_seqs: int = 1):
    c = InProcessCluster(m, cfg, num_speculative_tokens=2, num_kv_blocks=BLOCKS, block_size=4,
                         max_num_seqs=max_num_seqs)
    c.prefill_1 = None
    if second_prefill:
        cache = KVCache(cfg, BLOCKS, 4, m.dtype, m.device)
        c.prefill_1 = PrefillWorker(PrefillConfig(), c.hub.mailbox("prefill-1"),
                                    ModelRunner(m, cfg, cache), BlockManager(BLOCKS, 4))
        c.verifier.set_roster(["prefill-0", "prefill-1"], ["drafter-0"])
    return c


def _pump(c, results, n, dead=("prefill-0",)):
    for _ in range(n):
        c.drafter.step()
        if "prefill-0" not in dead:
            c.prefill.step()
        if c.prefill_1 is not None:
            c.prefill_1.step()
        c.verifier.step()
        for env in c.client.drain():
            if isinstance(env.msg, TokenStream):
                r = results.setdefault(env.msg.request_id, SimpleNamespace(tokens=[], final=None))
                r.tokens += env.msg.token_ids
                if env.msg.finished:
                    r.final = env.msg


def _submit(c, rid, prompt):
    c.client.send("verifier-0", GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                              sampling=SP))


def _kv_empty(c):
    return (c.verifier.block_manager.num_free_blocks == BLOCKS and not c.verifier.kv.transfers
            and not c.verifier.requests)


def _kill(c, how):
    """prefill-0 stops answering; the verifier learns it as ``how`` says."""
    v = c.verifier
    if how == "deregistered":
        v.set_roster(["prefill-1"] if c.prefill_1 else [], ["drafter-0"])
    elif how == "restarted":  # same name, a new incarnation (and port) in the roster
        host = VerifierHost.__new__(VerifierHost)  # its roster logic, no model or sockets
        host.worker, host.connect_only = v, lambda peers: None
        entry = lambda inc: {"instance_id": "prefill-0", "role": "prefill",  # noqa: E731
                             "endpoint": f"tcp://127.0.0.1:{inc}", "incarnation": inc}
        others = [{"instance_id": "prefill-1", "role": "prefill", "endpoint": "x",
                   "incarnation": 1}] if c.prefill_1 else []
        drafter = [{"instance_id": "drafter-0", "role": "drafter", "endpoint": "y",
                    "incarnation": 1}]
        VerifierHost.apply_roster(host, [entry(5001)] + others + drafter)
        VerifierHost.apply_roster(host, [entry(5002)] + others + drafter)
    elif how == "refused":  # no channel any more: every send to it fails
        c.prefill.mailbox.close()
    elif how == "disconnected":  # the transport lost the connection (killed; still in roster)
        v.peer_disconnected("prefill-0")
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["deregistered", "restarted", "refused", "disconnected"])
def test_cancelled_transfer_of_a_gone_prefill_frees_its_blocks(tiny, how):
    m, cfg, want = tiny
    c = _cluster(m, cfg, second_prefill=False)
    if how == "restarted":  # the roster's first entry of prefill-0
        c.verifier.prefill_peers = ["prefill-0"]
    results = {}
    _submit(c, "a", PROMPTS[0])
    _pump(c, results, 1)  # a is PREFILLING on prefill-0, which never answers
    assert c.verifier.requests["a"].transfer_id in c.verifier.kv.transfers
    if how == "refused":  # the PrefillCancel itself cannot be sent
        _kill(c, how)
    c.client.send("verifier-0", Abort(request_id="a"))
    _pump(c, results, 1)  # a is CANCELLING: its blocks wait for an ack
    assert results["a"].final.finish_reason == "abort"
    if how != "refused":
        _kill(c, how)
    _pump(c, results, 2)
    assert _kv_empty(c)  # no ack will ever come: the blocks are back


@pytest.mark.parametrize("how", ["deregistered", "restarted", "refused", "disconnected"])
def test_running_transfer_is_retried_on_another_prefill_worker(tiny, how):
    m, cfg, want = tiny
    c = _cluster(m, cfg, second_prefill=True, max_num_seqs=4)
    results = {}
    if how == "refused":  # the PrefillRequest itself cannot be sent
        _kill(c, how)
    for i, p in enumerate(PROMPTS):
        _submit(c, f"r{i}", p)
    _pump(c, results, 1)
    on_dead = [r for r in c.verifier.requests.values() if r.prefill_retries
               or r.prefill_peer == "prefill-0"]
    assert on_dead  # least loaded: some went to prefill-0
    if how != "refused":
        _kill(c, how)
    _pump(c, results, 40)
    for i in range(len(PROMPTS)):
        assert results[f"r{i}"].tokens == want[i], results[f"r{i}"].final
        assert results[f"r{i}"].final.finish_reason == "length"
    assert _kv_empty(c)
    assert all(r.prefill_retries <= 1 for r in on_dead)


@pytest.mark.parametrize("how", ["deregistered", "restarted", "refused", "disconnected"])
def test_without_another_prefill_worker_the_request_fails_clearly(tiny, how):
    m, cfg, want = tiny
    c = _cluster(m, cfg, second_prefill=False)
    if how == "restarted":
        c.verifier.prefill_peers = ["prefill-0"]
    results = {}
    if how == "refused":
        _kill(c, how)
    _submit(c, "a", PROMPTS[0])
    _pump(c, results, 1)
    if how != "refused":
        _kill(c, how)
    _pump(c, results, 3)
    final = results["a"].final
    assert final is not None and final.finish_reason == "error"
    assert "prefill-0" in final.error
    assert _kv_empty(c)


def test_a_cancel_never_acknowledged_frees_the_blocks_after_the_bound(tiny):
    """The prefill worker is in the roster but silent (hung): the cancel acknowledgement has a
    bound too (``prefill_timeout_s``)."""
    m, cfg, _ = tiny
    c = InProcessCluster(m, cfg, num_speculative_tokens=0, num_kv_blocks=BLOCKS, block_size=4,
                         prefill_timeout_s=0.2)
    c.prefill_1 = None
    results = {}
    _submit(c, "a", PROMPTS[0])
    _pump(c, results, 1)
    c.client.send("verifier-0", Abort(request_id="a"))
    _pump(c, results, 1)
    assert not _kv_empty(c)  # waiting for the ack
    import time

    time.sleep(0.3)
    _pump(c, results, 2)
    assert _kv_empty(c)
    assert c.verifier.kv.stats.num_orphaned == 1


def test_a_prefill_worker_whose_connection_dropped_gets_transfers_again_once_back(tiny):
    """After its connection dropped, a prefill worker gets no new transfer; when it says
    Hello again (the same process, reconnected) the waiting request is admitted there."""
    m, cfg, want = tiny
    c = _cluster(m, cfg, second_prefill=False)
    c.verifier.peer_disconnected("prefill-0")
    results = {}
    _submit(c, "a", PROMPTS[0])
    _pump(c, results, 2, dead=())
    assert c.verifier.requests["a"].status.name == "WAITING"  # nowhere to prefill it
    c.verifier.prefill_back("prefill-0")
    _pump(c, results, 20, dead=())
    assert results["a"].tokens == want[0] and results["a"].final.finish_reason == "length"
    assert _kv_empty(c)
