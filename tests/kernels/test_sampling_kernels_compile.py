"""The synthetic-acceptance and logits-processing kernels compile for CUDA (sm_90) without a
GPU (Triton lowers them to PTX and runs its bundled ptxas), for every logits dtype the
launcher passes: a construct the interpreter accepts but the compiler refuses fails here.
(Logits at a 4,096-wide block: the width changes no construct, and wider blocks take minutes
to compile on a CPU machine, see kernels.logits_processing.MAX_KERNEL_VOCAB.)"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from specmesh.kernels import logits_processing, synthetic_accept

_LOGITS = {"temperature_ptr": "*fp32", "top_k_ptr": "*i64", "top_p_ptr": "*fp32",
           "min_p_ptr": "*fp32", "out_ptr": "*fp32", "vocab": "i32"}
CASES = {
    "synthetic-fp64-cu64": (synthetic_accept._synthetic_accept_kernel,
                            {"draft_ptr": "*i64", "cu_ptr": "*i64", "target_ptr": "*i64",
                             "uniform_ptr": "*fp64", "rates_ptr": "*fp64", "output_ptr": "*i64",
                             "accept_len_ptr": "*i64", "output_width": "i32",
                             "num_rates": "i32"}, {"PLACEHOLDER": -1, "BLOCK": 8}),
    "synthetic-fp32-cu32": (synthetic_accept._synthetic_accept_kernel,
                            {"draft_ptr": "*i64", "cu_ptr": "*i32", "target_ptr": "*i64",
                             "uniform_ptr": "*fp32", "rates_ptr": "*fp32", "output_ptr": "*i64",
                             "accept_len_ptr": "*i64", "output_width": "i32",
                             "num_rates": "i32"}, {"PLACEHOLDER": -1, "BLOCK": 32}),
    **{f"logits-{dt}": (logits_processing._process_logits_kernel,
                        {"logits_ptr": f"*{dt}", **_LOGITS},
                        {"GREEDY_EPS": 1e-5, "FLOAT64": dt == "fp64", "BLOCK_V": 4096})
       for dt in ("fp32", "fp64", "bf16", "fp16")},
}


@pytest.mark.parametrize("name", CASES)
def test_kernel_compiles_for_sm90(name: str) -> None:
    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no NVIDIA backend")
    fn, signature, constexprs = CASES[name]
    if not hasattr(fn, "arg_names"):
        pytest.skip("TRITON_INTERPRET=1: kernels are decorated interpreted")
    signature = {**signature, **{k: "constexpr" for k in constexprs}}
    assert set(signature) == set(fn.arg_names), sorted(set(fn.arg_names) ^ set(signature))
    compiled = triton.compile(ASTSource(fn, signature, constexprs),
                              target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["ptx"]
