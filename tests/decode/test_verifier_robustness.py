"""Bad input to the verifier gets a clear answer and loses nothing: malformed bytes, unknown
requests, oversized or out-of-vocabulary prompts, a full queue, a quarantined drafter."""

import pytest
import torch
from helpers.models import tiny_llama

from specmesh.cluster.inprocess import InProcessCluster
from specmesh.protocol.messages import (
    Abort,
    DraftTailStream,
    GenerateRequest,
    SamplingParams,
    TokenStream,
    VerifyCommit,
)


@pytest.fixture(scope="module")
def model():
    _, m, cfg = tiny_llama(seed=4, dtype=torch.float64, vocab_size=64)
    return m, cfg


def _finals(c):
    out = {}
    for env in c.client.drain():
        if isinstance(env.msg, TokenStream) and env.msg.finished:
            out[env.msg.request_id] = env.msg
    return out


def test_invalid_requests_get_clear_errors_and_the_next_request_is_served(model):
    m, cfg = model
    c = InProcessCluster(m, cfg, num_speculative_tokens=2, num_kv_blocks=16, block_size=4,
                         max_model_len=48)
    sp = SamplingParams(max_tokens=4)
    c.client.send_frames("verifier-0", [b"\x93\x01\x02"])  # valid msgpack, not a message
    c.client.send_frames("verifier-0", [b"\xff" * 10])
    c.client.send("verifier-0", Abort(request_id="never-sent"))
    bad = {
        "empty": [],
        "oov": [1, 2, 999],
        "too-long": list(range(1, 50)),
    }
    for rid, prompt in bad.items():
        c.client.send("verifier-0", GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                                  sampling=sp))
    c.client.send("verifier-0", GenerateRequest(request_id="bad-top-p", prompt_token_ids=[1],
                                              sampling=SamplingParams(temperature=0.7,
                                                                      top_p=1.5)))
    c.verifier.step()
    finals = _finals(c)
    assert {r: f.finish_reason for r, f in finals.items()} == {
        "empty": "invalid", "oov": "invalid", "too-long": "invalid", "bad-top-p": "invalid"}
    assert "maximum model length" in finals["too-long"].error
    assert c.verifier.stats.num_protocol_errors == 2
    (ok,) = c.generate([[3, 4, 5]], sp)
    assert ok.finish_reason == "length" and len(ok.token_ids) == 4


def test_full_queue_answers_queue_full(model):
    m, cfg = model
    c = InProcessCluster(m, cfg, num_speculative_tokens=0, num_kv_blocks=16, block_size=4,
                         max_queue_len=2)
    c.verifier.prefill_peers = []  # nothing can be admitted: requests stay queued
    for i in range(3):
        c.client.send("verifier-0", GenerateRequest(request_id=f"q{i}", prompt_token_ids=[1, 2],
                                                  sampling=SamplingParams(max_tokens=2)))
    c.verifier.step()
    finals = _finals(c)
    assert list(finals) == ["q2"] and finals["q2"].finish_reason == "queue_full"
    c.verifier.set_roster(["prefill-0"], ["drafter-0"])
    c.client.send("verifier-0", Abort(request_id="q0"))
    for _ in range(20):
        c.prefill.step()
        c.verifier.step()
        finals.update(_finals(c))
    assert finals["q0"].finish_reason == "abort"
    assert finals["q1"].finish_reason == "length"


def test_garbage_from_drafter_quarantines_only_that_request(model):
    m, cfg = model
    c = InProcessCluster(m, cfg, num_speculative_tokens=3, num_kv_blocks=32, block_size=4)
    sp = SamplingParams(max_tokens=10)
    ref = InProcessCluster(m, cfg, num_speculative_tokens=0, num_kv_blocks=32, block_size=4)
    want = [r.token_ids for r in ref.generate([[5, 6, 7], [9, 9, 9, 9]], sp)]
    for i, p in enumerate([[5, 6, 7], [9, 9, 9, 9]]):
        c.client.send("verifier-0", GenerateRequest(request_id=f"g{i}", prompt_token_ids=p,
                                                  sampling=sp))
    for _ in range(3):
        c.prefill.step()
        c.verifier.step()
    # from the real drafter's name: an out-of-vocabulary draft and a wrong message type
    c.drafter.mailbox.send("verifier-0", DraftTailStream(
        request_id="g0", base_committed_len=1, start_pos=1, draft_token_ids=[10_000]))
    c.drafter.mailbox.send("verifier-0", VerifyCommit(request_id="g1", pre_commit_len=0,
                                                    committed_token_ids=[1]))
    got = {}
    for _ in range(40):
        c.drafter.step()
        c.prefill.step()
        c.verifier.step()
        for env in c.client.drain():
            if isinstance(env.msg, TokenStream):
                got.setdefault(env.msg.request_id, []).extend(env.msg.token_ids)
    assert got["g0"] == want[0] and got["g1"] == want[1]
    assert c.verifier.stats.num_protocol_errors == 1
    assert c.verifier.stats.num_ignored_messages == 1


def _branch_frames(**fields):
    """Frames of a DraftBranches message whose header carries ``fields`` as given."""
    import msgspec

    from specmesh.protocol.codec import encode
    from specmesh.protocol.messages import DraftBranches

    frames = encode(DraftBranches(request_id="x", base_committed_len=1, position=1,
                                  token_ids=[1], continuations=[[2]]))
    body = msgspec.msgpack.decode(frames[0])
    body.update(fields)
    return [msgspec.msgpack.encode(body)]


@pytest.mark.parametrize("bad", [
    {"token_ids": [10_000]},  # outside the vocabulary (checked by the verifier)
    {"continuations": [[2, 10_000]]},
    {"base_committed_len": 500, "position": 500},  # more than the verifier ever committed
    {"continuations": [[]]},
    {"position": 0},  # before the drafter's own prefix
], ids=["oov-candidate", "oov-continuation", "future-base", "empty", "position-before-base"])
def test_bad_branches_are_a_protocol_error_and_the_request_continues_plain(model, bad):
    m, cfg = model
    c = InProcessCluster(m, cfg, num_speculative_tokens=3, num_kv_blocks=32, block_size=4)
    sp = SamplingParams(max_tokens=10)
    ref = InProcessCluster(m, cfg, num_speculative_tokens=0, num_kv_blocks=32, block_size=4)
    want = ref.generate([[5, 6, 7]], sp)[0].token_ids
    c.client.send("verifier-0", GenerateRequest(request_id="g0", prompt_token_ids=[5, 6, 7],
                                              sampling=sp))
    for _ in range(3):
        c.prefill.step()
        c.verifier.step()
    c.drafter.mailbox.send_frames("verifier-0", _branch_frames(request_id="g0", **bad))
    c.verifier.step()  # must not raise
    assert c.verifier.stats.num_protocol_errors == 1
    assert c.verifier.requests["g0"].drafter is None  # quarantined: plain decode from now on
    got = []
    for _ in range(40):
        c.drafter.step()
        c.prefill.step()
        c.verifier.step()
        got += [t for e in c.client.drain() if isinstance(e.msg, TokenStream)
                for t in e.msg.token_ids]
    assert got == want and c.verifier.stats.num_finished == 1


def _tail_frames(**fields):
    """Frames of a DraftTailStream whose header carries ``fields`` as given (out-of-range
    values included: a local constructor would not stop a peer from sending them)."""
    import msgspec

    from specmesh.protocol.codec import encode

    frames = encode(DraftTailStream(request_id="x", base_committed_len=1, start_pos=1,
                                    draft_token_ids=[1]))
    body = msgspec.msgpack.decode(frames[0])
    body.update(fields)
    return [msgspec.msgpack.encode(body)]


@pytest.mark.parametrize("bad", [
    {"start_pos": -1},
    {"base_committed_len": -3},
    {"start_pos": 1, "base_committed_len": 2},  # starts before the drafter's own prefix
    {"draft_token_ids": [1, -5]},
    {"draft_token_ids": [1, 10_000]},  # outside the vocabulary (checked by the verifier)
    {"base_committed_len": 500, "start_pos": 500},  # more than the verifier ever committed
    {"draft_token_ids": [1, 2], "parents": [-1]},  # parents of the wrong length
    {"draft_token_ids": [1, 2], "parents": [-1, 1]},  # a token its own parent
    {"from_prediction": True},  # prediction drafts for a request without a prediction
    {"draft_token_ids": [1, 2], "parents": [-1, -1], "from_prediction": True},  # not a chain
], ids=["neg-start", "neg-base", "start-before-base", "neg-token", "oov-token", "future-base",
        "parents-len", "parents-self", "prediction-none", "prediction-tree"])
def test_out_of_range_tail_is_a_protocol_error_and_the_request_continues_plain(model, bad):
    m, cfg = model
    c = InProcessCluster(m, cfg, num_speculative_tokens=3, num_kv_blocks=32, block_size=4)
    sp = SamplingParams(max_tokens=10)
    ref = InProcessCluster(m, cfg, num_speculative_tokens=0, num_kv_blocks=32, block_size=4)
    prompts = [[5, 6, 7], [9, 9, 9, 9]]
    want = [r.token_ids for r in ref.generate(prompts, sp)]
    for i, p in enumerate(prompts):
        c.client.send("verifier-0", GenerateRequest(request_id=f"g{i}", prompt_token_ids=p,
                                                  sampling=sp))
    for _ in range(3):
        c.prefill.step()
        c.verifier.step()
    assert c.verifier.requests["g0"].drafter == "drafter-0"
    c.drafter.mailbox.send_frames("verifier-0", _tail_frames(request_id="g0", **bad))
    n_steps = c.verifier.stats.num_steps
    c.verifier.step()  # must not raise: the step runs, the bad tail is counted
    assert c.verifier.stats.num_steps == n_steps + 1
    assert c.verifier.stats.num_protocol_errors == 1
    g0 = c.verifier.requests["g0"]
    assert g0.drafter is None and not g0.spec_enabled  # quarantined: plain decode from now on
    got = {}
    for _ in range(40):
        c.drafter.step()
        c.prefill.step()
        c.verifier.step()
        for env in c.client.drain():
            if isinstance(env.msg, TokenStream):
                got.setdefault(env.msg.request_id, []).extend(env.msg.token_ids)
    assert got["g0"] == want[0] and got["g1"] == want[1]
    assert c.verifier.stats.num_finished == 2 and c.verifier.stats.num_protocol_errors == 1


def test_generate_request_with_a_live_id_is_refused_and_the_live_one_is_untouched(model):
    """Issue 9 scenario 9 on the verifier: a GenerateRequest whose id is live is refused; the
    sender gets a clear error when it is another gateway, and nothing when it is the gateway
    of the live request (an answer under that id would end the live request's stream)."""
    m, cfg = model
    c = InProcessCluster(m, cfg, num_speculative_tokens=2, num_kv_blocks=32, block_size=4)
    other = c.hub.mailbox("gateway-1")
    sp = SamplingParams(max_tokens=8)
    ref = InProcessCluster(m, cfg, num_speculative_tokens=0, num_kv_blocks=32, block_size=4)
    (want,) = ref.generate([[5, 6, 7]], sp)
    c.client.send("verifier-0", GenerateRequest(request_id="live", prompt_token_ids=[5, 6, 7],
                                              sampling=sp))
    c.prefill.step()
    c.verifier.step()
    c.prefill.step()
    c.verifier.step()
    assert c.verifier.requests["live"].committed_len > 0
    dup = GenerateRequest(request_id="live", prompt_token_ids=[9, 9], sampling=sp)
    other.send("verifier-0", dup)  # another gateway
    c.client.send("verifier-0", dup)  # the live request's own gateway
    streams: list[TokenStream] = []
    for _ in range(40):
        c.drafter.step()
        c.prefill.step()
        c.verifier.step()
        streams += [e.msg for e in c.client.drain() if isinstance(e.msg, TokenStream)]
    (refusal,) = [e.msg for e in other.drain()]
    assert refusal.finished and refusal.finish_reason == "invalid"
    assert "duplicate request id" in refusal.error
    finals = [s for s in streams if s.finished]
    assert len(finals) == 1 and finals[0].finish_reason == "length"
    assert [t for s in streams for t in s.token_ids] == want.token_ids
    assert c.verifier.stats.num_protocol_errors == 1  # the same-gateway duplicate, counted
