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


SHORT_QUESTION = "What color is the sky on a clear day? Answer with one word."
EACH_MAX_TOKENS = 16


def _each_parameter_cases(tok, plain: list[list[int]], eos: list[int]) -> dict[str, tuple]:
    """name -> (prompt index, fields) for the penalties and constraints the test above leaves
    out, each on a prompt where it changes the output: prompt 0 is code (repeats its names),
    1 prose, 2 the short answer (ends by EOS before ``EACH_MAX_TOKENS``)."""
    banned = plain[1][2]
    allowed = sorted({t for out in plain for t in out} - {plain[1][3]} | set(eos))
    return {
        "presence_penalty": (0, {"presence_penalty": 2.0}),
        "repetition_penalty": (0, {"repetition_penalty": 1.5}),
        "logit_bias": (1, {"logit_bias_token_ids": [banned, tok.encode(" purple")[0]],
                           "logit_bias_values": [-100.0, 4.0]}),
        "min_tokens": (2, {"min_tokens": EACH_MAX_TOKENS}),
        "allowed_token_ids": (1, {"allowed_token_ids": allowed}),
    }


def test_each_parameter_on_smollm2_speculation_on_equals_off(smollm2) -> None:
    """presence_penalty, repetition_penalty, logit_bias, min_tokens and allowed_token_ids
    (greedy: the test above covers the seeded rule), batched into one in-process run per k: each
    changes its prompt's output, and speculation at k = 4 and 8 (the oracle drafter of the
    speculation-off output, drafts of every request accepted) equals speculation off token for
    token."""
    loaded, chats = smollm2
    tok, eos = loaded.tokenizer, list(loaded.config.eos_token_ids)
    prompts = chats + [chat_prompt_ids(tok, [{"role": "user", "content": SHORT_QUESTION}])]
    base = SamplingParams(max_tokens=EACH_MAX_TOKENS)
    plain, _ = _generate(loaded, prompts, base, 0)
    assert plain[2][-1] in eos  # the short answer stops by itself
    cases = _each_parameter_cases(tok, plain, eos)
    req_prompts = [prompts[p] for p, _ in cases.values()]
    params = [msgspec.structs.replace(base, **fields) for _, fields in cases.values()]
    off, _ = _generate(loaded, req_prompts, params, 0)
    for (name, (p, _)), out in zip(cases.items(), off):
        assert out != plain[p], f"{name} changes nothing"
    held = off[list(cases).index("min_tokens")]  # EOS masked to the end
    assert len(held) == EACH_MAX_TOKENS and not set(held) & set(eos)
    for k in (4, 8):
        c = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=k,
                             eos_token_ids=loaded.config.eos_token_ids, num_kv_blocks=256,
                             proposer=OracleProposer(req_prompts, off))
        res = c.generate(req_prompts, params)
        for name, r, want in zip(cases, res, off):
            assert r.token_ids == want, (name, k)
            assert r.spec.num_accepted_tokens > 0, (name, k)
