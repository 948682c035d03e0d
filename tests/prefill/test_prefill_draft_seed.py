"""The prefill's draft seeders (prefill/draft_seed.py): after the forward, a request whose draft
method has a seeder gets its DraftSeed in PrefillDone, the seeder called with the prompt plus
the first token and the very row PrefillDone.seed_state carries; other methods get none; a
seeder that raises or returns None costs the request its seed only (counted), never its
prefill."""

from __future__ import annotations

import pytest
import torch

from helpers.models import tiny_llama
from specmesh.engine.block_manager import BlockManager
from specmesh.engine.frames import buffer_to_tensor
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.runner import ModelRunner
from specmesh.prefill.config import PrefillConfig
from specmesh.prefill.worker import PrefillWorker
from specmesh.protocol.messages import DraftSeed, PrefillDone, PrefillRequest, SamplingParams
from specmesh.protocol.transport import InProcHub

BLOCK, NUM_BLOCKS = 4, 32
PROMPTS = [[5, 17, 3, 44, 9, 12, 70, 8, 21, 33], [4, 8, 15, 16, 23]]


@pytest.fixture(scope="module")
def tiny():
    _, model, cfg = tiny_llama(seed=6, dtype=torch.float64, vocab_size=96)
    return model, cfg


def _run(tiny, seeder, methods=("eagle-test", "eagle-test")):
    model, config = tiny
    hub = InProcHub()
    v = hub.mailbox("verifier-0")
    runner = ModelRunner(model, config, KVCache(config, NUM_BLOCKS, BLOCK, model.dtype))
    worker = PrefillWorker(PrefillConfig(seed_states={"eagle-test": "hidden", "ngram": ""}),
                           hub.mailbox("prefill-0"), runner, BlockManager(NUM_BLOCKS, BLOCK))
    worker.draft_seeders = {"eagle-test": seeder}
    for i, (prompt, method) in enumerate(zip(PROMPTS, methods)):
        v.send("prefill-0", PrefillRequest(
            request_id=f"r{i}", transfer_id=i + 1, prompt_token_ids=prompt,
            sampling=SamplingParams(), block_table=[3 * i, 3 * i + 1, 3 * i + 2],
            draft_method=method))
    for _ in range(4):
        worker.step()
    dones = sorted((e.msg for e in v.drain() if isinstance(e.msg, PrefillDone)),
                   key=lambda d: d.request_id)
    return dones, worker


def test_the_seeder_gets_the_context_and_the_seed_row(tiny):
    calls = []

    def seeder(rid, ctx, hidden):
        calls.append((rid, ctx, hidden.clone()))
        return DraftSeed.example()

    dones, worker = _run(tiny, seeder)
    assert [d.error for d in dones] == ["", ""]
    for (rid, ctx, hidden), d, prompt in zip(sorted(calls, key=lambda c: c[0]), dones, PROMPTS):
        assert rid == d.request_id and ctx == [*prompt, d.first_token_id]
        assert torch.equal(hidden, buffer_to_tensor(d.seed_state))
        assert d.draft_seed == DraftSeed.example()
    assert worker.stats.num_draft_seeds == 2
    assert worker.stats.draft_seed_bytes == 2 * DraftSeed.example().nbytes


def test_only_methods_with_a_seeder_get_a_seed(tiny):
    dones, worker = _run(tiny, lambda rid, ctx, h: DraftSeed.example(),
                         methods=("ngram", "eagle-test"))
    assert dones[0].draft_seed is None and dones[1].draft_seed is not None
    assert worker.stats.num_draft_seeds == 1


@pytest.mark.parametrize("raises", [True, False])
def test_a_failing_seeder_costs_only_the_seed(tiny, raises):
    def seeder(rid, ctx, hidden):
        if raises:
            raise RuntimeError("boom")
        return None

    dones, worker = _run(tiny, seeder)
    assert [d.error for d in dones] == ["", ""]
    assert all(d.draft_seed is None and d.seed_state is not None and d.first_token_id >= 0
               for d in dones)
    assert worker.stats.num_draft_seed_errors == (2 if raises else 0)
    assert worker.stats.num_failed == 0 and worker.stats.num_draft_seeds == 0
