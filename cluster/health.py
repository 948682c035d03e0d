"""Role health as the controller sees it (docs/architecture.md, 'Cluster and health'): a plain
class, no Ray, any clock.

Every role host sends a heartbeat about once a second (cluster/actors.py): its instance id,
incarnation and a loop counter that its loop thread bumps on every turn (an idle loop turns at
least once a second: it blocks on its mailbox with a 1 s timeout). The controller feeds them to
:meth:`HealthMonitor.beat` and calls :meth:`HealthMonitor.check` about once a second; a role
is unhealthy when

- no heartbeat arrived for ``max_missed`` intervals: the actor is dead (killed, crashed, its
  node gone) or cut off;
- heartbeats arrive but the loop counter has not moved for ``max_missed`` intervals: the actor
  is alive but its loop is hung (a step that never returns, a deadlock).

The controller then deregisters the role and pushes the new roster to its peers. A role
deregistered this way whose heartbeats show its loop turning again (same incarnation: a
pause, not a restart; :meth:`HealthMonitor.status` is "" again) is re-admitted; a restarted role
registers anew as a new incarnation, which replaces the old entry and its health record.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

#: Seconds between two heartbeats of a role (and between two health checks).
HEARTBEAT_INTERVAL_S = 1.0
#: A role that misses this many heartbeats is suspect: the controller asks Ray whether its actor
#: still exists, and deregisters it at once when it does not
#: (docs/architecture.md, 'Cluster and health').
SUSPECT_MISSED_BEATS = 3
#: A role that misses this many heartbeats is deregistered as dead even while its actor exists (cut
#: off, or too starved to answer). Not 3: on a loaded 2-core machine a live role's heartbeats over
#: Ray can come seconds apart (docs/benchmarks.md, 'Protocol, health, installation'), and
#: deregistering a live role fails its requests.
MAX_MISSED_BEATS = 10
#: A role whose loop counter stands still this long (s) while it still sends heartbeats is
#: deregistered as hung. Generous: one step may legitimately take seconds on a CPU (a long
#: prompt's prefill chunk, a batched verify forward on a loaded machine).
HUNG_AFTER_S = 120.0


@dataclass
class RoleHealth:
    """What the monitor knows of one role incarnation (times on the monitor's clock)."""

    incarnation: int | None
    last_beat_at: float
    progress: int | None = None  # the loop counter of the last heartbeat
    progressed_at: float = 0.0  # when the loop counter last moved (or watching began)
    num_beats: int = 0


class HealthMonitor:
    """Heartbeat bookkeeping of the roles being watched.

    Args:
        interval_s: the heartbeat interval.
        max_missed: heartbeats missed before a role is dead.
        clock: monotonic seconds (a fake clock in tests).
        hung_after_s: loop standstill (s) before a role that still beats is hung; None:
            ``max_missed`` intervals, as for death.
    """

    def __init__(self, interval_s: float = HEARTBEAT_INTERVAL_S,
                 max_missed: int = MAX_MISSED_BEATS,
                 clock: Callable[[], float] = time.monotonic,
                 hung_after_s: float | None = None) -> None:
        if not interval_s > 0 or max_missed < 1:
            raise ValueError("interval_s must be > 0 and max_missed >= 1")
        self.interval_s, self.max_missed, self.clock = interval_s, max_missed, clock
        self.hung_after_s = interval_s * max_missed if hung_after_s is None else hung_after_s
        self.roles: dict[str, RoleHealth] = {}

    @property
    def bound_s(self) -> float:
        """Silence (or loop standstill) after which a role is unhealthy."""
        return self.interval_s * self.max_missed

    def watch(self, instance_id: str, incarnation: int | None) -> None:
        """Start (or restart, for a new incarnation) watching a role that just registered:
        registering counts as its first heartbeat and as progress."""
        now = self.clock()
        self.roles[instance_id] = RoleHealth(incarnation, now, None, now)

    def silent_s(self, instance_id: str) -> float:
        """Seconds since the last heartbeat of ``instance_id`` (0 when not watched)."""
        h = self.roles.get(instance_id)
        return 0.0 if h is None else self.clock() - h.last_beat_at

    def forget(self, instance_id: str) -> None:
        self.roles.pop(instance_id, None)

    def beat(self, instance_id: str, incarnation: int | None, progress: int) -> bool:
        """Record a heartbeat; False (and nothing recorded) when the role is not watched or
        the heartbeat comes from another incarnation (a late beat of a previous life)."""
        h = self.roles.get(instance_id)
        if h is None or h.incarnation != incarnation:
            return False
        now = self.clock()
        h.last_beat_at = now
        h.num_beats += 1
        if progress != h.progress:
            if h.progress is not None:
                h.progressed_at = now
            h.progress = progress
        return True

    def status(self, instance_id: str) -> str:
        """Why ``instance_id`` is unhealthy now ("" when it is healthy or not watched)."""
        h = self.roles.get(instance_id)
        if h is None:
            return ""
        now = self.clock()
        silent = now - h.last_beat_at
        if silent >= self.bound_s:
            return (f"no heartbeat for {silent:.1f} s ({int(silent / self.interval_s)} "
                    f"missed, limit {self.max_missed}): dead")
        still = now - h.progressed_at
        if still >= self.hung_after_s:
            return (f"alive but its loop made no progress for {still:.1f} s "
                    f"(limit {self.hung_after_s:g} s): hung")
        return ""

    def check(self) -> dict[str, str]:
        """Watched roles that are unhealthy now -> why."""
        out = {}
        for iid in list(self.roles):
            reason = self.status(iid)
            if reason:
                out[iid] = reason
        return out
