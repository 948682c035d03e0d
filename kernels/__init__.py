"""Verification and sampling ops (DESIGN.md §5): each op is one file with a plain-torch
``<op>_ref`` (the source of truth), a private Triton kernel and a launcher with the reference's
signature (reference on CPU, kernel on CUDA or under ``TRITON_INTERPRET=1``).

Imports only torch, triton and the standard library.
"""

from __future__ import annotations

from kernels.constants import PLACEHOLDER_TOKEN_ID
from kernels.greedy_verify import greedy_verify, greedy_verify_ref, greedy_verify_triton

__all__ = ["PLACEHOLDER_TOKEN_ID", "greedy_verify", "greedy_verify_ref", "greedy_verify_triton"]
