"""PrefillDone carries the seed state of the request's draft method
(docs/architecture.md, 'Life of a request' step 3): for
a method whose seed state is "hidden" (``PrefillConfig.seed_states``) the target's final hidden
state at the last prompt position, [1, hidden_size] in the model dtype (chunked prefill
included); for n-gram, an unknown method or none, nothing."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine.block_manager import BlockManager
from specmesh.engine.frames import buffer_to_tensor
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.runner import ModelRunner
from helpers.models import tiny_llama
from specmesh.prefill.config import PrefillConfig
from specmesh.prefill.worker import PrefillWorker
from specmesh.protocol.messages import PrefillDone, PrefillRequest, SamplingParams
from specmesh.protocol.transport import InProcHub

BLOCK, NUM_BLOCKS = 4, 16
PROMPT = [5, 17, 3, 44, 9, 12, 70, 8, 21, 33]


@pytest.fixture(scope="module")
def tiny():
    _, model, cfg = tiny_llama(seed=6, dtype=torch.float64, vocab_size=96)
    return model, cfg


def _dones(tiny, methods, **cfg):
    model, config = tiny
    hub = InProcHub()
    v = hub.mailbox("verifier-0")
    runner = ModelRunner(model, config, KVCache(config, NUM_BLOCKS, BLOCK, model.dtype))
    worker = PrefillWorker(PrefillConfig(seed_states={"eagle-test": "hidden", "ngram": ""},
                                         **cfg),
                           hub.mailbox("prefill-0"), runner, BlockManager(NUM_BLOCKS, BLOCK))
    for i, method in enumerate(methods):
        v.send("prefill-0", PrefillRequest(
            request_id=f"r{i}", transfer_id=i + 1, prompt_token_ids=PROMPT,
            sampling=SamplingParams(), block_table=[0, 1, 2], draft_method=method))
    for _ in range(len(methods) + 1):
        worker.step()
    return [e.msg for e in v.drain() if isinstance(e.msg, PrefillDone)]


@pytest.mark.parametrize("chunk_size", [512, 3])
def test_hidden_method_gets_the_last_prompt_hidden_state(tiny, chunk_size):
    model, config = tiny
    (done,) = _dones(tiny, ["eagle-test"], chunk_size=chunk_size)
    assert done.error == "" and done.seed_state is not None
    assert done.seed_state.dtype == "float64"
    assert tuple(done.seed_state.shape) == (1, config.hidden_size)
    ref = ModelRunner(model, config, KVCache(config, NUM_BLOCKS, BLOCK, model.dtype))
    _, hidden = ref.prefill(PROMPT, [0, 1, 2], return_hidden=True)
    torch.testing.assert_close(buffer_to_tensor(done.seed_state), hidden[-1:],
                               rtol=1e-10, atol=1e-10)


def test_methods_without_seed_state_get_none(tiny):
    dones = _dones(tiny, ["ngram", "no-such-method", ""])
    assert len(dones) == 3 and all(d.error == "" and d.seed_state is None for d in dones)
