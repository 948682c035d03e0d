"""Controller: the roster of role instances, pushed into every registered role on change.

Plain class; cluster/actors.py makes it the named Ray actor ``specmesh-controller``. Roles
register themselves (and again after a restart, with a new incarnation); every change is pushed
to all roles with their ``update_roster`` method. Never on the per-token path.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


class Controller:
    def __init__(self) -> None:
        self.roster: dict[str, dict] = {}  # instance_id -> info (role, endpoint, incarnation...)
        self.handles: dict[str, object] = {}
        self.version = 0
        self.epoch = time.time_ns()  # a restarted controller counts versions anew

    def register(self, info: dict, handle: object = None) -> int:
        """Add or replace ``info['instance_id']``; returns the roster version."""
        iid = info["instance_id"]
        old = self.roster.get(iid)
        if old is not None and old.get("incarnation") == info.get("incarnation"):
            return self.version
        self.roster[iid] = dict(info, registered_at=time.time())
        if handle is not None:
            self.handles[iid] = handle
        self.version += 1
        log.info("roster v%d: %s %s at %s", self.version, info["role"], iid, info["endpoint"])
        self._push()
        return self.version

    def deregister(self, instance_id: str) -> int:
        if self.roster.pop(instance_id, None) is not None:
            self.handles.pop(instance_id, None)
            self.version += 1
            self._push()
        return self.version

    def get_roster(self) -> list[dict]:
        return list(self.roster.values())

    def _push(self) -> None:
        roster = self.get_roster()
        for iid, handle in list(self.handles.items()):
            try:
                _call(handle, "update_roster", roster, (self.epoch, self.version))
            except Exception as err:  # a dead role is removed when it re-registers or dies
                log.warning("roster push to %s failed: %s", iid, err)


def _call(handle: object, method: str, *args) -> object:
    """Call ``method`` on a Ray actor handle (fire and forget) or a plain object."""
    fn = getattr(handle, method)
    remote = getattr(fn, "remote", None)
    return remote(*args) if remote is not None else fn(*args)
