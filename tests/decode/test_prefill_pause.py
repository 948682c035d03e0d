"""Prompts first on shared cores (decode/prefill_pause.py): the verifier pauses its verify steps
while a prefill it waits on is in flight, in bounded windows with one verify step between them;
and the first token streams as soon as PrefillDone brings it, before the KV has landed."""

from __future__ import annotations

import pytest
import torch

from helpers.models import hf_greedy, tiny_llama
from specmesh.cluster.inprocess import VERIFIER, InProcessCluster
from specmesh.decode.core_sharing import CoreSharing
from specmesh.decode.prefill_pause import EXPLORE_EVERY, PrefillPause
from specmesh.decode.request import RequestStatus
from specmesh.protocol.messages import (
    GenerateRequest,
    PrefillDone,
    SamplingParams,
    TokenStream,
)

MAX_TOKENS = 10


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_pause_windows_are_bounded_with_one_step_between():
    clock = Clock()
    p = PrefillPause(0.5, clock=clock)
    assert not p.should_pause(0)  # nothing prefilling
    assert p.should_pause(2) and p.num_windows == 1
    clock.now += 0.3
    assert p.should_pause(1) and p.remaining_s() == pytest.approx(0.2)
    clock.now += 0.25
    assert not p.should_pause(1)  # ran out: one verify step runs
    assert p.num_expired == 1 and p.remaining_s() == 0.0
    assert p.should_pause(1) and p.num_windows == 2  # then a new window
    assert not p.should_pause(0)  # the prefill landed: the window closes
    clock.now += 10
    assert p.should_pause(1) and p.num_windows == 3  # a fresh window, not an expired one


def test_the_measured_figures_choose_the_way():
    """Each way is tried twice, then the verifier pauses while paused prompts take at most
    PAUSE_GAIN of the side-by-side time per token, and every EXPLORE_EVERY-th prompt goes the
    other way."""
    p = PrefillPause(1.0, clock=Clock())
    ways = []
    for _ in range(4):
        way = p.choose()
        ways.append(way)
        p.observe(way, 100, 0.2 if way else 0.5)  # paused: 2 ms a token; side by side: 5 ms
    assert ways == [True, True, False, False]
    assert p.per_token_s[True] == pytest.approx(0.002) and p.num_samples[False] == 2
    chosen = [p.choose() for _ in range(EXPLORE_EVERY)]
    assert chosen == [True] * (EXPLORE_EVERY - 1) + [False]  # the last one explores
    for _ in range(10):  # a crowded host: paused prompts are no faster
        p.observe(True, 100, 0.5)
    assert not p.choose()
    p.observe(False, 0, 1.0)  # an empty prompt says nothing
    assert p.num_samples[False] == 2


def test_zero_never_pauses_and_negative_is_refused():
    p = PrefillPause(0.0, clock=Clock())
    assert not p.enabled and not p.should_pause(5) and not p.choose()
    with pytest.raises(ValueError, match="max_pause_s"):
        PrefillPause(-1.0)


@pytest.fixture(scope="module")
def tiny():
    hf, model, cfg = tiny_llama(seed=4, dtype=torch.float64, vocab_size=80)
    prompts = [[3, 4, 5, 6, 7, 8, 9], [20, 21, 22, 20, 21]]
    return model, cfg, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


def _submit(c: InProcessCluster, rid: str, prompt: list[int]) -> None:
    c.client.send(VERIFIER, GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                            sampling=SamplingParams(max_tokens=MAX_TOKENS)))


def _tokens(c: InProcessCluster, got: dict[str, list[int]]) -> None:
    for env in c.client.drain():
        if isinstance(env.msg, TokenStream):
            got.setdefault(env.msg.request_id, []).extend(env.msg.token_ids)


def test_the_verifier_pauses_for_a_prefill_on_its_cores_then_steps(tiny):
    """A running request, a second one prefilling on the shared cores: the verifier runs no
    verify step while the window is open, one when it ran out, none in the next window, and
    every step again once the KV landed; outputs as plain greedy."""
    model, cfg, prompts, refs = tiny
    c = InProcessCluster(model, cfg, num_speculative_tokens=2, num_kv_blocks=64, block_size=4)
    c.verifier.core_sharing = CoreSharing(2, lambda n: None, shared=True)
    clock = Clock()
    c.verifier.prefill_pause = PrefillPause(0.5, clock=clock)
    got: dict[str, list[int]] = {}
    _submit(c, "a", prompts[0])
    c.verifier.step()  # admits a: PrefillRequest
    c.prefill.step()
    c.verifier.step()  # a's KV lands: running, then one verify step
    assert c.verifier.requests["a"].status is RequestStatus.RUNNING
    steps = c.verifier.stats.num_steps
    assert steps == 1
    _submit(c, "b", prompts[1])
    c.verifier.step()  # admits b; a prefill is in flight on the shared cores: pause
    c.verifier.step()
    assert c.verifier.stats.num_steps == steps
    assert c.verifier.profile.as_dict()["phases"]["prefill_pause"]["count"] == 2
    clock.now += 0.6
    c.verifier.step()  # the window ran out: one verify step for a
    assert c.verifier.stats.num_steps == steps + 1
    c.verifier.step()  # a new window
    assert c.verifier.stats.num_steps == steps + 1
    c.prefill.step()
    c.verifier.step()  # b's KV lands: both run
    assert c.verifier.stats.num_steps == steps + 2
    for _ in range(4 * MAX_TOKENS):
        c.drafter.step()
        c.verifier.step()
        _tokens(c, got)
        if not c.verifier.requests:
            break
    assert [got["a"], got["b"]] == refs


def test_where_pausing_does_not_pay_prompts_run_side_by_side(tiny):
    """Figures of a crowded host (paused prompts no faster per token): the next prompt is sent
    without verifier_idle and the running request keeps stepping."""
    model, cfg, prompts, _ = tiny
    c = InProcessCluster(model, cfg, num_speculative_tokens=2, num_kv_blocks=64, block_size=4)
    c.verifier.core_sharing = CoreSharing(2, lambda n: None, shared=True)
    pause = c.verifier.prefill_pause = PrefillPause(0.5, clock=Clock())
    for way in (True, True, False, False):  # paused 1 s a token, side by side 1 ms
        pause.observe(way, 10, 10.0 if way else 0.01)
    _submit(c, "a", prompts[0])
    c.verifier.step()
    c.prefill.step()
    c.verifier.step()
    _submit(c, "b", prompts[1])
    c.verifier.step()
    assert not c.verifier.requests["b"].prefill_paused
    assert c.verifier.stats.num_steps == 2  # a stepped beside b's prefill
    assert "prefill_pause" not in c.verifier.profile.as_dict()["phases"]


def test_not_shared_never_pauses(tiny):
    model, cfg, prompts, _ = tiny
    c = InProcessCluster(model, cfg, num_speculative_tokens=2, num_kv_blocks=64, block_size=4)
    c.verifier.core_sharing = CoreSharing(2, lambda n: None, shared=False)
    _submit(c, "a", prompts[0])
    c.verifier.step()
    c.prefill.step()
    c.verifier.step()
    _submit(c, "b", prompts[1])
    c.verifier.step()  # b in flight, but prefill runs on other cores: a steps on
    assert c.verifier.stats.num_steps == 2
    assert "prefill_pause" not in c.verifier.profile.as_dict()["phases"]


def test_the_first_token_streams_before_the_kv_lands(tiny):
    """PrefillDone comes first: its token reaches the gateway while the request still awaits
    its KV; the frames then start it without a second first token; output as plain greedy."""
    model, cfg, prompts, refs = tiny
    c = InProcessCluster(model, cfg, num_speculative_tokens=2, num_kv_blocks=64, block_size=4)
    _submit(c, "a", prompts[0])
    c.verifier.step()
    c.prefill.step()
    env = c.verifier.mailbox.recv(0.0)
    assert isinstance(env.msg, PrefillDone)
    c.verifier.handle(env)  # only PrefillDone so far
    (first,) = [e.msg for e in c.client.drain()]
    assert first.token_ids == refs[0][:1] and first.offset == 0 and not first.finished
    req = c.verifier.requests["a"]
    assert req.status is RequestStatus.PREFILLING and req.committed_len == 1
    assert c.verifier.stats.num_ttft == 1
    got = {"a": list(first.token_ids)}
    c.verifier.ingest()  # the frames: the transfer completes, the request runs
    assert req.status is RequestStatus.RUNNING and req.committed_len == 1
    for _ in range(4 * MAX_TOKENS):
        c.drafter.step()
        c.verifier.step()
        _tokens(c, got)
        if not c.verifier.requests:
            break
    assert got["a"] == refs[0]
    assert c.verifier.stats.num_ttft == 1


def test_a_first_token_that_ends_the_request_ends_it_before_the_kv(tiny):
    """max_tokens 1: the request is done with PrefillDone; its transfer is cancelled and the
    blocks come back once the prefill acknowledges."""
    model, cfg, prompts, refs = tiny
    c = InProcessCluster(model, cfg, num_speculative_tokens=2, num_kv_blocks=64, block_size=4)
    free = c.verifier.block_manager.num_free_blocks
    c.client.send(VERIFIER, GenerateRequest(request_id="a", prompt_token_ids=prompts[0],
                                            sampling=SamplingParams(max_tokens=1)))
    c.verifier.step()
    c.prefill.step()
    c.verifier.handle(c.verifier.mailbox.recv(0.0))  # PrefillDone only
    (last,) = [e.msg for e in c.client.drain()]
    assert last.finished and last.finish_reason == "length" and last.token_ids == refs[0][:1]
    assert c.verifier.requests["a"].status is RequestStatus.CANCELLING
    for _ in range(3):
        c.verifier.step()
        c.prefill.step()
    assert not c.verifier.requests
    assert c.verifier.block_manager.num_free_blocks == free
    assert c.verifier.kv.stats.num_late_frames > 0  # the frames already sent were dropped


def test_a_reissued_transfer_does_not_replace_the_streamed_first_token(tiny):
    """The first token was streamed; a later transfer of the same request (re-issued on
    another prefill worker) brings another: the streamed one stays."""
    model, cfg, prompts, refs = tiny
    c = InProcessCluster(model, cfg, num_speculative_tokens=2, num_kv_blocks=64, block_size=4)
    _submit(c, "a", prompts[0])
    c.verifier.step()
    c.prefill.step()
    c.verifier.handle(c.verifier.mailbox.recv(0.0))  # PrefillDone
    assert [e.msg.token_ids for e in c.client.drain()] == [refs[0][:1]]
    req = c.verifier.requests["a"]
    other = (refs[0][0] + 1) % 80
    assert not c.verifier.lifecycle.first_token(req, other)
    assert req.output_token_ids == refs[0][:1]
    c.verifier.ingest()
    assert req.status is RequestStatus.RUNNING and req.output_token_ids == refs[0][:1]
    assert c.client.drain() == []  # the start streams no second first token


def test_the_option_reaches_the_verifier_and_a_negative_pause_is_refused(tiny_model_dir):
    from specmesh.cluster.cli import build_parser
    from specmesh.cluster.options import cluster_config
    from specmesh.decode.config import VerifierConfig

    args = build_parser().parse_args(["serve", "--model", tiny_model_dir])
    assert cluster_config(args).verifier.max_prefill_pause_s == 1.0
    args = build_parser().parse_args(["serve", "--model", tiny_model_dir,
                                      "--max-prefill-pause-s", "0"])
    assert cluster_config(args).verifier.max_prefill_pause_s == 0.0
    with pytest.raises(ValueError, match="max_prefill_pause_s"):
        VerifierConfig(max_prefill_pause_s=-0.1)
