"""Logprobs on the real model (float32, SmolLM2-135M-Instruct; issue 33 item 1): through the
in-process workers with speculation on (k = 4 and 8, the n-gram drafter, drafts accepted) the
output logprobs and top logprobs equal speculation off within 1e-5, the prompt's (from the
prefill role) too, and both equal a Hugging Face float32 forward over prompt + output within
1e-4 (what makes a loglikelihood right)."""

from __future__ import annotations

import pytest
import torch

from specmesh.cluster.demo import load_prompts
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.engine.loader import load_model
from specmesh.gateway.tokens import chat_prompt_ids
from helpers.models import hf_reference_model
from specmesh.protocol.messages import SamplingParams, TokenLogprobs

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
TOP = 5
NUM_PROMPTS = 4


@pytest.fixture(scope="module")
def smollm2():
    loaded = load_model(None, dtype="float32")
    hf = hf_reference_model(None, dtype="float32")
    ids = [chat_prompt_ids(loaded.tokenizer, p["messages"]) for p in load_prompts()]
    return loaded, hf, ids[:NUM_PROMPTS]


def _run(loaded, ids, k):
    cluster = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=k,
                               eos_token_ids=loaded.config.eos_token_ids, num_kv_blocks=256)
    sp = SamplingParams(max_tokens=MAX_TOKENS, logprobs=TOP, prompt_logprobs=TOP)
    return cluster, cluster.generate(ids, sp)


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


@pytest.mark.parametrize("k", [4, 8])
def test_logprobs_spec_on_equal_spec_off_and_hf(smollm2, k):
    loaded, hf, ids = smollm2
    _, off = _run(loaded, ids, 0)
    cluster, on = _run(loaded, ids, k)
    st = cluster.verifier.stats
    print(f"\nk={k}: drafted {st.num_draft_tokens}, accepted {st.num_accepted_tokens}")
    assert st.num_accepted_tokens > 0
    for prompt, a, b in zip(ids, off, on):
        assert a.token_ids == b.token_ids
        la, lb = TokenLogprobs.concat(a.logprobs), TokenLogprobs.concat(b.logprobs)
        assert len(lb) == len(b.token_ids)
        assert _max_diff(la.token_logprobs, lb.token_logprobs) <= 1e-5
        assert la.top_token_ids == lb.top_token_ids
        for x, y in zip(la.top_logprobs, lb.top_logprobs):
            assert _max_diff(x, y) <= 1e-5
        assert _max_diff(a.prompt_logprobs.token_logprobs,
                         b.prompt_logprobs.token_logprobs) <= 1e-5
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([prompt + b.token_ids])).logits[0].float(),
                                    dim=-1)
        n = len(prompt)
        want = [ref[n - 1 + i, t].item() for i, t in enumerate(b.token_ids)]
        assert _max_diff(lb.token_logprobs, want) <= 1e-4
        want = [ref[i - 1, t].item() for i, t in enumerate(prompt) if i]
        assert _max_diff(b.prompt_logprobs.token_logprobs, want) <= 1e-4
