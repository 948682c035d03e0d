"""Device names a user gives (``--device``) and the torch device they mean."""

from __future__ import annotations

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
    import torch

    check_device(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but no CUDA GPU is visible to this process")
    return torch.device(name)


#: CPU flags (``/proc/cpuinfo``) of native bfloat16 matmul: with them oneDNN runs a bf16
#: multi-token forward at about the cost of a one-token one; without them (AVX2 only) torch
#: emulates bf16 and a multi-token forward costs far more (docs/benchmarks.md, 'Forward cost').
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


def default_dtype(device: str = "auto", flags: set[str] | None = None) -> str:
    """The model dtype ``--dtype auto`` picks: ``bfloat16`` on CUDA and on CPUs with native
    bf16 matmul (:data:`BF16_CPU_FLAGS`), else ``float32``. Both are exact for speculation:
    the verify forward is batch invariant (kernels/paged_attention.py), so greedy output with
    speculation equals output without it; bf16 is only faster where the hardware has it.

    Raises:
        ValueError: an unknown device name.
    """
    dev = resolve_device(device)
    if dev.type == "cuda":
        return "bfloat16"
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if any(f in flags for f in BF16_CPU_FLAGS) else "float32"


def resolve_dtype(name: str, device: str = "auto") -> str:
    """``name`` itself, or :func:`default_dtype` for ``"auto"``."""
    return default_dtype(device) if name == "auto" else name
