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

Measured, not assumed: a prompt on all cores is faster only while the roles get their cores.
On a host crowded with other work an OpenMP team of two threads waits at every barrier for the
thread the scheduler parked, and the prompt is no faster than on one thread, so pausing would
only stall decode (docs/benchmarks.md, 'Time to first token'). So the verifier compares the
two ways on its own prompts: the seconds per prompt token the prefill computed (its prefix
cache hits excluded: PrefillDone.num_cached_tokens) from PrefillRequest to the first token, an EMA for prompts it paused for and one for prompts run side by side, over the prompts
that did not queue behind another on their prefill worker (a prompt sent while nothing runs
counts as paused: the verifier idles then too). It pauses while the paused
time is at most :data:`PAUSE_GAIN` times the side-by-side one (pausing costs decode that
time, so it must win clearly), tries each way :data:`MIN_SAMPLES` times first, and every
:data:`EXPLORE_EVERY`-th prompt goes the other way to keep both figures current.

Plain logic with an injected clock; the worker does the waiting (on its mailbox, so KV frames,
PrefillDone and new requests are handled during the pause).
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: Pause while prefill paused for takes at most this share of its side-by-side time per token.
PAUSE_GAIN = 0.75
#: Prompts measured each way before the figures decide.
MIN_SAMPLES = 2
#: Every this-many-th prompt goes the way not chosen (keeps its figure current).
EXPLORE_EVERY = 16
#: Weight of the newest prompt in each way's EMA of seconds per prompt token.
EMA_WEIGHT = 0.3


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
        #: seconds per prompt token from PrefillRequest to first token: EMA and samples, for
        #: prompts paused for (True) and run side by side (False)
        self.per_token_s: dict[bool, float | None] = {True: None, False: None}
        self.num_samples: dict[bool, int] = {True: 0, False: 0}
        self._num_choices = 0

    @property
    def enabled(self) -> bool:
        return self.max_pause_s > 0

    def choose(self) -> bool:
        """Whether to pause for the prompt about to be sent while requests are running (see
        the module docstring; False when disabled)."""
        if not self.enabled:
            return False
        for way in (True, False):
            if self.num_samples[way] < MIN_SAMPLES:
                return way
        self._num_choices += 1
        paused, side = self.per_token_s[True], self.per_token_s[False]
        best = paused <= PAUSE_GAIN * side
        return (not best) if self._num_choices % EXPLORE_EVERY == 0 else best

    def observe(self, paused: bool, num_tokens: int, seconds: float) -> None:
        """A prompt of ``num_tokens`` tokens, paused for or not, reached its first token
        ``seconds`` after its PrefillRequest."""
        if num_tokens < 1:
            return
        value = seconds / num_tokens
        old = self.per_token_s[paused]
        self.per_token_s[paused] = value if old is None else old + EMA_WEIGHT * (value - old)
        self.num_samples[paused] += 1

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
