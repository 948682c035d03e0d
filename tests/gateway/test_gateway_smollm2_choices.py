"""A list of prompts and ``best_of`` on the real model through the gateway (float32,
SmolLM2-135M-Instruct, in-process workers behind the real gateway app; issue 33 item 2): with
speculation on (k = 4 and 8, an oracle drafter of the speculation-off outputs, drafts accepted)
the choices equal speculation off token for token, and each equals its request alone."""

from __future__ import annotations

import pytest

from helpers.proposers import OracleProposer
from helpers.served_gateway import ServedGateway
from specmesh.gateway.n_choices import choice_seed

pytestmark = pytest.mark.slow

PROMPTS = ["The three primary colors are", "def fibonacci(n):\n    ", "Paris is the capital of"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served():
    from specmesh.engine.loader import load_model  # the real model: only when these run

    loaded = load_model(None, dtype="float32")
    oracle = OracleProposer([], [])
    s = ServedGateway(loaded, num_speculative_tokens=8, proposer=oracle, max_model_len=2048,
                      default_max_tokens=MAX_TOKENS)
    s.tok, s.oracle = loaded.tokenizer, oracle
    yield s
    s.close()


def _post(served, **body) -> dict:
    r = served.client.post("/v1/completions", json={"max_tokens": MAX_TOKENS,
                                                    "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _teach(served, prompt: str, ids: list[int]) -> None:
    """The oracle drafts ``ids`` after ``prompt`` (what speculation off produced)."""
    served.oracle.seqs.append(list(served.tok(prompt)["input_ids"]) + ids)


def test_a_list_of_prompts_on_smollm2(served):
    off = _post(served, prompt=PROMPTS, temperature=0, num_speculative_tokens=0)
    alone = [_post(served, prompt=p, temperature=0, num_speculative_tokens=0)
             for p in PROMPTS]
    got = [ch["token_ids"] for ch in sorted(off["choices"], key=lambda c: c["index"])]
    assert got == [a["choices"][0]["token_ids"] for a in alone]
    assert len({tuple(g) for g in got}) == len(PROMPTS)  # each prompt its own output
    for p, ids in zip(PROMPTS, got):
        _teach(served, p, ids)
    for k in (4, 8):
        on = _post(served, prompt=PROMPTS, temperature=0, num_speculative_tokens=k)
        assert [ch["token_ids"] for ch in sorted(on["choices"], key=lambda c: c["index"])] \
            == got, k
        assert on["spec_stats"]["num_accepted_tokens"] > 0, k


def test_best_of_on_smollm2(served):
    body = {"prompt": PROMPTS[0], "temperature": 1.0, "seed": 7, "best_of": 3, "n": 1,
            "logprobs": 0}
    off = _post(served, num_speculative_tokens=0, **body)
    cands = [_post(served, num_speculative_tokens=0, **{**body, "best_of": 1, "seed": s})
             for s in _seeds(7, 3)]
    lps = [c["choices"][0]["logprobs"]["token_logprobs"] for c in cands]
    means = [sum(x) / len(x) for x in lps]
    best = max(range(3), key=lambda j: (means[j], -j))
    assert off["choices"][0]["token_ids"] == cands[best]["choices"][0]["token_ids"]
    assert len({tuple(c["choices"][0]["token_ids"]) for c in cands}) > 1  # a real choice
    for c in cands:
        _teach(served, PROMPTS[0], c["choices"][0]["token_ids"])
    for k in (4, 8):
        on = _post(served, num_speculative_tokens=k, **body)
        assert on["choices"][0]["token_ids"] == off["choices"][0]["token_ids"], k
        assert on["spec_stats"]["num_accepted_tokens"] > 0, k


def _seeds(seed: int, count: int) -> list[int]:
    return [choice_seed(seed, j) for j in range(count)]
