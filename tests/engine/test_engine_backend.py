"""The CPU backend (engine/backend.py): every choice decided once from detected features and
explicit overrides, with its reason; overrides parsed from text and from the environment."""

from __future__ import annotations

import pytest

from specmesh.engine.backend import (
    CHOICES,
    BackendOverrides,
    CpuBackend,
    CpuFeatures,
    cpu_backend,
    cpu_model_name,
    decide,
    default_backend,
    read_overrides,
)

#: an AVX2 machine with a compiler and torch's oneDNN: everything can run
FULL = CpuFeatures(model_name="test cpu", flags=frozenset({"avx2", "fma", "sse4_2"}),
                   num_cores=4, compiler="/usr/bin/g++", onednn=True, machine="x86_64")


def _on(backend: CpuBackend) -> dict[str, bool]:
    return {name: c.on for name, c in backend.choices().items()}


def test_a_machine_with_everything_turns_every_choice_on():
    b = decide(FULL)
    assert _on(b) == dict.fromkeys(CHOICES, True)
    assert "g++" in b.cpu_attention.why and "avx2 and fma" in b.gguf_matmul.why
    assert b.features is FULL and b.overrides == BackendOverrides()
    assert b.summary() == " ".join(f"{n}=on" for n in CHOICES)
    assert b.layer_ops.dtypes == ("float32",) and "bfloat16" in b.prepacked_linear.dtypes


def test_no_compiler_turns_off_every_compiled_kernel_and_what_needs_them():
    b = decide(CpuFeatures(flags=FULL.flags, compiler=None, onednn=True))
    assert _on(b) == {"prepacked_linear": True, "gguf_matmul": False, "cpu_attention": False,
                      "layer_ops": False, "compiled_stack": False, "eagle_q8_0": False}
    assert "no C++ compiler" in b.cpu_attention.why and "no C++ compiler" in b.layer_ops.why
    assert "needs layer_ops, gguf_matmul, cpu_attention" in b.compiled_stack.why
    assert "needs gguf_matmul" in b.eagle_q8_0.why


def test_a_cpu_without_avx2_and_fma_has_no_gguf_matmul_but_keeps_the_other_kernels():
    b = decide(CpuFeatures(flags=frozenset({"sse4_2", "avx"}), compiler="c++", onednn=True))
    assert not b.gguf_matmul.on and "lacks avx2 and fma" in b.gguf_matmul.why
    assert b.cpu_attention.on and b.layer_ops.on
    assert not b.compiled_stack.on and not b.eagle_q8_0.on
    only_fma = decide(CpuFeatures(flags=frozenset({"avx2"}), compiler="c++"))
    assert "lacks fma" in only_fma.gguf_matmul.why


def test_torch_without_onednn_has_no_prepacked_products():
    b = decide(CpuFeatures(flags=FULL.flags, compiler="g++", onednn=False))
    assert not b.prepacked_linear.on and "no oneDNN" in b.prepacked_linear.why
    assert b.compiled_stack.on  # the compiled kernels do not need oneDNN


@pytest.mark.parametrize("name", CHOICES)
def test_an_override_switches_one_choice_off_and_says_so(name):
    b = decide(FULL, BackendOverrides(**{name: False}))
    off = {n for n, on in _on(b).items() if not on}
    dependants = {"gguf_matmul": {"compiled_stack", "eagle_q8_0"},
                  "cpu_attention": {"compiled_stack"}, "layer_ops": {"compiled_stack"}}
    assert off == {name} | dependants.get(name, set())
    assert getattr(b, name).why == f"switched off by an override ({name}=off)"
    assert b.overrides == BackendOverrides(**{name: False})


def test_an_on_override_cannot_turn_on_what_the_machine_lacks():
    b = decide(CpuFeatures(compiler=None), BackendOverrides(layer_ops=True))
    assert not b.layer_ops.on and "no C++ compiler" in b.layer_ops.why
    assert decide(FULL, BackendOverrides(layer_ops=True)).layer_ops.why.endswith("(asked on)")


def test_for_dtype_turns_off_what_does_not_compute_in_it():
    b = decide(FULL)
    bf16 = b.for_dtype("bfloat16")
    assert _on(bf16) == {"prepacked_linear": True, "gguf_matmul": False, "cpu_attention": True,
                         "layer_ops": False, "compiled_stack": False, "eagle_q8_0": False}
    assert "float32 only" in bf16.layer_ops.why and "bfloat16" in bf16.layer_ops.why
    assert b.for_dtype("float32") == b
    f64 = b.for_dtype("float64")
    assert [n for n, on in _on(f64).items() if on] == ["cpu_attention"]


def test_overrides_parse_merge_and_print():
    o = BackendOverrides.parse("compiled_stack=off, eagle_q8_0 = 0,layer_ops=ON")
    assert o == BackendOverrides(compiled_stack=False, eagle_q8_0=False, layer_ops=True)
    assert str(o) == "layer_ops=on,compiled_stack=off,eagle_q8_0=off"
    assert BackendOverrides.parse(str(o)) == o
    assert BackendOverrides.parse(None) == BackendOverrides.parse("") == BackendOverrides()
    merged = o.merged(BackendOverrides(compiled_stack=True))
    assert merged == BackendOverrides(compiled_stack=True, eagle_q8_0=False, layer_ops=True)
    assert hash(merged) == hash(BackendOverrides(compiled_stack=True, eagle_q8_0=False,
                                                 layer_ops=True))


@pytest.mark.parametrize("text,match", [
    ("compiled=off", "NAME one of"), ("compiled_stack", "NAME=on"),
    ("layer_ops=maybe", "expected one of"), ("layer_ops=on,layer_ops=off", "given twice"),
])
def test_bad_overrides_are_clear_errors(text, match):
    with pytest.raises(ValueError, match=match):
        BackendOverrides.parse(text)


def test_an_override_must_be_a_bool_or_unset():
    with pytest.raises(ValueError, match="expected on, off or unset"):
        BackendOverrides(layer_ops="off")


def test_the_environment_switches_are_read_into_overrides():
    env = {"SPECMESH_COMPILED_STACK": "0", "SPECMESH_EAGLE_Q8_0": "1",
           "SPECMESH_LAYER_OPS": "", "SPECMESH_PREPACKED_LINEAR": "off",
           "SPECMESH_GGUF_MATMUL": "false", "SPECMESH_CPU_ATTENTION": "no", "OTHER": "0"}
    assert read_overrides(env) == BackendOverrides(
        compiled_stack=False, eagle_q8_0=True, prepacked_linear=False, gguf_matmul=False,
        cpu_attention=False)
    assert read_overrides({}) == BackendOverrides()
    with pytest.raises(ValueError, match="SPECMESH_LAYER_OPS='2'"):
        read_overrides({"SPECMESH_LAYER_OPS": "2"})


def test_the_process_backend_is_built_once_per_overrides():
    o = BackendOverrides(compiled_stack=False)
    assert cpu_backend(o) is cpu_backend(BackendOverrides(compiled_stack=False))
    assert cpu_backend(o) == decide(cpu_backend(o).features, o)
    assert default_backend() is default_backend()
    assert cpu_backend(o).features.num_cores >= 1


def test_cpu_model_name_reads_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: X\nmodel name\t: Test CPU @ 2GHz\n")
    assert cpu_model_name(str(info)) == "Test CPU @ 2GHz"
    assert isinstance(cpu_model_name(str(tmp_path / "missing")), str)
