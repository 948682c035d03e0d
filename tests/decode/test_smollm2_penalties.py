"""Penalties and token constraints on the real model (float32, SmolLM2-135M-Instruct, in-process
workers; issue 33 item 3): ``frequency_penalty`` (a count over every accepted draft) and
``bad_words`` (a multi-token word across drafts), greedy and seeded, on chat prompts: each
changes the output, and speculation at k = 4 and k = 8 (an oracle drafter of the
speculation-off output, drafts accepted; the n-gram drafter) equals speculation off token for
token."""

from __future__ import annotations

import msgspec
import pytest

from helpers.proposers import OracleProposer
from specmesh.cluster.demo import load_prompts
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.engine.loader import load_model
from specmesh.gateway.penalties import bad_words_token_ids
from specmesh.gateway.tokens import chat_prompt_ids
from specmesh.protocol.messages import SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
MODES = {"greedy": {}, "seeded": {"temperature": 0.7, "seed": 1234}}


@pytest.fixture(scope="module")
def smollm2():
    loaded = load_model(None, dtype="float32")
    prompts = [chat_prompt_ids(loaded.tokenizer, p["messages"]) for p in load_prompts()[:2]]
    return loaded, prompts


def _generate(loaded, prompts, sp, k, proposer=None):
    c = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=k,
                         eos_token_ids=loaded.config.eos_token_ids, num_kv_blocks=256,
                         proposer=proposer)
    return [r.token_ids for r in c.generate(prompts, sp)], c.verifier.stats


@pytest.mark.parametrize("mode", list(MODES))
def test_penalties_on_smollm2_speculation_on_equals_off(smollm2, mode) -> None:
    loaded, prompts = smollm2
    tok = loaded.tokenizer
    base = SamplingParams(max_tokens=MAX_TOKENS, **MODES[mode])
    plain, _ = _generate(loaded, prompts, base, 0)
    word = tok.decode(plain[0][4:6]).strip() or "the"
    cases = {
        "frequency_penalty": {"frequency_penalty": 1.2},
        "bad_words": {"bad_words_token_ids": bad_words_token_ids(tok, [word], len(tok))},
    }
    for name, fields in cases.items():
        sp = msgspec.structs.replace(base, **fields)
        off, _ = _generate(loaded, prompts, sp, 0)
        assert off != plain, f"{name} changes nothing"
        for k in (4, 8):
            on, st = _generate(loaded, prompts, sp, k, OracleProposer(prompts, off))
            assert on == off, (name, k)
            assert st.num_accepted_tokens > 0, (name, k)
        on, _ = _generate(loaded, prompts, sp, 4)
        assert on == off, (name, "ngram")
