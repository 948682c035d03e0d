"""The GGUF block matmul kernel (kernels/gguf_matmul.py): its weights equal gguf-py's
dequantization bit for bit, its products match the torch reference on odd shapes, and each row
of a product is the same bits whatever the other rows, the row count and the threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specmesh.kernels import gguf_matmul
from specmesh.kernels.gguf_matmul import BlockWeight, dequantize_compiled, gguf_matmul as matmul, \
    matmul_ref
from helpers.kernels import loads_with_a_failing_compiler


def _raw(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random GGUF blocks [n, k/32 * block bytes] with f16 scales/mins of mixed sign and size."""
    rng = np.random.default_rng(seed)
    _, block_bytes, quant_bytes = gguf_matmul.FORMATS[fmt]
    raw = rng.integers(0, 256, size=(n, k // 32, block_bytes), dtype=np.uint8)
    scales = (rng.standard_normal((n, k // 32, 2)) * np.exp(rng.uniform(-9, 0, (n, k // 32, 2))))
    raw[..., :4 if fmt == "Q4_1" else 2] = scales.astype(np.float16)[..., :2 if fmt == "Q4_1"
                                                                      else 1].view(np.uint8)
    return raw.reshape(n, -1)


def _gguf_py_dequant(fmt: str, raw: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(raw, GGMLQuantizationType[fmt]).astype(np.float32)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_weights_equal_gguf_py_dequantization_bit_for_bit(fmt):
    raw = _raw(fmt, 37, 96)
    weight = BlockWeight.from_gguf(fmt, torch.from_numpy(raw))
    want = torch.from_numpy(_gguf_py_dequant(fmt, raw)).reshape(37, 96)
    assert torch.equal(weight.dequantize(), want)
    assert torch.equal(dequantize_compiled(weight), want)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", [(1, 32), (5, 96), (67, 64), (130, 576)])
def test_products_match_the_reference_and_rows_do_not_depend_on_the_call(fmt, n, k):
    weight = BlockWeight.from_gguf(fmt, torch.from_numpy(_raw(fmt, n, k, seed=n + k)))
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(70, k, generator=gen)
    full = matmul(x, weight)
    dense = weight.dequantize().double()
    exact = x.double() @ dense.T
    # float32 summation of k terms: within k * 2^-24 of sum |x * w| (each step rounds once)
    bound = k * 2.0 ** -24 * (x.double().abs() @ dense.abs().T) + 1e-30
    assert ((full.double() - exact).abs() <= bound).all()
    assert ((matmul_ref(x, weight).double() - exact).abs() <= bound).all()  # the same bound
    # row counts on both sides of the register path (<= 8 rows) and the tile path (> 8)
    for rows in (1, 2, 3, 5, 8, 9, 17, 33):
        for start in (0, 70 - rows):
            assert torch.equal(matmul(x[start:start + rows], weight), full[start:start + rows])


def test_rows_do_not_depend_on_the_thread_count():
    weight = BlockWeight.from_gguf("Q4_1", torch.from_numpy(_raw("Q4_1", 257, 160)))
    x = torch.randn(12, 160)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [matmul(x[:r], weight) for r in (1, 5, 12)]
        torch.set_num_threads(2)
        two = [matmul(x[:r], weight) for r in (1, 5, 12)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_stacked_and_reordered_weights_compute_their_rows():
    a = BlockWeight.from_gguf("Q4_1", torch.from_numpy(_raw("Q4_1", 24, 64, seed=1)))
    b = BlockWeight.from_gguf("Q4_1", torch.from_numpy(_raw("Q4_1", 8, 64, seed=2)))
    x = torch.randn(3, 64)
    both = matmul(x, BlockWeight.cat([a, b]))
    assert torch.equal(both, torch.cat([matmul(x, a), matmul(x, b)], dim=1))
    order = torch.randperm(24)
    assert torch.equal(matmul(x, a.take_rows(order)), matmul(x, a)[:, order])
    with pytest.raises(ValueError, match="one format and input size"):
        other = BlockWeight.from_gguf("Q8_0", torch.from_numpy(_raw("Q8_0", 4, 64)))
        BlockWeight.cat([a, other])


def test_bad_inputs_are_clear_errors():
    weight = BlockWeight.from_gguf("Q8_0", torch.from_numpy(_raw("Q8_0", 4, 64)))
    with pytest.raises(ValueError, match=r"float32 CPU \[M, 64\]"):
        matmul(torch.randn(2, 32), weight)
    with pytest.raises(ValueError, match="float32 CPU"):
        matmul(torch.randn(2, 64, dtype=torch.float64), weight)
    with pytest.raises(ValueError, match="no kernel for GGUF format Q4_K"):
        BlockWeight.from_gguf("Q4_K", torch.zeros(2, 144, dtype=torch.uint8))
    with pytest.raises(ValueError, match="whole 34-byte blocks of uint8"):
        BlockWeight.from_gguf("Q8_0", torch.zeros(2, 35, dtype=torch.uint8))


def test_an_unavailable_kernel_says_so(monkeypatch):
    monkeypatch.setattr(gguf_matmul.KERNEL, "lib", None)  # as in a process that could not build
    monkeypatch.setattr(gguf_matmul.KERNEL, "failed", "no C++ compiler")
    assert not gguf_matmul.available()
    with pytest.raises(RuntimeError, match="not available: no C"):
        weight = BlockWeight.from_gguf("Q8_0", torch.from_numpy(_raw("Q8_0", 4, 64)))
        matmul(torch.randn(1, 64), weight)


def test_build_failure_falls_back_with_a_warning(monkeypatch, tmp_path, caplog):
    assert not loads_with_a_failing_compiler(gguf_matmul.KERNEL, monkeypatch, tmp_path, caplog)
    assert "keeping dense float32 weights" in caplog.text
    assert list(tmp_path.iterdir()) == []
