"""Issue 9 scenario 6: transfers are keyed by (verifier instance, incarnation, counter) and
matched by sender. With two verifiers, one's PrefillCancel of transfer 5 does not drop the
other's transfer 5; after a verifier restart the prefill's backlog for the old incarnation is
dropped, and the new incarnation's transfer ids never collide with the old ones."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from specmesh.cluster.hosts.prefill import PrefillHost
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.decode.config import VerifierConfig
from specmesh.decode.worker import VerifierWorker
from specmesh.engine.block_manager import BlockManager
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.runner import ModelRunner
from helpers.models import tiny_llama
from specmesh.protocol.messages import (
    GenerateRequest,
    PrefillCancel,
    PrefillCancelAck,
    PrefillDone,
    PrefillRequest,
    SamplingParams,
    TokenStream,
)
from specmesh.protocol.zmq_transport import ZmqMailbox

SP = SamplingParams(max_tokens=6)


@pytest.fixture(scope="module")
def tiny():
    _, m, cfg = tiny_llama(seed=6, dtype=torch.float64, vocab_size=64)
    return m, cfg


def _request(tid: int, rid: str = "r") -> PrefillRequest:
    return PrefillRequest(request_id=rid, transfer_id=tid, prompt_token_ids=[3, 4, 5],
                          sampling=SP, block_table=[0, 1])


def test_a_cancel_from_one_verifier_does_not_drop_the_other_verifiers_transfer(tiny):
    c = InProcessCluster(*tiny, num_kv_blocks=16, block_size=4)
    v0, v1 = c.verifier.mailbox, c.hub.mailbox("verifier-1")
    v0.send("prefill-0", _request(5, "a"))
    v1.send("prefill-0", _request(5, "b"))
    v1.send("prefill-0", PrefillCancel(request_id="b", transfer_id=5))
    for _ in range(3):
        c.prefill.step()
    got0 = [e.msg for e in v0.drain()]
    got1 = [e.msg for e in v1.drain()]
    (done,) = [m for m in got0 if isinstance(m, PrefillDone)]
    assert done.request_id == "a" and done.transfer_id == 5 and not done.error
    assert [type(m) for m in got1] == [PrefillCancelAck]


def test_restarted_verifier_gets_nothing_of_its_previous_lifes_backlog(tiny):
    """Over ZMQ: the prefill host drops the backlog of a verifier incarnation that said Hello
    again as a new one."""
    c = InProcessCluster(*tiny, num_kv_blocks=16, block_size=4)
    worker = c.prefill
    host = SimpleNamespace(worker=worker)
    mb = ZmqMailbox("prefill-0", "prefill",
                    on_hello=lambda info, new: PrefillHost.on_hello(host, info, new))
    worker.mailbox = mb
    old = ZmqMailbox("verifier-0", "verifier", incarnation=1)
    new = None
    try:
        old.connect("prefill-0", mb.endpoint)
        for tid in (1, 2, 3):
            old.send("prefill-0", _request(tid, f"old-{tid}"))
        deadline = time.monotonic() + 10
        while len(worker.queue) < 3 and time.monotonic() < deadline:
            worker.ingest(0.05)  # queued, not run yet
            old.recv(0.0)
        assert len(worker.queue) == 3
        old.close()
        new = ZmqMailbox("verifier-0", "verifier", incarnation=2)
        new.connect("prefill-0", mb.endpoint)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
                "verifier-0" not in mb.accepted or mb.accepted["verifier-0"].incarnation != 2):
            worker.ingest(0.05)  # the new incarnation's Hello (frames the prefill sends
            new.recv(0.0)  # before it arrives carry ids the new incarnation never issued)
        assert not worker.queue  # the old life's backlog is gone
        new.send("prefill-0", _request(1_000_001, "new"))
        got: list = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(
                isinstance(m, PrefillDone) and m.request_id == "new" for m in got):
            worker.step(0.02)
            env = new.recv(0.02)
            while env is not None:
                got.append(env.msg)
                env = new.recv(0.0)
        worker.step(0.05)
        env = new.recv(0.2)
        while env is not None:
            got.append(env.msg)
            env = new.recv(0.0)
        assert {m.request_id for m in got if hasattr(m, "transfer_id")} == {"new"}
        assert worker.stats.num_dropped_backlog == 3
    finally:
        mb.close()
        if new is not None:
            new.close()
        old.close()


def test_a_restarted_verifiers_transfer_ids_never_collide_with_its_previous_lifes(tiny):
    """In-process: the prefill still runs the old incarnation's request (no Hello here to drop
    it); its frames reach the new incarnation, which must not take them for its own transfer."""
    m, cfg = tiny
    c = InProcessCluster(m, cfg, num_speculative_tokens=0, num_kv_blocks=32, block_size=4,
                         incarnation=1_000)
    (want,) = InProcessCluster(m, cfg, num_speculative_tokens=0, num_kv_blocks=32,
                               block_size=4).generate([[7, 8, 9, 10]], SP)
    c.client.send("verifier-0", GenerateRequest(request_id="old", prompt_token_ids=[3, 4, 5],
                                              sampling=SP))
    c.verifier.step()  # PrefillRequest of "old" is queued at the prefill worker
    c.verifier.mailbox.close()  # the verifier dies
    cache = KVCache(cfg, 32, 4, m.dtype, m.device)
    c.verifier = VerifierWorker(
        VerifierConfig(num_speculative_tokens=0, max_model_len=128, tail_wait_fraction=0.0,
                       incarnation=2_000),
        c.hub.mailbox("verifier-0"), ModelRunner(m, cfg, cache), BlockManager(32, 4),
        prefill_peers=["prefill-0"], drafter_peers=["drafter-0"])
    (got,) = c.generate([[7, 8, 9, 10]], SP)
    assert got.token_ids == want.token_ids and got.finish_reason == "length"
    assert c.verifier.kv.stats.num_late_frames > 0  # the old life's frames, dropped
    assert c.verifier.stats.num_protocol_errors == 0


def test_frames_naming_another_peers_transfer_do_not_fail_it(tiny):
    c = InProcessCluster(*tiny, num_speculative_tokens=0, num_kv_blocks=32, block_size=4)
    (want,) = InProcessCluster(*tiny, num_speculative_tokens=0, num_kv_blocks=32,
                               block_size=4).generate([[3, 4, 5]], SP)
    rogue = c.hub.mailbox("prefill-9")
    c.client.send("verifier-0", GenerateRequest(request_id="r", prompt_token_ids=[3, 4, 5],
                                              sampling=SP))
    c.verifier.step()
    tid = c.verifier.requests["r"].transfer_id
    rogue.send("verifier-0", PrefillDone(request_id="r", transfer_id=tid, first_token_id=1,
                                         num_frames=0, num_bytes=0, error="boom"))
    c.verifier.step()
    out = []
    for _ in range(20):
        c.prefill.step()
        c.verifier.step()
        out += [e.msg for e in c.client.drain() if isinstance(e.msg, TokenStream)]
    assert [t for s in out for t in s.token_ids] == want.token_ids
    assert out[-1].finish_reason == "length"
    assert c.verifier.stats.num_protocol_errors == 1
