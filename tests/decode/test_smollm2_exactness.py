"""Exactness on the real model (float32, SmolLM2-135M-Instruct): speculative greedy through the
in-process workers equals Hugging Face ``generate(do_sample=False)`` token for token, or differs
only at a reported position whose top-2 logit margin is below 1e-4
(docs/architecture.md, 'Exactness')."""

from __future__ import annotations

import pytest
import torch

from specmesh.gateway.tokens import chat_prompt_ids
from specmesh.cluster.demo import load_prompts
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.engine.loader import load_model
from helpers.models import hf_reference_model
from helpers.models import hf_greedy
from specmesh.protocol.messages import SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 40
MARGIN = 1e-4


@pytest.fixture(scope="module")
def smollm2():
    loaded = load_model(None, dtype="float32")
    hf = hf_reference_model(None, dtype="float32")
    return loaded, hf


def _margin(hf, ids, prefix):
    """Top-2 logit margin of the target at the first output position after ``prefix``."""
    with torch.inference_mode():
        logits = hf(torch.tensor([ids + prefix])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("k", [4])
def test_speculative_equals_hf_generate_on_real_prompts(smollm2, k):
    loaded, hf = smollm2
    tok, eos = loaded.tokenizer, loaded.config.eos_token_ids
    prompts = load_prompts()
    assert len(prompts) >= 8
    ids = [chat_prompt_ids(tok, p["messages"]) for p in prompts]
    cluster = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=k,
                               eos_token_ids=eos, num_kv_blocks=256)
    outs = cluster.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
    report = []
    for p, prompt_ids, out in zip(prompts, ids, outs):
        want = hf_greedy(hf, prompt_ids, MAX_TOKENS, eos)
        got = out.token_ids
        if got == want:
            continue
        i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        margin = _margin(hf, prompt_ids, want[:i])
        report.append((p["name"], i, margin))
        assert margin < MARGIN, f"{p['name']}: diverged at output position {i}, margin {margin}"
    print(f"\ndivergences (name, position, top-2 margin): {report or 'none'}")
    st = cluster.verifier.stats
    print(f"drafted {st.num_draft_tokens}, accepted {st.num_accepted_tokens}, "
          f"mean accept length {st.mean_accept_len:.2f}")
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0
