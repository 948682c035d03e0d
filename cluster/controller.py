"""Controller: the roster of role instances, pushed into every registered role on change, the
roles' health (docs/architecture.md, 'Cluster and health'), and the settings ``auto`` decided
for the cluster, once (:meth:`Controller.settle`: every role launched later follows them).

Plain class; cluster/actors.py makes it the named Ray actor ``specmesh-controller`` (and runs
:meth:`Controller.check_health` about once a second in a thread of it). Roles register
themselves (and again after a restart, with a new incarnation, which replaces the old entry);
every change is pushed to all roles with their ``update_roster`` method. Each role sends a
heartbeat about once a second (:meth:`Controller.heartbeat`); a role that is dead (no
heartbeat for SUSPECT_MISSED_BEATS intervals and Ray says its actor is gone, see
:meth:`silent_roles` and :meth:`actor_gone`; or no heartbeat for MAX_MISSED_BEATS intervals) or
hung (heartbeats, but its loop counter stands still for HUNG_AFTER_S) is deregistered and the
new roster pushed to its peers (cluster/health.py). Never on the per-token path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from specmesh.cluster.health import (
    HEARTBEAT_INTERVAL_S,
    HUNG_AFTER_S,
    MAX_MISSED_BEATS,
    SUSPECT_MISSED_BEATS,
    HealthMonitor,
)

log = logging.getLogger(__name__)


class Controller:
    """Args: the heartbeat ``interval_s`` and ``max_missed`` beats (see
    :class:`~cluster.health.HealthMonitor`), ``clock`` (monotonic seconds; a fake one in
    tests). Thread-safe: the Ray edge checks health from its own thread."""

    def __init__(self, interval_s: float = HEARTBEAT_INTERVAL_S,
                 max_missed: int = MAX_MISSED_BEATS,
                 clock: Callable[[], float] = time.monotonic,
                 hung_after_s: float | None = HUNG_AFTER_S) -> None:
        self.roster: dict[str, dict] = {}  # instance_id -> info (role, endpoint, incarnation...)
        self.handles: dict[str, object] = {}
        self.version = 0
        self.epoch = time.time_ns()  # a restarted controller counts versions anew
        self.health = HealthMonitor(interval_s, max_missed, clock, hung_after_s)
        #: deregistered as unhealthy (instance id -> entry, handle, why): re-admitted when its
        #: heartbeats show its loop turning again, replaced when it registers anew
        self.removed: dict[str, dict] = {}
        #: deregistered because Ray said the actor is gone (instance id -> why); reported with
        #: ``removed`` by :meth:`health_report`, never re-admitted (a restart registers anew)
        self.gone: dict[str, str] = {}
        #: (instance id, incarnation) deregistered on purpose: not asked to register again
        self.dismissed: set[tuple[str, int | None]] = set()
        #: instance id -> the load its last heartbeat reported (verifier: KV room, queue)
        self.loads: dict[str, dict] = {}
        #: the cluster's decided settings (dtype, max_model_len, drafter: cluster/auto.py),
        #: name -> {"value", "reason", "given"}: the first value each was given stays
        self.settings: dict[str, dict] = {}
        self.num_deregistered = 0  # roles removed as dead or hung
        self.num_checks = 0  # check_health calls
        self._last_check_at: float | None = None
        self._lock = threading.RLock()

    def register(self, info: dict, handle: object = None) -> int:
        """Add or replace ``info['instance_id']``; returns the roster version."""
        iid = info["instance_id"]
        with self._lock:
            old = self.roster.get(iid)
            if old is not None and old.get("incarnation") == info.get("incarnation"):
                return self.version
            self.roster[iid] = dict(info, registered_at=time.time())
            if handle is not None:
                self.handles[iid] = handle
            self.removed.pop(iid, None)
            self.gone.pop(iid, None)
            self.dismissed.discard((iid, info.get("incarnation")))
            self.health.watch(iid, info.get("incarnation"))
            self.version += 1
            log.info("roster v%d: %s %s at %s", self.version, info["role"], iid,
                     info["endpoint"])
            self._push()
            return self.version

    def deregister(self, instance_id: str) -> int:
        with self._lock:
            entry = self.roster.get(instance_id)
            if entry is not None:
                self.dismissed.add((instance_id, entry.get("incarnation")))
            self.removed.pop(instance_id, None)
            self._remove(instance_id)
            return self.version

    def _remove(self, instance_id: str, forget: bool = True) -> bool:
        if self.roster.pop(instance_id, None) is None:
            return False
        self.handles.pop(instance_id, None)
        if forget:
            self.health.forget(instance_id)
        self.loads.pop(instance_id, None)
        self.version += 1
        self._push()
        return True

    def settle(self, proposal: dict[str, dict]) -> dict[str, dict]:
        """Decide once: keep each setting of ``proposal`` (name -> {"value", "reason",
        "given"}) the cluster has not settled yet, and return every settled one. A role
        launched later follows them (``cluster.auto.follow_settled``); ``{}`` only reads."""
        with self._lock:
            for name, setting in proposal.items():
                if name not in self.settings:
                    self.settings[name] = dict(setting)
                    log.info("settled %s = %r (%s)", name, setting.get("value"),
                             setting.get("reason", ""))
            return {k: dict(v) for k, v in self.settings.items()}

    def get_roster(self) -> list[dict]:
        with self._lock:
            return list(self.roster.values())

    def roster_snapshot(self) -> tuple[list[dict], tuple[int, int]]:
        """The roster with its (epoch, version), read together: what a role that has just
        registered applies itself (cluster/actors.py). The push its registration makes can
        reach it before Ray has it alive, and Ray drops such a call (ActorUnavailableError,
        unseen: pushes are fire and forget); a role Ray restarted then admitted no peer's
        CurveZMQ key until the next roster change (seen across namespace hosts, issue 39)."""
        with self._lock:
            return list(self.roster.values()), (self.epoch, self.version)

    # -- health ----------------------------------------------------------------------------

    def heartbeat(self, beat: dict) -> dict:
        """One heartbeat of a role: ``instance_id``, ``incarnation``, ``progress`` (its loop
        counter) and ``load`` (what routing needs). Returns ``register`` (True: the controller
        does not know this role, e.g. it restarted: register again) and ``loads`` (instance id
        -> load of every role in the roster)."""
        iid, incarnation = beat["instance_id"], beat.get("incarnation")
        progress = beat.get("progress", 0)
        with self._lock:
            entry = self.roster.get(iid)
            if entry is not None and entry.get("incarnation") == incarnation:
                self.health.beat(iid, incarnation, progress)
                self.loads[iid] = dict(beat.get("load") or {})
            elif (gone := self.removed.get(iid)) is not None \
                    and gone["entry"].get("incarnation") == incarnation:
                self.health.beat(iid, incarnation, progress)
                if not self.health.status(iid):
                    self._readmit(iid)
                    self.loads[iid] = dict(beat.get("load") or {})
            elif entry is None and (iid, incarnation) not in self.dismissed:
                return {"register": True, "loads": self._loads()}
            return {"register": False, "loads": self._loads()}

    def _loads(self) -> dict[str, dict]:
        return {iid: self.loads.get(iid, {}) for iid in self.roster}

    def check_health(self) -> dict[str, str]:
        """Deregister every role that is dead or hung now and push the new roster to its
        peers; returns instance id -> why, for the roles removed."""
        with self._lock:
            self.num_checks += 1
            self._last_check_at = self.health.clock()
            out = {}
            for iid, reason in self.health.check().items():
                entry, handle = self.roster.get(iid), self.handles.get(iid)
                if entry is None:
                    continue  # removed already (watched for its recovery)
                log.warning("deregistering %s %s (incarnation %s): %s", entry["role"], iid,
                            entry.get("incarnation"), reason)
                # still watched: the same incarnation may come back (a pause, not a death)
                self._remove(iid, forget=False)
                self.removed[iid] = {"entry": entry, "handle": handle, "reason": reason}
                self.num_deregistered += 1
                out[iid] = reason
            return out

    def silent_roles(self, missed: int = SUSPECT_MISSED_BEATS,
                     ) -> dict[str, tuple[object, int | None]]:
        """Roles in the roster whose heartbeats stopped ``missed`` intervals ago or more:
        instance id -> (actor handle, incarnation). The Ray edge asks Ray whether their actors
        still exist (:meth:`actor_gone`); a live one stays until MAX_MISSED_BEATS."""
        with self._lock:
            bound = missed * self.health.interval_s
            return {iid: (self.handles.get(iid), entry.get("incarnation"))
                    for iid, entry in self.roster.items()
                    if self.health.silent_s(iid) >= bound}

    def actor_gone(self, instance_id: str, incarnation: int | None, why: str) -> bool:
        """Ray says the actor of ``instance_id`` (this incarnation) no longer exists: deregister
        it now and push the roster (a restarted one registers anew). False when that
        incarnation is not in the roster (replaced or removed meanwhile)."""
        with self._lock:
            entry = self.roster.get(instance_id)
            if entry is None or entry.get("incarnation") != incarnation:
                return False
            silent = self.health.silent_s(instance_id)
            reason = f"no heartbeat for {silent:.1f} s and its actor is gone ({why}): dead"
            log.warning("deregistering %s %s (incarnation %s): %s", entry["role"], instance_id,
                        incarnation, reason)
            self.dismissed.add((instance_id, incarnation))
            self.removed.pop(instance_id, None)
            self._remove(instance_id)
            self.gone[instance_id] = reason
            self.num_deregistered += 1
            return True

    def _readmit(self, iid: str) -> None:
        gone = self.removed.pop(iid)
        log.warning("re-admitting %s: its loop makes progress again (removed: %s)", iid,
                    gone["reason"])
        self.roster[iid] = dict(gone["entry"], registered_at=time.time())
        if gone["handle"] is not None:
            self.handles[iid] = gone["handle"]
        self.version += 1
        self._push()

    def health_report(self) -> dict:
        """Per role in the roster: why it is unhealthy ("" when healthy) and heartbeats seen;
        plus the roles removed as unhealthy and why."""
        with self._lock:
            roles = {iid: {"status": self.health.status(iid),
                           "num_beats": h.num_beats if (h := self.health.roles.get(iid))
                           else 0} for iid in self.roster}
            last = self._last_check_at
            removed = {**self.gone, **{i: g["reason"] for i, g in self.removed.items()}}
            return {"roles": roles, "removed": removed,
                    "num_deregistered": self.num_deregistered, "version": self.version,
                    "num_checks": self.num_checks,
                    "last_check_age_s": None if last is None else self.health.clock() - last}

    def _push(self) -> None:
        roster = list(self.roster.values())
        for iid, handle in list(self.handles.items()):
            try:
                _call(handle, "update_roster", roster, (self.epoch, self.version))
            except Exception as err:  # a dead role is removed by the health check
                log.warning("roster push to %s failed: %s", iid, err)


def _call(handle: object, method: str, *args) -> object:
    """Call ``method`` on a Ray actor handle (fire and forget) or a plain object."""
    fn = getattr(handle, method)
    remote = getattr(fn, "remote", None)
    return remote(*args) if remote is not None else fn(*args)
