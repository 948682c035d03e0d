"""Constants shared by the verification ops (kernels/ imports only torch, triton and stdlib)."""

from __future__ import annotations

#: Pads output token rows past the last emitted token (same value as the wire protocol's).
PLACEHOLDER_TOKEN_ID = -1

__all__ = ["PLACEHOLDER_TOKEN_ID"]
