"""The prefill worker with prefix caching (tiny random float32 Llama, in-process hub): a prompt
whose leading blocks were prefilled before computes only the rest, and the first token and the
KV it ships equal a prefill of the whole prompt bit for bit (the paged attention is chunk
invariant); the cache gives room back under pressure and never fails a prompt for it."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.models import tiny_llama

from specmesh.engine.block_manager import BlockManager
from specmesh.engine.frames import buffer_to_tensor
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.runner import ModelRunner
from specmesh.prefill.batching import PrefillCost
from specmesh.prefill.claims import tokens_to_compute
from specmesh.prefill.config import PrefillConfig
from specmesh.prefill.worker import PrefillWorker
from specmesh.protocol.messages import KVFrame, PrefillDone, PrefillRequest, SamplingParams
from specmesh.protocol.transport import InProcHub

VOCAB = 96
BLOCK = 4


@pytest.fixture(scope="module")
def tiny():
    _, model, cfg = tiny_llama(seed=5, dtype=torch.float32, vocab_size=VOCAB, num_layers=3)
    return model, cfg


def make_worker(tiny, num_blocks=64, **cfg):
    model, config = tiny
    hub = InProcHub()
    verifier = hub.mailbox("verifier-0")
    runner = ModelRunner(model, config, KVCache(config, num_blocks, BLOCK, torch.float32))
    worker = PrefillWorker(PrefillConfig(**cfg), hub.mailbox("prefill-0"), runner,
                           BlockManager(num_blocks, BLOCK))
    return verifier, worker


def prefill(verifier, worker, prompts: list[list[int]]):
    """Send the prompts at once, step until done; per prompt (first token, shipped KV)."""
    for i, p in enumerate(prompts):
        verifier.send("prefill-0", PrefillRequest(
            request_id=f"r{i}", transfer_id=i + 1, prompt_token_ids=p,
            sampling=SamplingParams(max_tokens=4), block_table=[0]))
    msgs = []
    for _ in range(len(prompts) + 2):
        worker.step()
        msgs += [e.msg for e in verifier.drain()]
    out = []
    for i, p in enumerate(prompts):
        (done,) = [m for m in msgs if isinstance(m, PrefillDone) and m.request_id == f"r{i}"]
        assert done.error == ""
        frames = [m for m in msgs if isinstance(m, KVFrame) and m.request_id == f"r{i}"]
        kv = None
        for f in frames:
            part = buffer_to_tensor(f.kv)
            if kv is None:
                kv = torch.zeros((worker.model_config.num_layers, part.shape[1], len(p),
                                  *part.shape[3:]), dtype=part.dtype)
            kv[f.layer_start:f.layer_end, :, f.token_start:f.token_start + f.num_tokens] = part
        out.append((done.first_token_id, kv))
    return out


def fresh(tiny, prompts, **cfg):
    """The prompts each prefilled by a worker whose cache is cold (one per prompt)."""
    out = []
    for p in prompts:
        out += prefill(*make_worker(tiny, enable_prefix_caching=True, **cfg), [p])
    return out


def assert_same(got, want):
    assert len(got) == len(want)
    for (t1, kv1), (t2, kv2) in zip(got, want):
        assert t1 == t2
        assert torch.equal(kv1, kv2)


def prompts_sharing(n_shared: int, tails: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(n_shared)]
    return [shared + [rng.randrange(VOCAB) for _ in range(t)] for t in tails]


@pytest.mark.parametrize("chunk_size", [512, 8])
def test_a_repeated_prompt_computes_one_block_and_ships_the_same_kv(tiny, chunk_size):
    (prompt,) = prompts_sharing(37, [0])
    verifier, worker = make_worker(tiny, enable_prefix_caching=True, chunk_size=chunk_size)
    first = prefill(verifier, worker, [prompt])
    st = worker.stats
    assert st.num_computed_tokens == 37 and st.prefix_cache_hits == 0
    second = prefill(verifier, worker, [prompt])
    # 9 full blocks cached (36 tokens); the last token is computed again
    assert st.num_computed_tokens == 37 + 1
    assert st.prefix_cache_queries == 74 and st.prefix_cache_hits == 36
    assert_same(second, first)
    assert_same(second, fresh(tiny, [prompt], chunk_size=chunk_size))
    # a prompt of whole blocks keeps its last block out of the match
    whole = prompt[:36]
    prefill(verifier, worker, [whole])
    assert st.num_computed_tokens == 38 + 4


def test_prompts_sharing_a_prefix_reuse_it_alone_and_in_one_batch(tiny):
    a, b, c, d = prompts_sharing(20, [3, 7, 1, 5], seed=1)
    verifier, worker = make_worker(tiny, enable_prefix_caching=True, max_batch_tokens=512)
    got = prefill(verifier, worker, [a])
    assert worker.stats.num_computed_tokens == len(a)
    got += prefill(verifier, worker, [b, c, d])  # one forward over three cached prefixes
    assert worker.profile.as_dict()["counters"]["num_batch_prompts"] >= 3
    assert worker.stats.prefix_cache_hits == 3 * 20
    assert worker.stats.num_computed_tokens == len(a) + 7 + 1 + 5
    assert_same(got, fresh(tiny, [a, b, c, d]))


def test_batching_sizes_a_prompt_by_the_tokens_it_computes(tiny):
    (a, b) = prompts_sharing(20, [3, 6], seed=2)
    verifier, worker = make_worker(tiny, enable_prefix_caching=True)
    cache = worker.prefix_cache

    def req(p, **sampling):
        return PrefillRequest(request_id="q", transfer_id=1, prompt_token_ids=p,
                              sampling=SamplingParams(**sampling), block_table=[0])

    assert tokens_to_compute(cache, req(b), BLOCK) == len(b)  # cold
    prefill(verifier, worker, [a])
    assert tokens_to_compute(cache, req(b), BLOCK) == len(b) - 20  # a's 5 full blocks held
    assert tokens_to_compute(cache, req(a), BLOCK) == len(a) - 20  # its last token computed
    assert tokens_to_compute(cache, req(b, prompt_logprobs=1), BLOCK) == len(b)  # every row
    assert tokens_to_compute(None, req(b), BLOCK) == len(b)
    assert cache.num_evictable_blocks == cache.num_cached_blocks  # nothing acquired


@pytest.mark.parametrize("caching", [True, False])
def test_cached_prompts_batch_where_cold_ones_of_their_length_would_not(tiny, caching):
    a, b, c = prompts_sharing(20, [3, 6, 5], seed=4)
    verifier, worker = make_worker(tiny, enable_prefix_caching=caching, max_batch_tokens=512)
    prefill(verifier, worker, [a])
    cost = worker.cost_models[0] = PrefillCost()
    for n in (10, 20, 30, 40):  # 10 ms per forward + 1 ms per token: a 26-token prompt
        cost.observe(n, 0.01 + 0.001 * n)  # waits alone, a 6-token rest joins a batch
    before = worker.profile.as_dict()["counters"]["num_batches"]
    got = prefill(verifier, worker, [b, c])
    batches = worker.profile.as_dict()["counters"]["num_batches"] - before
    assert batches == (1 if caching else 2)
    if caching:  # (off, whole prompts attend through SDPA: other rounding than fresh()'s)
        assert_same(got, fresh(tiny, [b, c]))


def test_with_caching_off_nothing_is_cached_or_counted(tiny):
    prompts = prompts_sharing(20, [1, 1])
    verifier, worker = make_worker(tiny, enable_prefix_caching=False)
    prefill(verifier, worker, prompts[:1])
    prefill(verifier, worker, prompts[1:])
    assert worker.prefix_cache is None
    assert worker.stats.num_computed_tokens == 42
    assert worker.stats.prefix_cache_queries == worker.stats.prefix_cache_hits == 0
    assert worker.block_manager.num_free_blocks == 64


def test_a_full_cache_evicts_unused_blocks_and_keeps_the_ones_in_use(tiny):
    num_blocks = 12
    verifier, worker = make_worker(tiny, num_blocks=num_blocks, enable_prefix_caching=True)
    bm, cache = worker.block_manager, worker.prefix_cache
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (30, 17, 41, 9, 44, 30)]
    outs = []
    for p in prompts:  # 8 + 5 + 11 + 3 + 11 + 8 blocks through a 12-block cache
        outs += prefill(verifier, worker, [p])
        # every block is free or cached, none in use between batches
        assert bm.num_free_blocks + cache.num_cached_blocks == num_blocks
        assert cache.num_evictable_blocks == cache.num_cached_blocks
    assert worker.stats.num_failed == 0
    assert_same(outs, fresh(tiny, prompts))
    # the last prompt's prefix survived the pressure: it matches again
    hits = worker.stats.prefix_cache_hits
    prefill(verifier, worker, [prompts[-1]])
    assert worker.stats.prefix_cache_hits - hits == 28


def test_a_failed_prefill_caches_nothing(tiny, monkeypatch):
    verifier, worker = make_worker(tiny, enable_prefix_caching=True)
    (prompt,) = prompts_sharing(16, [2])

    def boom(*a, **k):
        raise RuntimeError("forward broke")

    monkeypatch.setattr(worker.runner, "prefill", boom)
    verifier.send("prefill-0", PrefillRequest(request_id="x", transfer_id=1,
                                              prompt_token_ids=prompt,
                                              sampling=SamplingParams(), block_table=[0]))
    worker.step()
    (done,) = [e.msg for e in verifier.drain()]
    assert "forward broke" in done.error
    assert worker.prefix_cache.num_cached_blocks == 0
    assert worker.block_manager.num_free_blocks == 64
