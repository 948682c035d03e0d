"""Tests of kernels/logits_processing.py: temperature, top-k, top-p, min-p edge cases, greedy
rows, order of the filters, a mixed batch row by row, and the validation errors."""

from __future__ import annotations

import math

import pytest
import torch

from specmesh.kernels.logits_processing import expand_to_rows, process_logits, process_logits_ref


def _logits_of(probs: list[float]) -> torch.Tensor:
    """A logits row whose softmax is ``probs`` (0 → -inf)."""
    return torch.tensor([[math.log(p) if p > 0 else -math.inf for p in probs]])


def _f(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _i(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _run(probs: list[float], temperature: float = 1.0, top_k: int | None = None,
         top_p: float | None = None, min_p: float | None = None) -> list[float]:
    out = process_logits_ref(
        _logits_of(probs), _f([temperature]), None if top_k is None else _i([top_k]),
        None if top_p is None else _f([top_p]), None if min_p is None else _f([min_p]))
    assert out.dtype == torch.float32 and out.shape == (1, len(probs))
    return out[0].tolist()


def _close(got: list[float], want: list[float]) -> None:
    total = sum(want)
    assert got == pytest.approx([w / total for w in want], abs=1e-6)


P = [0.4, 0.3, 0.2, 0.1]


def test_no_options_is_softmax() -> None:
    _close(_run(P), P)
    _close(_run(P, top_k=0, top_p=1.0, min_p=0.0), P)  # all disabled
    _close(_run(P, top_k=-1), P)
    _close(_run(P, top_k=4), P)  # k == V
    _close(_run(P, top_k=100), P)  # k > V


def test_temperature_scales_logits() -> None:
    logits = torch.tensor([[1.0, 2.0, -0.5]])
    for t in (0.25, 0.7, 1.0, 3.0):
        out = process_logits_ref(logits, _f([t]))
        torch.testing.assert_close(out, torch.softmax(logits / t, dim=-1))


def test_temperature_zero_is_one_hot_argmax_ignoring_filters() -> None:
    assert _run([0.1, 0.6, 0.3]) != [0.0, 1.0, 0.0]
    assert _run([0.1, 0.6, 0.3], temperature=0.0) == [0.0, 1.0, 0.0]
    assert _run([0.1, 0.6, 0.3], temperature=1e-6, top_k=3, top_p=0.01, min_p=0.9) == [
        0.0, 1.0, 0.0]
    # ties: the first index, like torch.argmax and the target's greedy decode
    out = process_logits_ref(torch.tensor([[1.0, 5.0, 5.0, 2.0]]), _f([0.0]))
    assert out.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_greedy_uses_the_raw_logits_dtype() -> None:
    # two float64 logits that round to the same float32: greedy must see them apart
    logits = torch.tensor([[1.0, 1.0 + 1e-12, 0.0]], dtype=torch.float64)
    out = process_logits_ref(logits, torch.tensor([0.0], dtype=torch.float64))
    assert out.tolist() == [[0.0, 1.0, 0.0]]


def test_top_k() -> None:
    _close(_run(P, top_k=1), [0.4, 0, 0, 0])
    _close(_run(P, top_k=2), [0.4, 0.3, 0, 0])
    _close(_run(P, top_k=3), [0.4, 0.3, 0.2, 0])
    _close(_run([0.1, 0.2, 0.3, 0.4], top_k=2), [0, 0, 0.3, 0.4])  # order in the row irrelevant


def test_top_k_keeps_ties_with_the_kth() -> None:
    out = process_logits_ref(torch.tensor([[3.0, 1.0, 3.0, 2.0, 3.0]]), _f([1.0]), _i([1]))
    assert out[0].tolist() == pytest.approx([1 / 3, 0, 1 / 3, 0, 1 / 3])
    out = process_logits_ref(torch.tensor([[3.0, 2.0, 2.0, 1.0]]), _f([1.0]), _i([2]))
    assert (out[0] > 0).tolist() == [True, True, True, False]


def test_top_p() -> None:
    # ascending cumulative mass [0.1, 0.3, 0.6, 1.0]; removed where <= 1 - top_p
    _close(_run(P, top_p=0.95), P)  # 1-p=0.05: nothing has cum <= 0.05
    _close(_run(P, top_p=0.85), [0.4, 0.3, 0.2, 0])  # removes 0.1 (cum 0.1 <= 0.15)
    _close(_run(P, top_p=0.6), [0.4, 0.3, 0, 0])  # 1-p=0.4: removes cum 0.1, 0.3
    _close(_run(P, top_p=0.3), [0.4, 0, 0, 0])  # 1-p=0.7: removes 0.1, 0.3, 0.6
    _close(_run(P, top_p=1e-6), [0.4, 0, 0, 0])  # the largest always stays
    _close(_run(P, top_p=1.0), P)


def test_top_p_with_a_single_token_of_all_mass() -> None:
    _close(_run([0.0, 1.0, 0.0], top_p=0.5), [0, 1, 0])


def test_min_p() -> None:
    q = [0.5, 0.3, 0.15, 0.05]
    _close(_run(q, min_p=0.2), [0.5, 0.3, 0.15, 0])  # threshold 0.1
    _close(_run(q, min_p=0.5), [0.5, 0.3, 0, 0])  # threshold 0.25
    _close(_run(q, min_p=1.0), [0.5, 0, 0, 0])  # only the max (and its ties)
    _close(_run(q, min_p=0.0), q)


def test_order_temperature_top_k_top_p_min_p() -> None:
    # top-k first renormalizes [0.4, 0.3, 0.2] -> [4/9, 3/9, 2/9]; top-p 0.7 then removes
    # cum 2/9 <= 0.3 only. top-p first (on P) would have removed 0.2 as well (cum 0.3 <= 0.3).
    _close(_run(P, top_k=3, top_p=0.72), [0.4, 0.3, 0, 0])
    _close(_run(P, top_k=3, top_p=0.8), [0.4, 0.3, 0.2, 0])
    # temperature before top-p: t=0.5 squares the ratios: [16, 9, 4, 1]/30
    _close(_run(P, temperature=0.5, top_p=0.9), [16, 9, 4, 0])  # cum 1/30 <= 0.1
    # min-p after top-p: top-p 0.85 leaves [0.4, 0.3, 0.2]; min-p 0.6 removes 0.2 (< 0.24)
    _close(_run(P, top_p=0.85, min_p=0.6), [0.4, 0.3, 0, 0])


def test_inf_logits_and_half_precision() -> None:
    logits = torch.tensor([[-math.inf, 0.0, 1.0, -math.inf]], dtype=torch.bfloat16)
    out = process_logits_ref(logits, _f([1.0]), _i([3]), _f([0.9]), _f([0.1]))
    assert out.dtype == torch.float32
    assert out[0, 0] == 0 and out[0, 3] == 0
    assert out.sum().item() == pytest.approx(1.0)


def _one_row(logits: torch.Tensor, t: float, k: int, p: float, m: float) -> torch.Tensor:
    return process_logits_ref(logits[None], _f([t]), _i([k]), _f([p]), _f([m]))[0]


def test_mixed_batch_equals_rows_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 1000, 12
    logits = torch.randn(rows, vocab, generator=gen) * 3
    temps = [0.0, 1.0, 0.7, 1.3, 0.0, 2.0, 0.5, 1.0, 1.0, 0.9, 1e-6, 1.0]
    ks = [0, 0, 50, 0, 5, 1, 0, 999, 1000, 20, 3, -1]
    ps = [1.0, 0.9, 1.0, 0.5, 0.2, 1.0, 0.95, 0.3, 1.0, 0.8, 1.0, 1.0]
    ms = [0.0, 0.0, 0.1, 0.0, 0.3, 0.0, 0.05, 0.0, 0.2, 0.01, 0.0, 0.0]
    out = process_logits(logits, _f(temps), _i(ks), _f(ps), _f(ms))
    assert out.shape == (rows, vocab) and out.dtype == torch.float32
    torch.testing.assert_close(out.sum(dim=-1), torch.ones(rows))
    for r in range(rows):
        alone = _one_row(logits[r], temps[r], ks[r], ps[r], ms[r])
        torch.testing.assert_close(out[r], alone, atol=1e-7, rtol=1e-6)
        if temps[r] < 1e-5:
            assert out[r].tolist() == torch.nn.functional.one_hot(
                logits[r].argmax(), vocab).float().tolist()
        if 0 < ks[r] < vocab:
            assert int((out[r] > 0).sum()) <= ks[r] or temps[r] < 1e-5
    # a row with every option disabled (k=-1, p=1, min_p=0) is the plain softmax
    plain = torch.softmax(logits[11], dim=-1)
    torch.testing.assert_close(out[11], plain)


def test_input_not_modified() -> None:
    logits = torch.randn(3, 50)
    copy = logits.clone()
    process_logits_ref(logits, _f([0.5, 0.0, 1.0]), _i([5, 5, 5]), _f([0.5] * 3), _f([0.1] * 3))
    assert torch.equal(logits, copy)


def test_expand_to_rows() -> None:
    cu = _i([2, 2, 5])  # counts 2, 0, 3 -> rows 3, 1, 4
    out = expand_to_rows(_f([0.5, 1.0, 0.0]), cu)
    assert out.tolist() == [0.5] * 3 + [1.0] + [0.0] * 4
    assert expand_to_rows(_i([7]), _i([0])).tolist() == [7]
    assert expand_to_rows(_i([]), _i([])).tolist() == []
    with pytest.raises(ValueError):
        expand_to_rows(_i([1, 2]), _i([3, 1]))
    with pytest.raises(ValueError):
        expand_to_rows(_i([1, 2]), _i([3]))


BAD = {
    "temperature-negative": dict(temperature=_f([-0.1])),
    "temperature-nan": dict(temperature=_f([math.nan])),
    "temperature-inf": dict(temperature=_f([math.inf])),
    "temperature-missing": dict(temperature=None),
    "temperature-shape": dict(temperature=_f([1.0, 1.0])),
    "temperature-int": dict(temperature=_i([1])),
    "top-p-zero": dict(top_p=_f([0.0])),
    "top-p-above-one": dict(top_p=_f([1.5])),
    "top-p-nan": dict(top_p=_f([math.nan])),
    "min-p-negative": dict(min_p=_f([-0.1])),
    "min-p-above-one": dict(min_p=_f([1.1])),
    "top-k-float": dict(top_k=_f([2.0])),
    "top-k-shape": dict(top_k=_i([[2]])),
    "logits-1d": dict(logits=torch.zeros(4)),
    "logits-int": dict(logits=torch.zeros(1, 4, dtype=torch.int64)),
    "logits-empty-vocab": dict(logits=torch.zeros(1, 0)),
    "logits-not-tensor": dict(logits=[[0.0, 1.0]]),
}


@pytest.mark.parametrize("change", BAD.values(), ids=BAD.keys())
def test_bad_inputs_raise_value_error(change: dict) -> None:
    args = dict(logits=torch.zeros(1, 4), temperature=_f([1.0]), top_k=None, top_p=None,
                min_p=None)
    args.update(change)
    with pytest.raises(ValueError):
        process_logits(**args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu() -> None:
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 9, 49152
    logits = torch.randn(rows, vocab, generator=gen) * 4
    args = (_f([0.0, 1.0, 0.6, 1.5, 1.0, 0.8, 1.0, 0.0, 2.0]),
            _i([0, 50, 0, 1000, 1, 0, 7, 3, 0]), _f([1.0, 0.9, 0.5, 1.0, 1.0, 0.95, 0.7, 0.1, 1.0]),
            _f([0.0, 0.0, 0.05, 0.1, 0.0, 0.0, 0.2, 0.0, 0.0]))
    cpu = process_logits(logits, *args)
    cuda = process_logits(logits.cuda(), *(a.cuda() for a in args))
    assert cuda.is_cuda
    torch.testing.assert_close(cuda.cpu(), cpu, atol=1e-6, rtol=1e-4)
    assert torch.equal(cuda.cpu()[[0, 7]], cpu[[0, 7]])  # greedy rows exactly
