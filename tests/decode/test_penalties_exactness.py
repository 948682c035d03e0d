"""Penalties and token constraints through the three in-process workers (tiny random Llama,
float64, real encoded messages; issue 33 item 3): for each of ``presence_penalty``,
``frequency_penalty``, ``repetition_penalty``, ``logit_bias``, ``min_tokens``, ``bad_words``
and ``allowed_token_ids``, greedy and seeded, the output

- differs from the same request without the parameter (the case is not vacuous),
- equals a plain Hugging Face decode that applies the parameter by hand at every position
  (tests/helpers/penalties.py), with speculation off,
- and is the same token for token with speculation on at k = 4 and k = 8 (an oracle drafter
  of the expected output: drafts accepted > 0 asserted; a garbage drafter: drafts rejected).

The verify step's processed rows equal processing each position on its own
(:func:`test_verify_step_rows_equal_position_by_position`)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from helpers.models import hf_greedy, tiny_llama
from helpers.penalties import penalized_reference
from helpers.proposers import GarbageProposer, OracleProposer, TreeOracleProposer
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.decode.request import Request
from specmesh.decode.scheduler import PlannedRequest
from specmesh.decode.verify_step import _apply_penalties
from specmesh.engine.logits_processors import RowsHistory, apply_logits_processors
from specmesh.protocol.messages import SamplingParams

VOCAB = 96
MAX_TOKENS = 16
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7]


@pytest.fixture(scope="module")
def tiny():
    hf, model, cfg = tiny_llama(seed=1, dtype=torch.float64, vocab_size=VOCAB)
    return hf, model, cfg, hf_greedy(hf, PROMPT, MAX_TOKENS)


def _cases(plain: list[int]) -> dict[str, dict]:
    """Each parameter with a value that changes the plain greedy output ``plain``."""
    return {
        "presence_penalty": {"presence_penalty": 2.0},
        "frequency_penalty": {"frequency_penalty": 1.5},
        "repetition_penalty": {"repetition_penalty": 1.9},
        "logit_bias": {"logit_bias_token_ids": [plain[0], plain[2]],
                       "logit_bias_values": [-100.0, -50.0]},
        "bad_words": {"bad_words_token_ids": [[plain[1], plain[2]], [plain[4]]]},
        "allowed_token_ids": {"allowed_token_ids": [t for t in range(0, VOCAB, 3)
                                                    if t != plain[0]]},
    }


MODES = {"greedy": {}, "seeded": {"temperature": 0.8, "seed": 7}}


def _run(model, cfg, sp: SamplingParams, k: int, proposer=None, eos=()) -> tuple[list[int], object]:
    c = InProcessCluster(model, cfg, num_speculative_tokens=k, num_kv_blocks=256, block_size=4,
                         proposer=proposer, eos_token_ids=eos)
    (r,) = c.generate([PROMPT], sp)
    return r.token_ids, c.verifier.stats


def _check(hf, model, cfg, sp: SamplingParams, without: SamplingParams, eos=()) -> None:
    want = penalized_reference(hf, PROMPT, sp, eos)
    assert want != penalized_reference(hf, PROMPT, without, eos), "the parameter changes nothing"
    off, _ = _run(model, cfg, sp, 0, eos=eos)
    assert off == want
    for k in (4, 8):
        on, st = _run(model, cfg, sp, k, OracleProposer([PROMPT], [want]), eos)
        assert on == want, k
        assert st.num_accepted_tokens > 0 and st.num_draft_tokens > 0, k
    on, st = _run(model, cfg, sp, 4, GarbageProposer(VOCAB, seed=5), eos)
    assert on == want
    assert st.num_draft_tokens > st.num_accepted_tokens


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(_cases([0] * 8)))
def test_parameter_with_speculation_equals_plain_decode(tiny, name, mode) -> None:
    hf, model, cfg, plain = tiny
    without = SamplingParams(max_tokens=MAX_TOKENS, **MODES[mode])
    sp = msgspec.structs.replace(without, **_cases(plain)[name])
    _check(hf, model, cfg, sp, without)


@pytest.mark.parametrize("mode", list(MODES))
def test_min_tokens_keeps_eos_away(tiny, mode) -> None:
    """The verifier's EOS (here the plain output's third token) ends the request early; with
    ``min_tokens`` it is masked (at the prefill worker's first token too) until that many
    output tokens exist, with speculation on as off."""
    hf, model, cfg, plain = tiny
    without = SamplingParams(max_tokens=MAX_TOKENS, **MODES[mode])
    eos = (plain[2],) if mode == "greedy" else tuple(
        penalized_reference(hf, PROMPT, without)[:2])
    sp = msgspec.structs.replace(without, min_tokens=10)
    _check(hf, model, cfg, sp, without, eos)
    out, _ = _run(model, cfg, sp, 4, eos=eos)
    assert len(out) >= 10 and not set(out[:10]) & set(eos)


def test_combined_parameters_with_a_mixed_batch(tiny) -> None:
    """All parameters at once, next to a request without any, in one batch, k = 4 with an
    oracle drafter (whose drafts for the plain request are mostly wrong): each request equals
    its reference."""
    hf, model, cfg, plain = tiny
    full = SamplingParams(max_tokens=MAX_TOKENS, presence_penalty=0.5, frequency_penalty=0.3,
                          repetition_penalty=1.2, logit_bias_token_ids=[plain[3]],
                          logit_bias_values=[-3.0], min_tokens=3, stop_token_ids=[plain[1]],
                          bad_words_token_ids=[[plain[0], plain[1]]],
                          allowed_token_ids=list(range(1, VOCAB, 2)) + [plain[0]])
    params = [full, SamplingParams(max_tokens=MAX_TOKENS),
              msgspec.structs.replace(full, temperature=1.0, seed=3)]
    prompts = [PROMPT, PROMPT, [11, 12, 11, 12, 11, 12]]
    want = [penalized_reference(hf, p, sp) for p, sp in zip(prompts, params)]
    c = InProcessCluster(model, cfg, num_speculative_tokens=4, num_kv_blocks=256, block_size=4,
                         proposer=OracleProposer(prompts, want))
    assert [r.token_ids for r in c.generate(prompts, params)] == want
    assert want[0] != want[1] and c.verifier.stats.num_accepted_tokens > 0


def test_verify_step_rows_equal_position_by_position() -> None:
    """The verify step's rows (chains and a tree, two requests) equal each position processed
    alone with the output committed plus the drafts before it."""
    gen = torch.Generator().manual_seed(0)
    s = SamplingParams(max_tokens=64, presence_penalty=0.7, frequency_penalty=0.4,
                       repetition_penalty=1.5, min_tokens=4, eos_token_ids=[2],
                       bad_words_token_ids=[[3, 4]], logit_bias_token_ids=[5],
                       logit_bias_values=[2.0])
    a = Request("a", "g", [1, 3, 9], s, 4, output_token_ids=[3, 4])
    b = Request("b", "g", [7], msgspec.structs.replace(s, presence_penalty=-1.0), 4,
                output_token_ids=[3])
    plan = [PlannedRequest(a, [3, 4, 3]), PlannedRequest(b, [3, 4, 4], parents=[-1, 0, 0])]
    logits = torch.randn(8, 12, generator=gen)
    got = logits.clone()
    _apply_penalties(plan, got)
    histories = [[3, 4], [3, 4, 3], [3, 4, 3, 4], [3, 4, 3, 4, 3],
                 [3], [3, 3], [3, 3, 4], [3, 3, 4]]
    for row, (req, out) in enumerate(zip([a] * 4 + [b] * 4, histories)):
        want = apply_logits_processors(logits[row:row + 1].clone(), [
            RowsHistory(req.sampling, req.prompt_token_ids, out, 0)])
        assert torch.equal(got[row:row + 1], want), row
    assert not torch.equal(got, logits)


@pytest.mark.parametrize("mode", list(MODES))
def test_model_drafter_drafts_from_the_processed_distribution(tiny, mode) -> None:
    """The draft-model proposer drafting with the target itself processes its draft logits
    with the request's penalties and constraints, each draft with the drafts before it: every
    draft is accepted (greedy and seeded), and the output is the reference's. Left raw, its
    drafts would miss wherever a penalty changes the argmax."""
    from specmesh.drafter.proposers.draft_model import DraftModelProposer

    hf, model, cfg, plain = tiny
    sp = SamplingParams(max_tokens=MAX_TOKENS, frequency_penalty=0.8, presence_penalty=0.5,
                        repetition_penalty=1.3, bad_words_token_ids=[[plain[1], plain[2]]],
                        logit_bias_token_ids=[plain[0]], logit_bias_values=[-100.0],
                        min_tokens=6, eos_token_ids=[plain[3]], **MODES[mode])
    want = penalized_reference(hf, PROMPT, sp, (plain[3],))
    proposer = DraftModelProposer(dtype="float64", loaded=model, num_blocks=128, block_size=4)
    c = InProcessCluster(model, cfg, num_speculative_tokens=4, num_kv_blocks=256, block_size=4,
                         proposer=proposer, draft_method="draft_model",
                         eos_token_ids=(plain[3],))
    (r,) = c.generate([PROMPT], sp)
    assert r.token_ids == want
    st = c.verifier.stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens == st.num_draft_tokens


@pytest.mark.parametrize("mode", list(MODES))
def test_tree_drafts_see_their_own_path(tiny, mode) -> None:
    """Draft trees whose right path is a side branch (branch 0 wrong): each node's row is
    processed with the drafts on its own path, so the accepted path equals plain decode."""
    hf, model, cfg, plain = tiny
    # negative penalties favour what a row's history holds: a row that also saw the wrong
    # branch would favour its tokens
    sp = SamplingParams(max_tokens=MAX_TOKENS, frequency_penalty=-1.5, presence_penalty=-1.0,
                        bad_words_token_ids=[[plain[1], plain[2]]], **MODES[mode])
    want = penalized_reference(hf, PROMPT, sp)
    c = InProcessCluster(model, cfg, num_speculative_tokens=3, num_kv_blocks=256, block_size=4,
                         proposer=TreeOracleProposer([PROMPT], [want], VOCAB))
    (r,) = c.generate([PROMPT], sp)
    assert r.token_ids == want
    st = c.verifier.stats
    assert st.num_tree_verify_steps > 0 and st.num_accepted_tokens > 0
