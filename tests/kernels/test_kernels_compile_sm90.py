"""The sampling kernels compile for CUDA (sm_90) without a GPU: Triton lowers them to PTX and
runs its bundled ptxas, so a construct the interpreter accepts but the compiler does not (e.g.
``tl.math.fdiv(ieee_rounding=True)`` on float64, which broke the float64 paths of rejection
sampling and the whole coupled-noise kernel) fails here on a CPU-only machine. The PTX must
hold no approximate division and, where the launcher turns fusion off as these do, no fused
multiply-add (the exactness tests compare bits with torch)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_TREE_SAMPLE = {"draft_ptr": "*i64", "cu_ptr": "*i64", "parents_ptr": "*i64",
                "draft_probs_ptr": "*{dt}", "target_probs_ptr": "*{dt}", "uniform_ptr": "*fp64",
                "noise_ptr": "*{dt}", "scratch_ptr": "*{dt}", "output_ptr": "*i64",
                "accept_len_ptr": "*i64", "node_ids_ptr": "*i64", "output_width": "i32",
                "vocab_size": "i32"}
_REJECTION = {"draft_ptr": "*i64", "cu_ptr": "*i64", "draft_probs_ptr": "*{dt}",
              "target_probs_ptr": "*{dt}", "uniform_ptr": "*fp64", "noise_ptr": "*{dt}",
              "output_ptr": "*i64", "accept_len_ptr": "*i64", "output_width": "i32",
              "vocab_size": "i32"}
_CASES: dict[str, tuple[str, str, dict[str, str], dict[str, Any]]] = {
    "tree-walk": ("specmesh.kernels.tree_walk", "_tree_walk_kernel",
                  {"draft_ptr": "*i64", "cu_ptr": "*i32", "parents_ptr": "*i64",
                   "target_ptr": "*i64", "output_ptr": "*i64", "accept_len_ptr": "*i64",
                   "node_ids_ptr": "*i64", "output_width": "i32"},
                  {"PLACEHOLDER": -1, "BLOCK_D": 8}),
    "tree-sample-fp32-full-per-row": (
        "specmesh.kernels.tree_rejection_sample", "_tree_rejection_sample_kernel",
        {k: v.format(dt="fp32") for k, v in _TREE_SAMPLE.items()},
        {"HAS_DRAFT_PROBS": True, "NOISE_PER_ROW": True, "PLACEHOLDER": -1, "BLOCK_D": 8,
         "BLOCK_V": 4096}),
    "tree-sample-fp64-one-hot": (
        "specmesh.kernels.tree_rejection_sample", "_tree_rejection_sample_kernel",
        {k: v.format(dt="fp64") for k, v in _TREE_SAMPLE.items()},
        {"HAS_DRAFT_PROBS": False, "NOISE_PER_ROW": False, "PLACEHOLDER": -1, "BLOCK_D": 4,
         "BLOCK_V": 1024}),
    "rejection-fp64": ("specmesh.kernels.rejection_sample", "_rejection_sample_kernel",
                       {k: v.format(dt="fp64") for k, v in _REJECTION.items()},
                       {"HAS_DRAFT_PROBS": True, "PLACEHOLDER": -1, "BLOCK": 8,
                        "BLOCK_V": 4096}),
    "block-verify-fp32": ("specmesh.kernels.block_verify", "_block_verify_kernel",
                          {k: v.format(dt="fp32") for k, v in _REJECTION.items()},
                          {"HAS_DRAFT_PROBS": True, "PLACEHOLDER": -1, "BLOCK": 8,
                           "BLOCK_V": 2048}),
    "coupled-noise": ("specmesh.kernels.counter_noise", "_noise_kernel",
                      {"seeds_ptr": "*i64", "positions_ptr": "*i64", "consts_ptr": "*fp64",
                       "out_ptr": "*fp64", "vocab_size": "i32"},
                      {"NUM_COEFFS": 8, "BLOCK_V": 1024}),
    "gumbel-sample-fp32": ("specmesh.kernels.coupled_sample", "_gumbel_sample_kernel",
                           {"probs_ptr": "*fp32", "seeds_ptr": "*i64", "positions_ptr": "*i64",
                            "consts_ptr": "*fp64", "out_ptr": "*i64", "vocab_size": "i32"},
                           {"NUM_COEFFS": 8, "BLOCK_V": 1024}),
}


@pytest.mark.parametrize("name", _CASES)
def test_kernel_compiles_for_sm90(name: str) -> None:
    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no NVIDIA backend")
    module, kernel, signature, constexprs = _CASES[name]
    fn = getattr(importlib.import_module(module), kernel)
    if not hasattr(fn, "arg_names"):
        pytest.skip("TRITON_INTERPRET=1: kernels are decorated interpreted")
    signature = {**signature, **{k: "constexpr" for k in constexprs}}
    assert set(signature) == set(fn.arg_names), sorted(set(fn.arg_names) ^ set(signature))
    fusion = module == "specmesh.kernels.rejection_sample"  # its launcher leaves fusion on
    compiled = triton.compile(ASTSource(fn, signature, constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"enable_fp_fusion": fusion})
    ptx = compiled.asm["ptx"]
    assert "div.full" not in ptx and "div.approx" not in ptx
    assert fusion or "fma.rn.f" not in ptx
