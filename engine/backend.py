"""The CPU compute backend: which of the CPU fast paths a process computes with, decided once
from what its machine has plus explicit overrides, and passed down as one frozen value
(loader -> model -> linear layers, attention, compiled stack; the EAGLE head's quantization).

Why one value: each fast path used to read its own environment switch, at import time or per
call, in six modules; 64 combinations of the CPU forward were possible and nothing said which
one a process ran. Here every choice is made in :func:`decide` from a :class:`CpuFeatures`
(detection) and a :class:`BackendOverrides` (what the user asked), and carries its reason;
``specmesh env`` prints them.

The choices (fields of :class:`CpuBackend`, in :data:`CHOICES`):

- ``prepacked_linear``: products on prepacked oneDNN weights (:mod:`engine.onednn`); needs
  torch built with oneDNN. Float32 and bfloat16.
- ``gguf_matmul``: float32 products on a GGUF file's quantized blocks
  (:mod:`kernels.gguf_matmul`); needs a C++ compiler and a CPU with AVX2 and FMA.
- ``cpu_attention``: paged attention as compiled C++ (:mod:`kernels.cpu_attention`); needs a
  C++ compiler. Float32, bfloat16, float64.
- ``layer_ops``: float32 RMSNorm, RoPE and SiLU as compiled C++ (:mod:`kernels.layer_ops`);
  needs a C++ compiler.
- ``compiled_stack``: all decoder layers of a float32 forward in one compiled call
  (:mod:`engine.compiled_stack`); needs the three kernels above.
- ``eagle_q8_0``: a float32 EAGLE head (and a DFlash draft, drafter/proposers/dflash.py)
  rounded to Q8_0 blocks (drafter/eagle/quantize.py); needs ``gguf_matmul``.

A choice that is on still applies only to tensors it takes (its dtypes, CPU, no autograd): a
float64 model runs its torch paths whatever the backend says. A compiled kernel is built on
first use; if that build fails, its caller logs it once and keeps its torch path.

Overrides: a cluster carries one :class:`BackendOverrides` in its config (``specmesh ...
--cpu-backend NAME=off,...``), so every role applies the same ones to what its own machine
has. A process that builds its own backend (:func:`default_backend`: scripts, tests,
``specmesh generate``) reads them from the environment in :func:`read_overrides`, the one place
the ``SPECMESH_*`` compute switches are read. An override can turn a choice off, or cancel an
off from a lower-priority source (``NAME=on``); it cannot turn on a path the machine lacks.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass

from specmesh.engine.devices import cpu_flags
from specmesh.kernels import cpu_build

#: The compute choices, in the order they are decided (later ones depend on earlier ones).
CHOICES: tuple[str, ...] = ("prepacked_linear", "gguf_matmul", "cpu_attention", "layer_ops",
                            "compiled_stack", "eagle_q8_0")
#: The model dtypes each choice computes in (a model of another dtype keeps its torch path).
CHOICE_DTYPES: dict[str, tuple[str, ...]] = {
    "prepacked_linear": ("float32", "bfloat16"),
    "gguf_matmul": ("float32",),
    "cpu_attention": ("float32", "bfloat16", "float64"),
    "layer_ops": ("float32",),
    "compiled_stack": ("float32",),
    "eagle_q8_0": ("float32",),
}
#: CPU flags the GGUF matmul kernel is written for (kernels/gguf_matmul.cpp refuses to build
#: without them).
GGUF_MATMUL_FLAGS = ("avx2", "fma")
#: Values an override accepts, either case.
_ON, _OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


@dataclass(frozen=True)
class Choice:
    """One compute choice: ``on`` or not, ``why`` (a sentence), and the model ``dtypes`` it
    computes in."""

    on: bool
    why: str
    dtypes: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        """``{"on": bool, "why": str, "dtypes": [str, ...]}`` (for ``specmesh env --json``)."""
        return {"on": self.on, "why": self.why, "dtypes": list(self.dtypes)}


@dataclass(frozen=True)
class CpuFeatures:
    """What detection found on this machine: the CPU's ``model_name`` and feature ``flags``
    (``/proc/cpuinfo``), ``num_cores`` (logical CPUs this process may run on), the C++
    ``compiler`` that builds the kernels (None: none), whether torch has the oneDNN linear ops
    (``onednn``), and the ``machine`` architecture (``x86_64``, ``aarch64``...)."""

    model_name: str = ""
    flags: frozenset[str] = frozenset()
    num_cores: int = 1
    compiler: str | None = None
    onednn: bool = False
    machine: str = ""


@dataclass(frozen=True)
class BackendOverrides:
    """What a user asked per choice: False switches it off, True cancels an off from a
    lower-priority source (it is then on where the machine allows), None (default) leaves it
    to detection. Frozen and hashable: a cluster config carries one to every role.

    Raises:
        ValueError: a value that is not None or a bool.
    """

    prepacked_linear: bool | None = None
    gguf_matmul: bool | None = None
    cpu_attention: bool | None = None
    layer_ops: bool | None = None
    compiled_stack: bool | None = None
    eagle_q8_0: bool | None = None

    def __post_init__(self) -> None:
        for name in CHOICES:
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"override {name}={value!r}: expected on, off or unset")

    @classmethod
    def parse(cls, text: str | None) -> BackendOverrides:
        """``"compiled_stack=off,eagle_q8_0=off"`` (``--cpu-backend``) -> overrides; None or
        empty text: none. Values: on/off, 1/0, true/false, yes/no.

        Raises:
            ValueError: an unknown choice, a malformed item, or a choice given twice.
        """
        values: dict[str, bool] = {}
        for item in (text or "").split(","):
            if not item.strip():
                continue
            name, sep, value = (s.strip() for s in item.partition("="))
            if not sep or name not in CHOICES:
                raise ValueError(f"cpu backend override {item.strip()!r}: expected NAME=on|off "
                                 f"with NAME one of {', '.join(CHOICES)}")
            if name in values:
                raise ValueError(f"cpu backend override {name!r} given twice")
            values[name] = _parse_switch(value, name)
        return cls(**values)

    def merged(self, other: BackendOverrides) -> BackendOverrides:
        """These overrides with ``other``'s set values on top (``other`` wins)."""
        return dataclasses.replace(self, **{n: v for n, v in other.as_dict().items()})

    def as_dict(self) -> dict[str, bool]:
        """The set overrides, ``{name: on}``."""
        return {n: getattr(self, n) for n in CHOICES if getattr(self, n) is not None}

    def __str__(self) -> str:
        return ",".join(f"{n}={'on' if v else 'off'}" for n, v in self.as_dict().items())


@dataclass(frozen=True)
class CpuBackend:
    """The CPU compute choices of a process (see the module docstring), each a
    :class:`Choice`, with the ``features`` and ``overrides`` they were decided from. Build
    one with :func:`cpu_backend` (or :func:`decide` from given features)."""

    prepacked_linear: Choice
    gguf_matmul: Choice
    cpu_attention: Choice
    layer_ops: Choice
    compiled_stack: Choice
    eagle_q8_0: Choice
    features: CpuFeatures = CpuFeatures()
    overrides: BackendOverrides = BackendOverrides()

    def choices(self) -> dict[str, Choice]:
        """``{name: Choice}`` in :data:`CHOICES` order."""
        return {name: getattr(self, name) for name in CHOICES}

    def summary(self) -> str:
        """One line for logs: ``prepacked_linear=on gguf_matmul=off ...``."""
        return " ".join(f"{n}={'on' if c.on else 'off'}" for n, c in self.choices().items())

    def for_dtype(self, dtype: str) -> CpuBackend:
        """What a model of ``dtype`` (a model dtype name) runs: choices that do not compute
        in it are off, saying so (``specmesh env`` shows the dtype ``auto`` picks)."""
        changed = {name: Choice(False, f"computes in {', '.join(c.dtypes)} only, the model "
                                       f"is {dtype}", c.dtypes)
                   for name, c in self.choices().items() if c.on and dtype not in c.dtypes}
        return dataclasses.replace(self, **changed)


def _parse_switch(value: str, name: str) -> bool:
    v = value.strip().lower()
    if v in _ON:
        return True
    if v in _OFF:
        return False
    raise ValueError(f"{name}={value!r}: expected one of {', '.join(_ON + _OFF)}")


def decide(features: CpuFeatures, overrides: BackendOverrides | None = None) -> CpuBackend:
    """The backend for ``features`` and ``overrides`` (pure: tests pass fake features).

    Each choice is off when an override says off, or when the machine lacks what it needs (see
    the module docstring); else on. The reasons name the override, the missing feature, or
    what was found.
    """
    o = overrides or BackendOverrides()
    out: dict[str, Choice] = {}

    def choose(name: str, missing: str | None, found: str) -> None:
        dtypes = CHOICE_DTYPES[name]
        if getattr(o, name) is False:
            out[name] = Choice(False, f"switched off by an override ({name}=off)", dtypes)
        elif missing:
            out[name] = Choice(False, missing, dtypes)
        else:
            asked = " (asked on)" if getattr(o, name) else ""
            out[name] = Choice(True, found + asked, dtypes)

    cxx = features.compiler
    no_cxx = None if cxx else "no C++ compiler to build the kernel ($CXX, g++ or c++)"
    built = f"built with {cxx} on first use"
    choose("prepacked_linear",
           None if features.onednn else "torch has no oneDNN linear ops (mkldnn "
                                        "_linear_pointwise)",
           "torch has the oneDNN linear ops")
    lacking = [f for f in GGUF_MATMUL_FLAGS if f not in features.flags]
    choose("gguf_matmul",
           no_cxx or (f"the CPU lacks {' and '.join(lacking)} (the kernel needs "
                      f"{' and '.join(GGUF_MATMUL_FLAGS)})" if lacking else None),
           f"{' and '.join(GGUF_MATMUL_FLAGS)} present, {built}")
    choose("cpu_attention", no_cxx, built)
    choose("layer_ops", no_cxx, built)
    parts = ("layer_ops", "gguf_matmul", "cpu_attention")
    off = [p for p in parts if not out[p].on]
    choose("compiled_stack", f"needs {', '.join(off)} (off)" if off else None,
           "layer_ops, gguf_matmul and cpu_attention are on")
    choose("eagle_q8_0", None if out["gguf_matmul"].on else "needs gguf_matmul (off)",
           "gguf_matmul is on")
    return CpuBackend(**out, features=features, overrides=o)


def cpu_model_name(path: str = "/proc/cpuinfo") -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what ``platform`` reports)."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def num_cores() -> int:
    """Logical CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=1)
def detect_features() -> CpuFeatures:
    """This machine's :class:`CpuFeatures` (detected once per process)."""
    from specmesh.engine import onednn  # imports torch: the overrides and choices stay torch-free

    return CpuFeatures(model_name=cpu_model_name(), flags=frozenset(cpu_flags()),
                       num_cores=num_cores(), compiler=cpu_build.compiler(),
                       onednn=onednn.available(), machine=platform.machine())


def read_overrides(environ: Mapping[str, str] | None = None) -> BackendOverrides:
    """The overrides the environment asks for (``environ``, default ``os.environ``): the one
    place the ``SPECMESH_*`` compute switches are read. ``SPECMESH_<CHOICE>=0`` switches a
    choice off (``1`` cancels an off given elsewhere; unset or empty: no override).

    Raises:
        ValueError: a switch set to something other than on/off, 1/0, true/false, yes/no.
    """
    env = os.environ if environ is None else environ
    switches = {"prepacked_linear": "SPECMESH_PREPACKED_LINEAR",
                "gguf_matmul": "SPECMESH_GGUF_MATMUL",
                "cpu_attention": "SPECMESH_CPU_ATTENTION",
                "layer_ops": "SPECMESH_LAYER_OPS",
                "compiled_stack": "SPECMESH_COMPILED_STACK",
                "eagle_q8_0": "SPECMESH_EAGLE_Q8_0"}
    values = {name: _parse_switch(env[var], var) for name, var in switches.items()
              if env.get(var, "").strip()}
    return BackendOverrides(**values)


@functools.lru_cache(maxsize=None)
def cpu_backend(overrides: BackendOverrides | None = None) -> CpuBackend:
    """This machine's backend with ``overrides`` applied (None: :func:`read_overrides`), built
    once per process and overrides value (a role builds it from its cluster's overrides, so
    every role of a cluster makes the same asks of its own machine)."""
    return decide(detect_features(), read_overrides() if overrides is None else overrides)


def default_backend() -> CpuBackend:
    """The backend of a process that was given none: :func:`cpu_backend` with the
    environment's overrides, read once (what a module constructed without a ``backend``
    computes with)."""
    return cpu_backend(None)


__all__ = ["CHOICES", "CHOICE_DTYPES", "BackendOverrides", "Choice", "CpuBackend", "CpuFeatures",
           "cpu_backend", "cpu_model_name", "decide", "default_backend", "detect_features",
           "num_cores", "read_overrides"]
