"""The ``n`` choices of one prompt (decode/siblings.py): prefilled once, forked from the first
one's KV (shared full blocks, a copied partial block), each exactly what it would be alone."""

import random
import time

import pytest
import torch

from helpers.models import hf_greedy, tiny_llama
from helpers.proposers import OracleProposer
from specmesh.cluster.inprocess import VERIFIER, InProcessCluster
from specmesh.decode.request import RequestStatus
from specmesh.engine.block_manager import BlockManager
from specmesh.protocol.messages import Abort, GenerateRequest, SamplingParams

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tiny():
    hf, model, cfg = tiny_llama(seed=3, dtype=torch.float64, vocab_size=96)
    rng = random.Random(1)
    # 7 tokens: a partial last block of 4; 8: the prompt ends on a block boundary
    prompts = [[rng.randrange(96) for _ in range(7)], [rng.randrange(96) for _ in range(8)]]
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return model, cfg, prompts, refs


def _cluster(model, cfg, k=0, **kw):
    return InProcessCluster(model, cfg, num_speculative_tokens=k, num_kv_blocks=64,
                            block_size=4, **kw)


@pytest.mark.parametrize("which", [0, 1])
def test_greedy_choices_equal_one_request_and_prefill_once(tiny, which):
    model, cfg, prompts, refs = tiny
    c = _cluster(model, cfg)
    res = c.generate([prompts[which]] * 4, SamplingParams(max_tokens=MAX_TOKENS),
                     groups=["g"] * 4)
    for r in res:
        assert r.token_ids == refs[which] and r.finish_reason == "length"
    assert c.prefill.stats.num_requests == 1
    assert c.verifier.stats.num_sibling_forks == 3
    assert c.verifier.block_manager.num_free_blocks == 64  # every hold given back


def test_choices_with_drafts_are_exact_and_accept(tiny):
    model, cfg, prompts, refs = tiny
    c = _cluster(model, cfg, k=4, proposer=OracleProposer(prompts, refs))
    res = c.generate([prompts[0]] * 3, SamplingParams(max_tokens=MAX_TOKENS), groups=["g"] * 3)
    assert all(r.token_ids == refs[0] for r in res)
    assert all(r.spec.num_accepted_tokens > 0 for r in res)
    assert c.prefill.stats.num_requests == 1


def test_seeded_choices_equal_separate_requests(tiny):
    model, cfg, prompts, _ = tiny
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=100 + i)
              for i in range(3)]
    grouped = _cluster(model, cfg, k=3).generate([prompts[0]] * 3, params, groups=["g"] * 3)
    alone = _cluster(model, cfg).generate([prompts[0]] * 3, params)
    assert [r.token_ids for r in grouped] == [r.token_ids for r in alone]
    assert len({tuple(r.token_ids) for r in grouped}) > 1  # the seeds made them differ


def _until(c, cond, steps=200):
    for _ in range(steps):
        if cond():
            return
        c.prefill.step()
        c.verifier.step()
    raise AssertionError("condition not reached")


def test_kv_of_four_choices_is_below_four_requests(tiny):
    model, cfg, prompts, _ = tiny
    prompt = prompts[0] * 3  # 21 tokens: five full blocks shared, one partial block copied

    def used_when_running(groups):
        c = _cluster(model, cfg)
        for i, g in enumerate(groups):
            c.client.send(VERIFIER, GenerateRequest(
                request_id=f"r{i}", prompt_token_ids=prompt,
                sampling=SamplingParams(max_tokens=MAX_TOKENS), group=g,
                group_size=len(groups) if g else 1))
        reqs = c.verifier.requests
        _until(c, lambda: len(reqs) == 4
               and all(r.status is RequestStatus.RUNNING for r in reqs.values()))
        return c, c.verifier.block_manager.num_used_blocks

    c, shared = used_when_running(["g"] * 4)
    _, separate = used_when_running([""] * 4)
    assert shared < separate
    bm = c.verifier.block_manager
    first = c.verifier.requests["r0"].block_table
    assert all(bm.num_holders(b) == 4 for b in first[:5])  # the full prompt blocks


def test_aborted_leader_leaves_its_choices_to_run_alone(tiny):
    model, cfg, prompts, refs = tiny
    c = _cluster(model, cfg)
    for i in range(3):
        c.client.send(VERIFIER, GenerateRequest(
            request_id=f"r{i}", prompt_token_ids=prompts[0],
            sampling=SamplingParams(max_tokens=MAX_TOKENS), group="g", group_size=3))
    c.verifier.step()  # the group arrives; the leader is admitted and its prefill sent
    assert c.verifier.requests["r0"].status is RequestStatus.PREFILLING
    c.client.send(VERIFIER, Abort(request_id="r0"))
    outs: dict[str, list[int]] = {}
    for _ in range(300):
        c.prefill.step()
        c.verifier.step()
        for env in c.client.drain():
            outs.setdefault(env.msg.request_id, []).extend(env.msg.token_ids)
        if not c.verifier.requests:
            break
    assert outs["r1"] == refs[0] and outs["r2"] == refs[0]
    assert c.verifier.stats.num_sibling_forks == 0  # both were prefilled on their own
    assert c.verifier.block_manager.num_free_blocks == 64


def test_incomplete_group_is_admitted_after_the_wait(tiny):
    model, cfg, prompts, refs = tiny
    c = _cluster(model, cfg)
    for i in range(2):  # a group of 3 whose third request never comes
        c.client.send(VERIFIER, GenerateRequest(
            request_id=f"r{i}", prompt_token_ids=prompts[1],
            sampling=SamplingParams(max_tokens=4), group="g", group_size=3))
    outs: dict[str, list[int]] = {}
    for _ in range(2000):
        c.prefill.step()
        c.verifier.step()
        time.sleep(0.001)  # the group's arrival wait is on the real clock
        for env in c.client.drain():
            outs.setdefault(env.msg.request_id, []).extend(env.msg.token_ids)
        if outs and not c.verifier.requests:
            break
    assert outs == {"r0": refs[1][:4], "r1": refs[1][:4]}
    assert c.prefill.stats.num_requests == 1


def test_block_manager_holds():
    bm = BlockManager(8, 4)
    a = bm.allocate(3)
    held = bm.share(a[:2])
    assert bm.num_holders(a[0]) == 2 and bm.num_holders(a[2]) == 1
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.num_holders(a[0]) == 1
    with pytest.raises(ValueError, match="double free"):
        bm.free(held + held[:1])
    bm.free(held)
    assert bm.num_free_blocks == 8
    with pytest.raises(ValueError):
        bm.share([a[0]])  # a free block cannot be shared
