"""``n = 4`` on one prompt on the real model (float32, SmolLM2-135M-Instruct, in-process
workers; issue 33 item 2): the four choices are siblings (decode/siblings.py), prefilled once
(the prefill worker's request count); at temperature 0 every choice equals the ``n = 1``
output, and seeded choices (choice i seeded by gateway/n_choices.py ``choice_seed``) equal
the requests with those seeds sent alone, with speculation on (k = 4 and 8, the oracle drafter
of the speculation-off output, drafts accepted) as off."""

from __future__ import annotations

import pytest

from helpers.proposers import OracleProposer
from specmesh.cluster.demo import load_prompts
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.gateway.n_choices import choice_seed
from specmesh.gateway.tokens import chat_prompt_ids
from specmesh.protocol.messages import SamplingParams

pytestmark = pytest.mark.slow

N = 4
MAX_TOKENS = 16
SEED = 33


@pytest.fixture(scope="module")
def smollm2():
    from specmesh.engine.loader import load_model  # the real model: only when these run

    loaded = load_model(None, dtype="float32")
    return loaded, chat_prompt_ids(loaded.tokenizer, load_prompts()[1]["messages"])


def _cluster(loaded, k, proposer=None):
    return InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=k,
                            eos_token_ids=loaded.config.eos_token_ids, num_kv_blocks=256,
                            proposer=proposer)


def test_n_choices_on_smollm2_prefill_once_and_equal_single_requests(smollm2) -> None:
    loaded, prompt = smollm2
    greedy = SamplingParams(max_tokens=MAX_TOKENS)
    seeded = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=choice_seed(SEED, i))
              for i in range(N)]
    # speculation off, each request alone: the n = 1 greedy output and each derived seed's
    alone = [r.token_ids for r in _cluster(loaded, 0).generate([prompt] * (1 + N),
                                                                [greedy] + seeded)]
    assert len({tuple(t) for t in alone[1:]}) > 1  # the derived seeds make the choices differ
    for k in (4, 8):
        c = _cluster(loaded, k, OracleProposer([prompt] * (1 + N), alone))
        res = c.generate([prompt] * (2 * N), [greedy] * N + seeded,
                         groups=["greedy"] * N + ["seeded"] * N)
        assert [r.token_ids for r in res[:N]] == [alone[0]] * N, k
        assert [r.token_ids for r in res[N:]] == alone[1:], k
        assert c.prefill.stats.num_requests == 2, k  # each group's prompt prefilled once
        assert c.verifier.stats.num_sibling_forks == 2 * (N - 1), k
        for i, r in enumerate(res):
            assert r.spec.num_accepted_tokens > 0, (k, i)
