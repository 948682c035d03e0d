"""RowInvariantLinear (engine/linear.py): nn.Linear's parameters and results, with one-row
bf16 / fp16 inputs computed as two rows."""

import pytest
import torch
from torch import nn

from engine.linear import RowInvariantLinear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_same_parameters_and_results_as_nn_linear(dtype):
    torch.manual_seed(0)
    plain = nn.Linear(64, 48, bias=True).to(dtype)
    ours = RowInvariantLinear(64, 48, bias=True).to(dtype)
    ours.load_state_dict(plain.state_dict())
    assert list(ours.state_dict()) == ["weight", "bias"]
    x = torch.randn(7, 64).to(dtype)
    assert torch.equal(ours(x), plain(x))  # M >= 2: nn.Linear itself
    one = ours(x[:1])
    assert one.shape == (1, 48)
    if dtype == torch.bfloat16:  # computed as the row twice
        assert torch.equal(one, plain(torch.cat([x[:1], x[:1]]))[:1])
    else:
        assert torch.equal(one, plain(x[:1]))
