"""Prompts first on shared cores: the verifier pauses its verify steps while a prefill it
waits on runs on the same CPU cores (docs/architecture.md, 'Running on CPU').

On a CPU node that hosts the verifier and a prefill worker, both compute on the same cores.
Left to run side by side they split the cores (the verify forward on one thread while a
prefill is in flight, decode/core_sharing.py, the prefill on one), so a prompt's prefill, and
with it the request's first token, takes about twice its time on all cores. Paused, the verifier
leaves every core to the prefill (its PrefillRequest says so, ``verifier_idle``, and the prefill
worker runs it on the verifier's threads too): the prompt is done sooner and the decode steps
it displaced run right after it, on every core. The total work is the same; prompts go first,
as in vLLM's default scheduling of waiting requests before running ones.

Bounded, so decode never starves behind a long prompt or a stream of them: a pause window
lasts at most ``max_pause_s``; when it runs out the verifier runs one verify step (the forward
then shares the cores with the prefill still in flight) before a new window may open.

Plain logic with an injected clock; the worker does the waiting (on its mailbox, so KV frames,
PrefillDone and new requests are handled during the pause).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class PrefillPause:
    """Decides, before each verify step, whether the verifier pauses for the prefills in flight.

    ``max_pause_s``: the longest pause window, seconds (0: never pause). ``clock``: monotonic
    seconds (injected by tests).

    Raises:
        ValueError: ``max_pause_s`` < 0.
    """

    def __init__(self, max_pause_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not max_pause_s >= 0:
            raise ValueError(f"max_pause_s must be >= 0, got {max_pause_s}")
        self.max_pause_s = max_pause_s
        self._clock = clock
        self._window_start: float | None = None
        self.num_windows = 0  # pause windows opened
        self.num_expired = 0  # windows that ran out with a prefill still in flight

    @property
    def enabled(self) -> bool:
        return self.max_pause_s > 0

    def should_pause(self, num_prefilling: int) -> bool:
        """Whether the verify step about to run should wait instead, with ``num_prefilling``
        requests awaiting their prefill on the shared cores. Opens a window when none is open;
        a window that ran out answers False once (one verify step runs) and closes, so the
        next call opens a new one. With nothing prefilling the window closes."""
        if not self.enabled or num_prefilling <= 0:
            self._window_start = None
            return False
        now = self._clock()
        if self._window_start is None:
            self._window_start = now
            self.num_windows += 1
        if now - self._window_start < self.max_pause_s:
            return True
        self._window_start = None
        self.num_expired += 1
        return False

    def remaining_s(self) -> float:
        """Seconds left in the open window (0 when none is open)."""
        if self._window_start is None:
            return 0.0
        return max(self._window_start + self.max_pause_s - self._clock(), 0.0)
