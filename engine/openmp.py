"""torch's CPU threads and OpenMP: one thread team per process.

torch's CPU wheels run intra-op work on GNU OpenMP (libgomp). libgomp gives every OS thread
that starts parallel work a team of its own, and once a process holds more OpenMP threads than
it has cores, every team's threads stop spinning between parallel regions and sleep on a futex
instead (libgomp's "throttled" spin count). A forward is hundreds of short parallel regions, so
sleeping workers roughly double its time, e.g. with a second, idle team left by the thread that
loaded the model (``OMP_WAIT_POLICY=PASSIVE`` has the same effect; docs/benchmarks.md, 'Threads
and OpenMP').

So a role keeps one team: the loop thread runs the forwards, and work done before it starts
(loading weights, building the KV cache) runs in a short-lived thread whose team is released
when it exits (:func:`run_in_released_thread`).

Roles keep libgomp's default wait policy (spin about 300,000 iterations, then sleep). A shorter
spin for the verifier (``GOMP_SPINCOUNT=3000``) lets roles that share its cores run sooner,
which helped many concurrent requests but slowed one request at a time, so the default stays
(same page).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_in_released_thread(fn: Callable[[], T], name: str = "specmesh-init") -> T:
    """Run ``fn()`` in a new thread and return its result once the thread has exited, so the
    OpenMP team its torch ops started is released with it (libgomp frees a thread's team at
    thread exit) and does not count against the team of the thread that runs the forwards.

    Raises:
        BaseException: whatever ``fn`` raised, re-raised in the calling thread.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller
            error.append(err)

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
