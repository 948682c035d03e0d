"""How many of this machine's CPUs other processes are using right now.

A role that can run its forward on more torch threads than usual (the prefill role on the
verifier's cores while the verifier idles) should only do so when those cores are free: an
OpenMP team of n threads on n cores where another process keeps one of them busy waits at every
barrier until the scheduler gives the descheduled thread its turn, so a forward on 2 threads
beside one busy process is several times slower than the same forward on 1 thread
(docs/benchmarks.md, 'Time to first token'). A benchmark client on the same host (guidellm runs
a process per stream) is such a process.

Linux only: the count of runnable threads in ``/proc/loadavg`` (its fourth field, ``R/T``: the
kernel's instantaneous ``nr_running``), less this process's own runnable threads
(``/proc/self/task/*/stat``). Elsewhere, or if either cannot be read, nothing is known (None).
In a container without its own ``/proc`` view the count is the host's, compared with the
host's CPU count (``os.cpu_count()``), so the answer is the host's free CPUs.
"""

from __future__ import annotations

import os
import time

#: samples per reading, ``SAMPLE_GAP_S`` apart; the fewest others seen is kept, so a process
#: that runs for an instant (a logger, a heartbeat) does not count, a busy one does
NUM_SAMPLES = 3
SAMPLE_GAP_S = 0.0003


def _running_total(path: str) -> int:
    """The kernel's runnable thread count from a ``/proc/loadavg``-format file."""
    with open(path, encoding="ascii") as f:
        return int(f.read().split()[3].split("/")[0])


def _running_own(task_dir: str) -> int:
    """This process's threads in state R (running or runnable)."""
    n = 0
    for tid in os.listdir(task_dir):
        try:
            with open(os.path.join(task_dir, tid, "stat"), encoding="ascii",
                      errors="replace") as f:
                stat = f.read()
        except OSError:  # the thread exited meanwhile
            continue
        # "pid (comm) S ...": comm may hold spaces and parentheses, the state follows the last ')'
        if stat[stat.rfind(")") + 2:stat.rfind(")") + 3] == "R":
            n += 1
    return n


def running_elsewhere(loadavg: str = "/proc/loadavg", task_dir: str = "/proc/self/task",
                      num_samples: int = NUM_SAMPLES, gap_s: float = SAMPLE_GAP_S) -> int | None:
    """Threads of other processes running or waiting for a CPU now: the fewest over
    ``num_samples`` readings ``gap_s`` seconds apart (about a millisecond in all by default).
    None when ``/proc`` cannot be read (not Linux).

    Raises:
        ValueError: ``num_samples`` < 1.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    fewest: int | None = None
    for i in range(num_samples):
        if i:
            time.sleep(gap_s)
        try:
            others = max(_running_total(loadavg) - _running_own(task_dir), 0)
        except (OSError, ValueError, IndexError):
            return None
        fewest = others if fewest is None else min(fewest, others)
    return fewest


def free_cpus(num_cpus: int | None = None, others: int | None = None) -> int | None:
    """CPUs no other process is using now: ``num_cpus`` (default ``os.cpu_count()``) less
    :func:`running_elsewhere` (or ``others`` when given), at least 0; None when unknown."""
    if others is None:
        others = running_elsewhere()
    if others is None:
        return None
    return max((num_cpus or os.cpu_count() or 1) - others, 0)
