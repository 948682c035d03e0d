"""Controller.roster_snapshot: the roster a role reads right after registering (cluster/actors.py
``_register(pull=True)``) names that role's new incarnation, with the (epoch, version) of the
push it stands for (RoleHost.update_roster then drops that push if it comes late)."""

from __future__ import annotations

from specmesh.cluster.controller import Controller


def _info(iid: str, role: str, incarnation: int, key: str = "") -> dict:
    return {"instance_id": iid, "role": role, "endpoint": f"tcp://127.0.0.1:1/{iid}",
            "incarnation": incarnation, "curve": bool(key), "curve_key": key}


class Dropped:
    """A role whose pushed roster never arrives (Ray dropped the call: it was not alive)."""

    def __init__(self) -> None:
        self.pushes = []

    def update_roster(self, roster, version=None) -> None:
        self.pushes.append(version)


def test_a_restarted_role_reads_the_roster_naming_its_new_incarnation():
    c = Controller(interval_s=1.0, max_missed=3)
    c.register(_info("verifier-0", "verifier", 1), Dropped())
    c.register(_info("drafter-0", "drafter", 1), Dropped())
    c.register(_info("drafter-0", "drafter", 2), Dropped())  # Ray restarted it
    roster, version = c.roster_snapshot()
    assert version == (c.epoch, c.version)
    assert {r["instance_id"]: r["incarnation"] for r in roster} == {"verifier-0": 1,
                                                                  "drafter-0": 2}

