"""KV transfer ordering and cancellation on the verifier (docs/architecture.md, 'KV transfer'):
PrefillDone
before or after its frames, and late frames of a cancelled transfer after its blocks were
freed and reused must not corrupt other requests."""

import msgspec
import pytest
import torch

from specmesh.cluster.inprocess import InProcessCluster
from helpers.models import hf_greedy, tiny_llama
from specmesh.protocol.messages import Abort, GenerateRequest, KVFrame, PrefillDone, SamplingParams
from specmesh.protocol.messages import TokenStream
from specmesh.protocol.transport import Mailbox

MAX_TOKENS = 12


class HoldingMailbox(Mailbox):
    """Wraps the prefill worker's mailbox: outgoing KV messages are held until released."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.held = []
        self.hold = True

    def send(self, peer, msg):
        if self.hold and isinstance(msg, (KVFrame, PrefillDone)):
            self.held.append((peer, msg))
        else:
            self.inner.send(peer, msg)

    def recv(self, timeout_s=0.0):
        return self.inner.recv(timeout_s)

    def release(self, pick=lambda m: True, done_first=False):
        out = [(p, m) for p, m in self.held if pick(m)]
        self.held = [(p, m) for p, m in self.held if not pick(m)]
        if done_first:
            out.sort(key=lambda pm: not isinstance(pm[1], PrefillDone))
        for p, m in out:
            self.inner.send(p, m)


@pytest.fixture(scope="module")
def tiny():
    hf, model, cfg = tiny_llama(seed=2, dtype=torch.float64, vocab_size=80)
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 20, 21], [30] * 14]
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return model, cfg, prompts, refs


def _cluster(model, cfg, num_kv_blocks=64):
    c = InProcessCluster(model, cfg, num_speculative_tokens=3, num_kv_blocks=num_kv_blocks,
                         block_size=4)
    c.prefill.mailbox = HoldingMailbox(c.prefill.mailbox)
    c.prefill.config = type(c.prefill.config)(frame_tokens=3, frame_layers=1)  # many frames
    return c


def _pump(c, results, n=1):
    for _ in range(n):
        c.drafter.step()
        c.prefill.step()
        c.verifier.step()
        for env in c.client.drain():
            if isinstance(env.msg, TokenStream):
                r = results.setdefault(env.msg.request_id, {"tokens": [], "finish": None})
                r["tokens"] += env.msg.token_ids
                if env.msg.finished:
                    r["finish"] = env.msg.finish_reason


def _submit(c, rid, prompt):
    c.client.send("verifier-0", GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                              sampling=SamplingParams(max_tokens=MAX_TOKENS)))


@pytest.mark.parametrize("done_first", [True, False])
def test_done_and_frames_in_either_order(tiny, done_first):
    model, cfg, prompts, refs = tiny
    c = _cluster(model, cfg)
    results = {}
    for i, p in enumerate(prompts):
        _submit(c, f"r{i}", p)
    _pump(c, results, 3)
    assert len(c.prefill.mailbox.held) > len(prompts)  # frames + done of every request
    c.prefill.mailbox.hold = False
    c.prefill.mailbox.release(done_first=done_first)
    for _ in range(100):
        _pump(c, results)
        if all(r["finish"] for r in results.values()) and len(results) == len(prompts):
            break
    for i, ref in enumerate(refs):
        assert results[f"r{i}"]["tokens"] == ref
    assert c.verifier.kv.stats.num_late_frames == 0


def test_cancelled_transfer_late_frames_do_not_corrupt_reused_blocks(tiny):
    model, cfg, prompts, refs = tiny
    # room for exactly one request at a time: B must reuse A's blocks
    need = -(-(len(prompts[2]) + MAX_TOKENS) // 4)
    c = _cluster(model, cfg, num_kv_blocks=need)
    results = {}
    _submit(c, "A", prompts[2])
    _pump(c, results, 2)  # A prefilled; its KV is held back
    a_blocks = list(c.verifier.requests["A"].block_table)
    c.client.send("verifier-0", Abort(request_id="A", reason="client disconnected"))
    _submit(c, "B", prompts[2])
    _pump(c, results, 1)  # verifier: abort A -> PrefillCancel; B must wait for the ack
    assert "B" in c.verifier.requests and c.verifier.requests["B"].block_table == []
    _pump(c, results, 2)  # prefill acks the cancel; B admitted into A's blocks; B prefilled
    assert results["A"]["finish"] == "abort"
    b = c.verifier.requests["B"]
    assert set(b.block_table) & set(a_blocks)
    # deliver B's KV, then A's late frames (garbage for B, if they landed)
    c.prefill.mailbox.release(pick=lambda m: m.request_id == "B")
    late = [m for _, m in c.prefill.mailbox.held if m.request_id == "A"]
    assert late
    # make A's late frames maximally harmful: zero KV
    c.prefill.mailbox.held = [
        (p, msgspec.structs.replace(m, kv=type(m.kv)(m.kv.dtype, m.kv.shape, bytes(m.kv.nbytes))))
        if isinstance(m, KVFrame) else (p, m) for p, m in c.prefill.mailbox.held]
    _pump(c, results, 1)
    c.prefill.mailbox.hold = False
    c.prefill.mailbox.release()
    for _ in range(100):
        _pump(c, results)
        if results.get("B", {}).get("finish"):
            break
    assert results["B"]["tokens"] == refs[2]
    assert c.verifier.kv.stats.num_late_frames > 0
    assert c.verifier.block_manager.num_free_blocks == need
