"""Batched prefill (prefill/batching.py, ``ModelRunner.prefill_batch``): several waiting prompts
in one forward give each request the first token, KV and seed state of one-at-a-time prefill,
bit for bit (greedy and seeded); the batching rule and its cost model."""

from __future__ import annotations

import pytest
import torch

from helpers.models import tiny_llama
from specmesh.engine.block_manager import BlockManager
from specmesh.engine.frames import buffer_to_tensor
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.runner import ModelRunner
from specmesh.prefill.batching import PrefillCost, batch_length
from specmesh.prefill.config import PrefillConfig
from specmesh.prefill.worker import PrefillWorker
from specmesh.protocol.messages import KVFrame, PrefillDone, PrefillRequest, SamplingParams
from specmesh.protocol.transport import InProcHub

VOCAB = 96
BLOCK = 4
NUM_BLOCKS = 64
PROMPTS = [[5, 17, 3, 44, 9, 12, 70, 8, 21, 33], [1, 2, 3], [60, 61, 62, 63, 64, 65, 66],
           [7] * 13]


@pytest.fixture(scope="module")
def tiny():
    _, model, cfg = tiny_llama(seed=5, dtype=torch.float32, vocab_size=VOCAB, num_layers=3)
    return model, cfg


def _worker(tiny, **cfg):
    model, config = tiny
    hub = InProcHub()
    verifier = hub.mailbox("verifier-0")
    runner = ModelRunner(model, config, KVCache(config, NUM_BLOCKS, BLOCK, torch.float32))
    worker = PrefillWorker(PrefillConfig(frame_tokens=4, frame_layers=2,
                                         seed_states={"eagle": "hidden"}, **cfg),
                           hub.mailbox("prefill-0"), runner, BlockManager(NUM_BLOCKS, BLOCK))
    return verifier, worker


def _requests(sampling: SamplingParams, method: str) -> list[PrefillRequest]:
    return [PrefillRequest(request_id=f"r{i}", transfer_id=i + 1, prompt_token_ids=p,
                           sampling=sampling, block_table=[0], draft_method=method)
            for i, p in enumerate(PROMPTS)]


def _flat_cost() -> PrefillCost:
    """A forward's cost that hardly grows with its tokens (a GPU's): batching always pays."""
    cost = PrefillCost()
    for _ in range(2):
        cost.observe(10, 0.100)
        cost.observe(1000, 0.101)
    return cost


def _transfers(tiny, reqs: list[PrefillRequest], **cfg) -> tuple[dict, PrefillWorker]:
    """request id -> (first token, seed state tensor or None, the KV reassembled), prefilled
    with a flat forward cost (so batched up to ``max_batch_tokens``)."""
    verifier, worker = _worker(tiny, **cfg)
    worker.cost_models[0] = _flat_cost()
    for r in reqs:
        verifier.send("prefill-0", r)
    for _ in range(len(reqs) + 1):
        worker.step()
    msgs = [e.msg for e in verifier.drain()]
    _, config = tiny
    out = {}
    for r in reqs:
        (done,) = [m for m in msgs if isinstance(m, PrefillDone) and m.request_id == r.request_id]
        assert done.error == ""
        n = len(r.prompt_token_ids)
        kv = torch.full((config.num_layers, 2, n, config.num_kv_heads, config.head_dim),
                        float("nan"))
        for f in msgs:
            if isinstance(f, KVFrame) and f.request_id == r.request_id:
                kv[f.layer_start:f.layer_end, :, f.token_start:f.token_start + f.num_tokens] = \
                    buffer_to_tensor(f.kv)
        seed = None if done.seed_state is None else buffer_to_tensor(done.seed_state)
        out[r.request_id] = (done.first_token_id, seed, kv)
    return out, worker


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=8),  # greedy
    SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=123),  # seeded: coupled
], ids=["greedy", "seeded"])
@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_a_batch_gives_each_request_what_one_at_a_time_gives(tiny, sampling, method):
    reqs = _requests(sampling, method)
    alone, w1 = _transfers(tiny, reqs, max_batch_tokens=1)
    batched, wb = _transfers(tiny, reqs, max_batch_tokens=512)
    assert w1.profile.counters["num_batches"] == len(reqs)
    assert wb.profile.counters["num_batches"] == 1  # all four in one forward
    assert wb.profile.counters["num_batch_prompts"] == len(reqs)
    for rid, (first, seed, kv) in alone.items():
        b_first, b_seed, b_kv = batched[rid]
        assert b_first == first
        assert not torch.isnan(kv).any()
        assert torch.equal(b_kv, kv)  # bit for bit
        assert (seed is None) == (method == "ngram") == (b_seed is None)
        if seed is not None:
            assert torch.equal(b_seed, seed)
    assert wb.num_unused_blocks == NUM_BLOCKS


def test_a_prompt_longer_than_a_chunk_runs_alone_in_chunks(tiny):
    """chunk_size 8: the 10- and 13-token prompts run alone (chunked), the two short prompts
    between them together; every request's first token and KV as one at a time."""
    reqs = _requests(SamplingParams(max_tokens=8), "ngram")
    alone, _ = _transfers(tiny, reqs, max_batch_tokens=1, chunk_size=8)
    batched, wb = _transfers(tiny, reqs, max_batch_tokens=512, chunk_size=8)
    assert wb.profile.counters["num_batches"] == 3
    for rid, (first, _, kv) in alone.items():
        assert batched[rid][0] == first and torch.equal(batched[rid][2], kv)


def test_without_a_cost_fit_a_batch_takes_two_prompts_then_the_fit_decides(tiny):
    """No fit yet: two prompts (a second forward size to fit); then the fit of this CPU's
    forwards decides, and the first tokens are those of one at a time."""
    reqs = _requests(SamplingParams(max_tokens=8), "ngram")
    alone, _ = _transfers(tiny, reqs, max_batch_tokens=1)
    verifier, worker = _worker(tiny)
    for r in reqs:
        verifier.send("prefill-0", r)
    worker.step()
    assert worker.profile.counters["num_batch_prompts"] == 2
    assert worker.cost_models[0].fit() is None  # one size measured
    for _ in range(3):
        worker.step()
    assert worker.stats.num_requests == len(reqs)
    dones = {m.request_id: m.first_token_id for m in (e.msg for e in verifier.drain())
             if isinstance(m, PrefillDone)}
    assert dones == {rid: v[0] for rid, v in alone.items()}


def test_prefill_batch_checks_its_arguments(tiny):
    model, config = tiny
    runner = ModelRunner(model, config, KVCache(config, NUM_BLOCKS, BLOCK, torch.float32))
    with pytest.raises(ValueError, match="2 prompts, 1 block tables"):
        runner.prefill_batch([[1, 2], [3]], [[0]])
    with pytest.raises(ValueError, match="token id out of range"):
        runner.prefill_batch([[1, 2], [VOCAB]], [[0], [1]])


def test_the_cost_fit_recovers_a_linear_cost_and_waits_for_two_sizes():
    cost = PrefillCost()
    assert cost.fit() is None
    cost.observe(128, 0.010 + 128 * 0.002)
    cost.observe(512, 0.010 + 512 * 0.002)
    assert cost.fit() is None  # two forwards: too few to decide on
    for _ in range(3):
        cost.observe(128, 0.010 + 128 * 0.002)
    assert cost.fit() is not None
    single = PrefillCost()
    for _ in range(5):
        single.observe(128, 0.266)
    assert single.fit() is None  # one size only: overhead and per-token cost are not separable
    cost.observe(512, 0.010 + 512 * 0.002)
    overhead, per_token = cost.fit()
    assert overhead == pytest.approx(0.010) and per_token == pytest.approx(0.002)
    noisy = PrefillCost()
    for n, t in [(10, 0.5), (20, 0.1)] * 2:  # falling with size: clamped at >= 0
        noisy.observe(n, t)
    overhead, per_token = noisy.fit()
    assert per_token == 0.0 and overhead > 0
    with pytest.raises(ValueError, match="decay"):
        PrefillCost(decay=0)


@pytest.mark.parametrize("sizes, max_tokens, cost, want", [
    ([], 512, None, 0),
    ([128], 512, None, 1),
    ([128, 128, 128, 128, 128], 512, None, 2),  # unknown cost: two, to measure a 2nd size
    ([300, 300], 512, None, 1),  # ... within the token budget
    ([600, 10], 512, None, 1),  # the first always runs, even past the budget
    # CPU-like: 10 ms a forward, 2 ms a token: long prompts one at a time...
    ([128, 128, 128, 128], 512, (0.010, 0.002), 1),
    # ... short ones together: 1 * 4 * 0.002 < 3 * 0.010, 2 * 4 * 0.002 < 2 * 0.010, then
    # 3 * 4 * 0.002 = 0.024 >= 1 * 0.010
    ([4, 4, 4, 4], 512, (0.010, 0.002), 3),
    # GPU-like: tokens nearly free: batch until the budget
    ([128, 128, 128, 128, 128], 512, (0.010, 0.00001), 4),
    ([128, 128], 1, (0.010, 0.0), 1),  # budget 1: one prompt per forward
])
def test_batch_length(sizes, max_tokens, cost, want):
    assert batch_length(sizes, max_tokens, cost) == want


def test_batch_length_needs_a_budget():
    with pytest.raises(ValueError, match="max_tokens"):
        batch_length([1], 0, None)


def test_the_budget_must_be_positive():
    with pytest.raises(ValueError, match="max_batch_tokens"):
        PrefillConfig(max_batch_tokens=0)
