"""Whether the Triton kernels run compiled or interpreted, shared by every op's launcher.

Triton decides compiled vs interpreted once, when a function is decorated with
``@triton.jit`` (ours and triton.language's own): ``TRITON_INTERPRET=1`` must be in the
environment before triton is imported. The launchers read the variable on each call.
"""

from __future__ import annotations

import triton
from triton.runtime import JITFunction


def interpret_mode() -> bool:
    """Whether ``TRITON_INTERPRET`` is on now (triton reads the environment on each access)."""
    return bool(triton.knobs.runtime.interpret)


def is_interpreted(kernel: object) -> bool:
    """Whether ``@triton.jit`` made ``kernel`` an interpreted kernel."""
    return not isinstance(kernel, JITFunction)


def check_runnable(on_cuda: bool, kernel: object) -> None:
    """Refuse to run ``kernel`` on CPU tensors unless it is interpreted.

    Raises:
        RuntimeError: CPU tensors with ``TRITON_INTERPRET=1`` set only after triton was
            imported (the kernel was already decorated for compilation).
        ValueError: CPU tensors while the kernel is compiled.
    """
    if on_cuda or is_interpreted(kernel):
        return
    if interpret_mode():
        raise RuntimeError("TRITON_INTERPRET=1 was set after triton was imported; set it in "
                           "the environment before the process imports triton")
    raise ValueError("the Triton kernel needs CUDA tensors, or TRITON_INTERPRET=1 on CPU")
