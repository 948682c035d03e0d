"""Runs kernel ops in a fresh process under ``TRITON_INTERPRET=1``.

Triton decides compiled vs interpreted when it decorates a ``@triton.jit`` function (its own
``triton.language`` helpers at ``import triton``), so the variable must be set before the import:
a subprocess keeps it from leaking into the rest of the test session.

Usage: ``python _interpret_worker.py IN OUT``; IN is a ``torch.save``'d dict ``{"cases":
[{"func": "pkg.mod.fn", "args": [...], "kwargs": {...}, "disable": ["pkg.mod.name", ...]}]}``;
OUT receives a list with ``{"ok": [tensors]}`` or ``{"error": "Type: message"}`` per case.
``disable`` replaces module attributes with a function that raises (to prove a launcher did
not take that path). Inside ``args``/``kwargs`` (at any depth of lists and dicts), a dict
``{"__call__": "pkg.mod.fn", "args": [...], "kwargs": {...}}`` is replaced by what that call
returns in the worker: objects ``torch.load(weights_only=True)`` cannot carry (e.g. a
``PagedAttentionPlan``) are built on the spot.
"""

from __future__ import annotations

import importlib
import os
import sys


def _resolve(dotted: str) -> tuple[object, str]:
    module_name, attr = dotted.rsplit(".", 1)
    return importlib.import_module(module_name), attr


def _disabled(*args: object, **kwargs: object) -> None:
    raise AssertionError("disabled by the test")


def _build(value: object) -> object:
    """``value`` with every ``{"__call__": ...}`` dict replaced by the result of that call."""
    if isinstance(value, dict):
        if "__call__" in value:
            module, attr = _resolve(value["__call__"])
            return getattr(module, attr)(*_build(value.get("args", [])),
                                         **_build(value.get("kwargs", {})))
        return {k: _build(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_build(v) for v in value)
    return value


def main(in_path: str, out_path: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("TRITON_INTERPRET=1 must be set")
    import torch

    spec = torch.load(in_path, weights_only=True)
    results = []
    for case in spec["cases"]:
        saved = []
        for dotted in case.get("disable", []):
            module, attr = _resolve(dotted)
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, _disabled)
        try:
            module, attr = _resolve(case["func"])
            out = getattr(module, attr)(*_build(case["args"]), **_build(case.get("kwargs", {})))
            results.append({"ok": list(out) if isinstance(out, tuple) else [out]})
        except Exception as e:  # noqa: BLE001 - reported to the test
            results.append({"error": f"{type(e).__name__}: {e}"})
        finally:
            for module, attr, value in saved:
                setattr(module, attr, value)
    torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
