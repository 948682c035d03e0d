"""Device names a user gives (``--device``) and the torch device they mean."""

from __future__ import annotations

import hashlib
import platform
from typing import Any

#: ``auto``: CUDA when a GPU is visible to the process, else CPU.
DEVICE_CHOICES = ("auto", "cpu", "cuda")


def check_device(name: str) -> str:
    """``name`` if it is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.

    Raises:
        ValueError: anything else.
    """
    base, _, index = name.partition(":")
    if name in DEVICE_CHOICES or (base == "cuda" and index.isdigit()):
        return name
    raise ValueError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N")


def resolve_device(name: str = "auto") -> Any:
    """The torch device for ``name`` (see :func:`check_device`).

    Raises:
        ValueError: an unknown name, or CUDA asked for where no GPU is visible.
    """
    import torch  # torch only here: check_device and the CPU facts stay torch-free

    check_device(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but no CUDA GPU is visible to this process")
    return torch.device(name)


#: CPU flags (``/proc/cpuinfo``) of native bfloat16 matmul (AVX-512 BF16, AMX): where torch
#: does not emulate bf16. They no longer pick the dtype (see :func:`default_dtype`); the
#: ``specmesh`` auto measurement reports them.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The CPU feature flags the kernel reports (empty where it reports none)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def cpu_identity(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """What a measurement made on this CPU is valid for: the machine type, the CPU's model name
    and a digest of its feature flags (``/proc/cpuinfo``; empty strings where it says nothing).
    A cache keyed by it is measured again on another CPU kind or after a microcode / kernel
    change that alters the flags."""
    name = ""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.partition(":")[2].strip()
                    break
    except OSError:
        pass
    flags = " ".join(sorted(cpu_flags(path)))
    return {"machine": platform.machine(), "model_name": name,
            "flags": hashlib.sha256(flags.encode()).hexdigest()[:16]}


def default_dtype(device: str = "auto") -> str:
    """The model dtype ``--dtype auto`` picks without measuring: ``float32`` on a CPU, the
    exact dtype (its greedy output is the float32 reference's: Hugging Face float32 on the same
    weights; bfloat16 rounds weights and activations, so its output drifts from it), and on
    CPUs with native bf16 matmul measured faster too (the GGUF-block kernels and the compiled
    float32 stack, docs/verification.md, "Dtypes and exactness"); ``bfloat16`` on CUDA.
    ``cluster/auto_resolve.py`` measures the CPU candidates at first start and reports them;
    on CPU its choice is this one, since float32 is the only exact candidate.

    Raises:
        ValueError: an unknown device name.
    """
    return "bfloat16" if resolve_device(device).type == "cuda" else "float32"


def resolve_dtype(name: str, device: str = "auto") -> str:
    """``name`` itself, or :func:`default_dtype` for ``"auto"``."""
    return default_dtype(device) if name == "auto" else name
