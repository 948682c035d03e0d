"""The verifier's torch threads while a prefill worker on the same cores runs its prompts.

On a CPU node that hosts both roles, the verifier's forward and a prefill are two OpenMP teams
on the same cores. Teams whose threads spin at barriers stall each other whenever the scheduler
parks one of their threads (engine/openmp.py), so while a prefill this verifier waits on is in
flight, the verify forward runs on one thread and leaves the other cores to prefill; once no
prefill is in flight it gets the plan's count back. That shortens a burst of concurrent requests
on 2 cores (docs/benchmarks.md, 'Threads and OpenMP'); one request at a time is unaffected (no
request runs while its own prefill is in flight).

Plain logic; the caller supplies the thread setter (``torch.set_num_threads`` in the role).
"""

from __future__ import annotations

from collections.abc import Callable


class CoreSharing:
    """Threads for each verify forward: ``threads`` (the plan's), or 1 while ``shared`` (a
    prefill peer shares this verifier's cores) and a prefill is in flight.

    Raises:
        ValueError: ``threads`` < 1.
    """

    def __init__(self, threads: int, set_threads: Callable[[int], None],
                 shared: bool = False) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self.shared = shared
        self._set_threads = set_threads
        self.current = threads
        self.num_switches = 0

    def threads_for(self, num_prefilling: int) -> int:
        """Torch threads for a forward while ``num_prefilling`` requests await their KV."""
        return 1 if self.shared and num_prefilling > 0 else self.threads

    def before_forward(self, num_prefilling: int) -> int:
        """Set the threads for the next forward (only when they change); returns them."""
        want = self.threads_for(num_prefilling)
        if want != self.current:
            self._set_threads(want)
            self.current = want
            self.num_switches += 1
        return want
