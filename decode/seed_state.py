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
    ``max_rows`` of them, always contiguous (rows that do not follow on replace the window).

    The rows live in a buffer of twice ``max_rows``: a step's rows are copied in after the
    ones held, and only when the buffer is full are the last ``max_rows`` moved to its front
    (a copy per ``max_rows`` rows appended, not a concatenation of the whole window per
    step: at 16 streams that was most of the verifier's commit time)."""

    def __init__(self, max_rows: int = MAX_SEED_ROWS) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        self.start = 0
        self._buf: torch.Tensor | None = None
        self._lo = self._hi = 0  # the held rows are _buf[_lo:_hi]

    @property
    def rows(self) -> torch.Tensor | None:
        """The rows held, [end - start, hidden] (a view; None: none)."""
        return None if self._buf is None else self._buf[self._lo:self._hi]

    @property
    def end(self) -> int:
        return self.start + (self._hi - self._lo)

    def append(self, start: int, rows: torch.Tensor) -> None:
        """Add ``rows`` [n, hidden] at positions ``[start, start + n)``."""
        n = rows.shape[0]
        if n == 0:
            return
        buf = self._buf
        if buf is None or start != self.end or rows.shape[1:] != buf.shape[1:] \
                or rows.dtype != buf.dtype or rows.device != buf.device:
            buf = self._buf = rows.new_empty((2 * self.max_rows, *rows.shape[1:]))
            self._lo = self._hi = 0
            self.start = start
        if n > self.max_rows:  # only the last max_rows can be held
            self.start += (self._hi - self._lo) + n - self.max_rows
            rows, n = rows[n - self.max_rows:], self.max_rows
            self._lo = self._hi = 0
        if self._hi + n > buf.shape[0]:  # full: the rows still held move to the front
            keep = min(self._hi - self._lo, self.max_rows - n)
            self.start += self._hi - self._lo - keep
            buf[:keep] = buf[self._hi - keep:self._hi].clone()
            self._lo, self._hi = 0, keep
        buf[self._hi:self._hi + n] = rows
        self._hi += n
        extra = self._hi - self._lo - self.max_rows
        if extra > 0:
            self._lo += extra
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
