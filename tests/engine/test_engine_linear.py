"""RowInvariantLinear (engine/linear.py): nn.Linear's parameters and results, with one-row
bf16 / fp16 inputs computed as two rows, and inference on prepacked oneDNN weights where the
layer's CPU backend has them on."""

import pytest
import torch
from torch import nn

from helpers.backends import backend
from specmesh.engine import onednn
from specmesh.engine.linear import RowInvariantLinear

PACKED = backend(prepacked_linear=True)  # on wherever torch has oneDNN, whatever the env says


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


needs_onednn = pytest.mark.skipif(not onednn.available(), reason="torch without oneDNN")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_inference_runs_on_a_prepacked_weight_whose_rows_do_not_depend_on_the_call(dtype, bias):
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bf16 on this CPU (F.linear is used there)")
    torch.manual_seed(0)
    # in_features 1536 / 2048: sizes where a one-row oneDNN call takes a kernel whose last
    # bits differ (measured); the two-row rule must hide it
    for n_in, n_out in [(64, 48), (1536, 576), (2048, 320)]:
        ours = RowInvariantLinear(n_in, n_out, bias=bias, backend=PACKED).to(dtype)
        x = torch.randn(33, n_in).to(dtype)
        with torch.no_grad():
            full = ours(x)
            assert ours._packed is not None  # the prepacked path is the one under test
            for rows in (1, 2, 3, 5, 16):
                assert torch.equal(ours(x[:rows]), full[:rows]), (n_in, rows)
            plain = torch.nn.functional.linear(x.double(), ours.weight.double(),
                                               None if ours.bias is None else ours.bias.double())
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(full.double(), plain, rtol=tol, atol=tol)


@needs_onednn
def test_the_pack_follows_the_weight():
    torch.manual_seed(0)
    ours = RowInvariantLinear(32, 16, bias=True, backend=PACKED).to(torch.bfloat16)
    x = torch.randn(4, 32).to(torch.bfloat16)
    with torch.no_grad():
        before = ours(x)
        other = nn.Linear(32, 16, bias=True).to(torch.bfloat16)
        ours.load_state_dict(other.state_dict())  # in-place copy: same tensors, new versions
        after = ours(x)
        assert not torch.equal(before, after)
        torch.testing.assert_close(after.float(), other(x).float(), rtol=2e-2, atol=2e-2)
        ours.weight.mul_(0)  # an in-place update repacks too
        assert torch.equal(ours(x), ours.bias.expand(4, 16))
        ours.float()  # another dtype: a new pack of the new tensor
        assert ours(x.float()).dtype == torch.float32 and ours._packed.dtype == torch.float32


@needs_onednn
def test_training_and_a_backend_without_packs_keep_nn_linear():
    from specmesh.engine.linear import FusedLinears, prepack

    torch.manual_seed(0)
    plain = nn.Linear(24, 8)
    ours = RowInvariantLinear(24, 8, backend=PACKED)
    ours.load_state_dict(plain.state_dict())
    x = torch.randn(5, 24)
    ours(x).sum().backward()  # autograd: F.linear, gradients flow
    assert ours.weight.grad is not None and ours._packed is None
    with torch.no_grad():
        assert ours(x).shape == (5, 8) and ours._packed is not None
    off = backend(prepacked_linear=False)
    unpacked = RowInvariantLinear(24, 8, backend=off)
    unpacked.load_state_dict(plain.state_dict())
    group = FusedLinears(RowInvariantLinear(24, 4, backend=off),
                         RowInvariantLinear(24, 4, backend=off))
    with torch.no_grad():  # prepacked_linear off: F.linear, never a pack
        assert torch.equal(unpacked(x), plain(x)) and unpacked._packed is None
        assert group.joint(x) is None and group.pack_for(x) is None
        assert prepack(nn.Sequential(unpacked, *group.linears)) == 0


@needs_onednn
@pytest.mark.parametrize("bias", ["none", "all", "mixed"])
def test_fused_linears_compute_their_layers_in_one_product(bias):
    """FusedLinears (q/k/v, gate/up): one product on one pack, split per layer; each output
    row-invariant and of its layer's shape, packed once by prepack (the layers' own packs stay
    unused); with a bias on some layers only, or under autograd, each layer runs alone."""
    from specmesh.engine.linear import FusedLinears, prepack

    torch.manual_seed(0)
    layers = [RowInvariantLinear(96, n, bias=(bias == "all" or (bias == "mixed" and i == 0)),
                                 backend=PACKED) for i, n in enumerate((64, 32, 32))]
    group = FusedLinears(*layers)
    model = nn.Sequential(*layers)
    assert prepack(model) == (0 if bias == "mixed" else 1)
    assert all(lin._pack_cache.packed is None for lin in layers)  # the group's pack only
    assert all((lin._packed is None) == (bias == "mixed") for lin in layers)
    x = torch.randn(9, 96)
    with torch.no_grad():
        outs = group(x)
        alone = [lin(x) for lin in layers]
        one = group(x[:1])
    assert [o.shape for o in outs] == [(9, 64), (9, 32), (9, 32)]
    for o, a, r in zip(outs, alone, one):
        torch.testing.assert_close(o, a, rtol=1e-5, atol=1e-5)
        assert torch.equal(r, o[:1])  # a row alone = the same row among others
    with torch.no_grad():
        assert (group.pack_for(x) is None) == (bias == "mixed")
    with torch.enable_grad():
        x.requires_grad_(True)
        grads = group(x)
        assert all(g.requires_grad for g in grads)  # autograd: the layers' own F.linear
        assert torch.equal(grads[1], layers[1](x))
