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
