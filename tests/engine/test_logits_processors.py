"""Penalties and token constraints (engine/logits_processors.py, kernels/logits_penalties.py)
against a brute-force reference that processes one row at a time with Python loops over the
vocabulary, written from vLLM's definitions (issue 33 item 3): random requests (hypothesis),
chains and trees of drafts, every parameter alone and all together."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specmesh.engine.logits_processors import (
    RowsHistory, apply_logits_processors, chain_row_drafts, tree_row_drafts,
)
from helpers.penalties import reference_row
from specmesh.protocol.messages import SamplingParams

V = 12


def _tokens(n: int) -> st.SearchStrategy:
    return st.lists(st.integers(0, V - 1), max_size=n)


@st.composite
def sampling_params(draw) -> SamplingParams:
    bias_ids = draw(_tokens(4))
    return SamplingParams(
        max_tokens=64,
        presence_penalty=draw(st.sampled_from([0.0, 0.5, -1.0, 2.0])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.3, -0.7, 1.5])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.6, 2.0])),
        logit_bias_token_ids=bias_ids,
        logit_bias_values=[draw(st.floats(-100, 100)) for _ in bias_ids],
        min_tokens=draw(st.integers(0, 6)),
        stop_token_ids=draw(_tokens(2)),
        eos_token_ids=draw(_tokens(1)),
        ignore_eos=draw(st.booleans()),
        bad_words_token_ids=draw(st.lists(st.lists(st.integers(0, V - 1), min_size=1,
                                                   max_size=3), max_size=3)),
        allowed_token_ids=draw(st.none() | st.lists(st.integers(0, V - 1), min_size=1,
                                                    max_size=6)))


@settings(max_examples=150, deadline=None)
@given(reqs=st.lists(st.tuples(sampling_params(), _tokens(6), _tokens(8), _tokens(4)),
                     min_size=1, max_size=4),
       seed=st.integers(0, 2**31))
def test_batch_of_chains_equals_row_by_row_reference(reqs, seed) -> None:
    """Requests with chains of drafts in one tensor: each row equals the reference on
    prompt + committed output + the drafts before it (a penalty sees every earlier draft)."""
    gen = torch.Generator().manual_seed(seed)
    histories, expected, first = [], [], 0
    rows = sum(len(d) + 1 for *_, d in reqs)
    logits = torch.randn(rows, V, generator=gen) * 3
    for s, prompt, out, drafts in reqs:
        if not prompt:
            prompt = [0]
        histories.append(RowsHistory(s, prompt, out, first, chain_row_drafts(drafts)))
        for i in range(len(drafts) + 1):
            expected.append(reference_row(logits[first + i].tolist(), s, prompt,
                                          out + drafts[:i]))
        first += len(drafts) + 1
    got = apply_logits_processors(logits.clone(), histories)
    want = torch.tensor(expected, dtype=torch.float32)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)],
                               rtol=1e-5, atol=1e-4)


def test_tree_rows_see_their_own_path() -> None:
    """A tree's row 1 + j sees the path to node j only (siblings do not count)."""
    s = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5)
    drafts, parents = [3, 4, 5, 3], [-1, 0, 0, 2]
    rows = tree_row_drafts(drafts, parents)
    assert rows == [[], [3], [3, 4], [3, 5], [3, 5, 3]]
    logits = torch.zeros(5, V)
    got = apply_logits_processors(logits, [RowsHistory(s, [1], [3], 0, rows)])
    assert got[0, 3] == -1.5 and got[1, 3] == -2.5 and got[2, 4] == -1.5
    assert got[2, 5] == 0 and got[3, 5] == -1.5 and got[4, 3] == -3.5


def test_each_parameter_changes_what_it_should() -> None:
    """One parameter at a time on a known row, values worked out by hand."""
    row = torch.tensor([[2.0, -2.0, 1.0, 0.5] + [0.0] * (V - 4)])

    def run(**kw) -> torch.Tensor:
        s = SamplingParams(max_tokens=8, **kw)
        return apply_logits_processors(row.clone(), [RowsHistory(s, [1], [0, 0, 2], 0)])[0]

    assert run(presence_penalty=0.5)[:4].tolist() == [1.5, -2.0, 0.5, 0.5]
    assert run(frequency_penalty=0.5)[:4].tolist() == [1.0, -2.0, 0.5, 0.5]
    assert run(repetition_penalty=2.0)[:4].tolist() == [1.0, -4.0, 0.5, 0.5]  # 1: prompt
    assert run(logit_bias_token_ids=[3, 3], logit_bias_values=[1.0, 2.0])[3] == 3.5
    assert run(min_tokens=4, stop_token_ids=[2])[2] == -math.inf
    assert run(min_tokens=3, stop_token_ids=[2])[2] == 1.0  # 3 output tokens already
    assert run(min_tokens=4, eos_token_ids=[3], ignore_eos=True)[3] == 0.5
    assert run(bad_words_token_ids=[[0, 2, 3]])[3] == -math.inf
    assert run(bad_words_token_ids=[[2, 2, 3]])[3] == 0.5
    out = run(allowed_token_ids=[1, 3])
    assert out[1] == -2.0 and out[3] == 0.5 and torch.isinf(out[[0, 2, 4]]).all()


def test_neutral_requests_and_other_rows_are_untouched() -> None:
    logits = torch.randn(4, V)
    before = logits.clone()
    apply_logits_processors(logits, [RowsHistory(SamplingParams(), [1], [2], 0, [[], [3]])])
    assert torch.equal(logits, before)
    apply_logits_processors(logits, [RowsHistory(SamplingParams(presence_penalty=1.0), [1],
                                                 [2], 2)])
    assert torch.equal(logits[[0, 1, 3]], before[[0, 1, 3]]) and logits[2, 2] == before[2, 2] - 1


def test_contradicting_constraints_never_empty_a_row() -> None:
    """Only EOS allowed under min_tokens: the ban yields (the row keeps EOS), never all -inf."""
    s = SamplingParams(allowed_token_ids=[2], min_tokens=5, eos_token_ids=[2])
    out = apply_logits_processors(torch.zeros(2, V), [RowsHistory(s, [1], [], 0, [[], [3]])])
    assert (out[:, 2] == 0).all() and torch.isneginf(out[:, [0, 1, 3]]).all()


def test_out_of_vocabulary_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="allowed_token_ids"):
        apply_logits_processors(torch.zeros(1, V), [RowsHistory(
            SamplingParams(allowed_token_ids=[V]), [1], [], 0)])
