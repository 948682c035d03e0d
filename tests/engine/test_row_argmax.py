"""engine/row_argmax.py: the same indices as torch.argmax(x, -1) on every CPU float dtype,
ties (first index), NaN rows, -inf rows, one row and many, non-contiguous rows, 1-D input."""

import pytest
import torch

from specmesh.engine.row_argmax import row_argmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_it_equals_torch_argmax(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 4099, generator=g) * 3).to(dtype)
    x[0, 17] = x[0, 4000] = x[0].max() + 1  # a tie: the first index wins
    if rows > 1:
        x[1, 9] = float("nan")
        x[1, 99] = float("nan")
    if rows > 2:
        x[2] = float("-inf")
    got = row_argmax(x)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, torch.argmax(x, dim=-1))
    assert int(got[0]) == 17
    if rows > 1:
        assert int(got[1]) == 9


def test_strided_rows_and_a_single_vector():
    x = torch.randn(8, 300)[:, ::3]  # non-contiguous
    assert torch.equal(row_argmax(x), torch.argmax(x, dim=-1))
    v = torch.randn(300)
    assert int(row_argmax(v)) == int(torch.argmax(v))
    assert row_argmax(v).dim() == 0


def test_integer_rows_and_empty_rows():
    x = torch.randint(0, 5, (4, 50))
    assert torch.equal(row_argmax(x), torch.argmax(x, dim=-1))
    with pytest.raises(ValueError, match="empty"):
        row_argmax(torch.empty(3, 0))
