"""Draft seed state on the verifier (EAGLE family, docs/architecture.md, 'Messages'): the target
hidden states a
request's drafter needs, kept per request in a bounded window and shipped with DraftSync and
VerifyCommit.

Positions are absolute context positions (context = prompt + committed output); ``f_i`` is the
target's final hidden state at position ``i``, which predicted the token at ``i + 1``. With a
context of ``L`` tokens the verifier knows ``f_0 .. f_{L-2}`` (``f_{L-1}`` comes out of the next
verify forward, whose row 0 is the last committed token). So:

- PrefillDone (prompt of ``p`` tokens, context ``p + 1`` with the first token): ``f_{p-1}``;
- a verify step of a context of ``L`` tokens that commits ``a + 1`` tokens: rows ``0 .. a`` of
  its chunk, positions ``L-1 .. L-1+a`` (one per committed token), sent with the VerifyCommit;
- DraftSync: the rows the window holds, ending at position ``L - 2``.
"""

from __future__ import annotations

import torch

from specmesh.decode.config import MAX_SEED_ROWS
from specmesh.engine.frames import buffer_to_tensor, tensor_to_buffer
from specmesh.protocol.messages import Buffer


class SeedWindow:
    """The latest true hidden states of one request: rows at positions ``[start, end)``, at most
    ``max_rows`` of them, always contiguous (rows that do not follow on replace the window)."""

    def __init__(self, max_rows: int = MAX_SEED_ROWS) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        self.start = 0
        self.rows: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.start + (0 if self.rows is None else self.rows.shape[0])

    def append(self, start: int, rows: torch.Tensor) -> None:
        """Add ``rows`` [n, hidden] at positions ``[start, start + n)``."""
        if rows.shape[0] == 0:
            return
        if self.rows is None or start != self.end or rows.shape[1:] != self.rows.shape[1:]:
            self.rows, self.start = rows, start
        else:
            self.rows = torch.cat([self.rows, rows])
        extra = self.rows.shape[0] - self.max_rows
        if extra > 0:
            self.rows = self.rows[extra:].clone()  # let go of the older storage
            self.start += extra

    def rows_from(self, start: int) -> torch.Tensor | None:
        """The rows at positions ``[start, end)``; None when the window does not reach back to
        ``start`` (or holds nothing)."""
        if self.rows is None or not self.start <= start <= self.end:
            return None
        return self.rows[start - self.start:]

    def rows_before(self, context_len: int) -> tuple[int, torch.Tensor] | None:
        """``(start, rows)`` of every row held when they end at position ``context_len - 2``
        (what a DraftSync of that context carries); None when there are none or they do not
        end there."""
        if self.rows is None or self.end != context_len - 1:
            return None
        return self.start, self.rows


def window_from_prefill(buf: Buffer | None, prompt_len: int, hidden_size: int,
                        dtype: torch.dtype) -> SeedWindow | None:
    """The window of a request whose PrefillDone carried ``buf`` (``f_{p-1}``, [1, hidden] in
    the model dtype); None when it carried none or one of another shape or dtype (the request
    then starts without one: its drafter gets rows from the first commit on)."""
    if buf is None or tuple(buf.shape) != (1, hidden_size):
        return None
    try:
        rows = buffer_to_tensor(buf)
    except ValueError:
        return None
    if rows.dtype != dtype:
        return None
    window = SeedWindow()
    window.append(prompt_len - 1, rows)
    return window


def sync_buffer(window: SeedWindow | None, context_len: int) -> Buffer | None:
    """DraftSync.seed_state for a context of ``context_len`` tokens (None: nothing to send)."""
    held = window.rows_before(context_len) if window is not None else None
    return None if held is None else tensor_to_buffer(held[1])


def commit_buffer(rows: torch.Tensor | None) -> Buffer | None:
    """VerifyCommit.seed_state: one row per committed token (None: nothing to send)."""
    return None if rows is None else tensor_to_buffer(rows)
