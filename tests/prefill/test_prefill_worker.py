"""The prefill worker in-process (tiny random Llama, in-process hub): the KV it ships equals the
KV of its own forward, frame for frame; the first token is the target's argmax; bad requests,
cancels, aborts, a full queue and garbage each get a clear outcome and the worker goes on."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine.block_manager import BlockManager
from specmesh.engine.frames import buffer_to_tensor
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.runner import ModelRunner
from helpers.models import hf_greedy, tiny_llama
from specmesh.prefill.config import PrefillConfig
from specmesh.prefill.worker import PrefillWorker
from specmesh.protocol.messages import (
    Abort,
    KVFrame,
    PrefillCancel,
    PrefillCancelAck,
    PrefillDone,
    PrefillRequest,
    SamplingParams,
)
from specmesh.protocol.transport import InProcHub

VOCAB = 96
BLOCK = 4
NUM_BLOCKS = 16


@pytest.fixture(scope="module")
def tiny():
    hf, model, cfg = tiny_llama(seed=5, dtype=torch.float32, vocab_size=VOCAB, num_layers=3)
    return hf, model, cfg


def make_worker(tiny, **cfg):
    _, model, config = tiny
    hub = InProcHub()
    verifier = hub.mailbox("verifier-0")
    runner = ModelRunner(model, config, KVCache(config, NUM_BLOCKS, BLOCK, torch.float32))
    bm = BlockManager(NUM_BLOCKS, BLOCK)
    worker = PrefillWorker(PrefillConfig(**cfg), hub.mailbox("prefill-0"), runner, bm)
    return verifier, worker


def request(rid: str, prompt: list[int], transfer_id: int = 1, **sampling) -> PrefillRequest:
    return PrefillRequest(request_id=rid, transfer_id=transfer_id, prompt_token_ids=prompt,
                          sampling=SamplingParams(max_tokens=8, **sampling),
                          block_table=[0, 1, 2, 3])


def run(verifier, worker, steps: int = 4):
    for _ in range(steps):
        worker.step()
    return [e.msg for e in verifier.drain()]


def test_frames_carry_the_prompt_kv_and_done_the_argmax(tiny):
    hf, model, config = tiny
    prompt = [5, 17, 3, 44, 9, 12, 70, 8, 21, 33]
    verifier, worker = make_worker(tiny, frame_tokens=3, frame_layers=2, chunk_size=4)
    verifier.send("prefill-0", request("r", prompt, transfer_id=7))
    msgs = run(verifier, worker)
    frames = [m for m in msgs if isinstance(m, KVFrame)]
    (done,) = [m for m in msgs if isinstance(m, PrefillDone)]
    # the first token leaves before the KV (the verifier streams it while the KV arrives)
    assert isinstance(msgs[0], PrefillDone)
    assert done.error == "" and done.transfer_id == 7
    assert done.first_token_id == hf_greedy(hf, prompt, 1)[0]
    # 4 token chunks (3+3+3+1) x 2 layer ranges ([0, 2), [2, 3))
    assert done.num_frames == len(frames) == 8
    assert [f.chunk_index for f in frames] == list(range(8))
    assert done.num_bytes == sum(f.kv.nbytes for f in frames)

    # Reassemble and compare with the KV of an independent prefill of the same prompt.
    ref = ModelRunner(model, config, KVCache(config, NUM_BLOCKS, BLOCK, torch.float32))
    ref.prefill(prompt, [0, 1, 2], chunk_size=len(prompt))
    want = ref.kv_cache.read_chunk(0, config.num_layers, [0, 1, 2], 0, len(prompt))
    got = torch.zeros_like(want)
    for f in frames:
        assert f.transfer_id == 7
        kv = buffer_to_tensor(f.kv)
        got[f.layer_start:f.layer_end, :, f.token_start:f.token_start + f.num_tokens] = kv
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert worker.num_unused_blocks == NUM_BLOCKS  # its own blocks are freed
    assert worker.stats.num_requests == 1 and worker.stats.num_prompt_tokens == len(prompt)


@pytest.mark.parametrize("prompt, sampling, block_table, error", [
    ([], {}, [0], "empty prompt"),
    ([1, VOCAB], {}, [0], f"outside [0, {VOCAB})"),
    ([1, 2], {"temperature": -0.5}, [0], "temperature must be finite and >= 0"),
    ([1, 2], {"temperature": 0.8, "top_p": 0.0}, [0], "top_p must be in (0, 1]"),
    ([1, 2], {}, [], "no destination blocks"),
    ([1] * (NUM_BLOCKS * BLOCK + 1), {}, [0], "does not fit"),
])
def test_bad_requests_fail_clearly_and_the_worker_goes_on(tiny, prompt, sampling, block_table,
                                                           error):
    hf, _, _ = tiny
    verifier, worker = make_worker(tiny)
    bad = PrefillRequest(request_id="bad", transfer_id=1, prompt_token_ids=prompt,
                         sampling=SamplingParams(**sampling), block_table=block_table)
    verifier.send("prefill-0", bad)
    verifier.send("prefill-0", request("good", [4, 5, 6], transfer_id=2))
    msgs = run(verifier, worker)
    dones = {m.request_id: m for m in msgs if isinstance(m, PrefillDone)}
    assert error in dones["bad"].error and dones["bad"].first_token_id == -1
    assert not any(isinstance(m, KVFrame) and m.request_id == "bad" for m in msgs)
    assert dones["good"].error == ""
    assert dones["good"].first_token_id == hf_greedy(hf, [4, 5, 6], 1)[0]
    assert worker.num_unused_blocks == NUM_BLOCKS


def test_cancel_and_abort_of_queued_requests(tiny):
    verifier, worker = make_worker(tiny)
    verifier.send("prefill-0", request("a", [1, 2, 3], transfer_id=1))
    verifier.send("prefill-0", request("b", [4, 5, 6], transfer_id=2))
    verifier.send("prefill-0", request("c", [7, 8, 9], transfer_id=3))
    verifier.send("prefill-0", PrefillCancel(request_id="a", transfer_id=1))
    verifier.send("prefill-0", Abort(request_id="b"))
    msgs = run(verifier, worker)
    assert [type(m) for m in msgs if not isinstance(m, KVFrame)] == \
        [PrefillCancelAck, PrefillDone]
    assert {m.request_id for m in msgs} == {"a", "c"}  # only c ran; a was acknowledged
    assert worker.stats.num_cancelled == 1 and worker.stats.num_requests == 1


def test_full_queue_refuses_with_an_error(tiny):
    verifier, worker = make_worker(tiny, max_queue_len=1)
    verifier.send("prefill-0", request("a", [1, 2, 3], transfer_id=1))
    verifier.send("prefill-0", request("b", [1, 2, 3], transfer_id=2))
    worker.ingest()
    (refused,) = [e.msg for e in verifier.drain()]
    assert refused.request_id == "b" and refused.error == "prefill queue full"
    msgs = run(verifier, worker)
    assert [m.request_id for m in msgs if isinstance(m, PrefillDone)] == ["a"]


def test_garbage_is_counted_and_does_not_stop_the_worker(tiny):
    verifier, worker = make_worker(tiny)
    verifier.send_frames("prefill-0", [b"\xc1 not msgpack"])
    verifier.send("prefill-0", request("a", [1, 2, 3]))
    msgs = run(verifier, worker)
    assert worker.stats.num_protocol_errors == 1
    assert [m.error for m in msgs if isinstance(m, PrefillDone)] == [""]


class _FakeClock:
    """``time.monotonic`` / ``time.sleep`` of prefill.kv_frames: sleeping advances the clock; each
    send is stamped with the clock's time."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_kv_send_cap_paces_the_frames(tiny, monkeypatch):
    """``max_kv_send_mb_s``: frame k leaves no earlier than (bytes of frames 0..k-1) / cap after
    the first, which leaves at once; the KV and the first token are those of an uncapped run."""
    import specmesh.prefill.kv_frames as prefill_kv_frames

    prompt = [5, 17, 3, 44, 9, 12, 70, 8, 21, 33]
    verifier, worker = make_worker(tiny, frame_tokens=3, frame_layers=2)
    verifier.send("prefill-0", request("r", prompt))
    uncapped = run(verifier, worker)
    clock = _FakeClock()
    monkeypatch.setattr(prefill_kv_frames, "time", clock)
    cap = 0.001  # MiB/s: ~1 KiB/s
    verifier, worker = make_worker(tiny, frame_tokens=3, frame_layers=2, max_kv_send_mb_s=cap)
    sent_at = []
    send = worker.send
    worker.send = lambda peer, msg: (sent_at.append((clock.now, msg)), send(peer, msg))[1]
    verifier.send("prefill-0", request("r", prompt))
    capped = run(verifier, worker)
    frames = [(t, m) for t, m in sent_at if isinstance(m, KVFrame)]
    assert len(frames) == 8
    t0, sent = frames[0][0], 0
    for t, m in frames:
        assert t == pytest.approx(t0 + sent / (cap * (1 << 20)))
        sent += m.kv.nbytes
    assert frames[-1][0] > t0  # it did wait
    assert len(capped) == len(uncapped)
    for a, b in zip(capped, uncapped):
        if isinstance(a, KVFrame):
            assert torch.equal(buffer_to_tensor(a.kv), buffer_to_tensor(b.kv))
        else:
            assert a == b


def test_kv_send_cap_must_not_be_negative():
    with pytest.raises(ValueError, match="max_kv_send_mb_s"):
        PrefillConfig(max_kv_send_mb_s=-1)
