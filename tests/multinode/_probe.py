"""Ray driver for tests/multinode: run in its own process (the pytest process may already be
connected to the embedded Ray of the other tests, and a driver joins one cluster only).

    python _probe.py nodes ADDRESS TIMEOUT   wait for 2 alive nodes; print them
    python _probe.py ready ADDRESS TIMEOUT   wait until the 4 roles connected; print roster,
                                             stats and where each actor runs
    python _probe.py named ADDRESS           print the named actors of namespace specmesh

Prints one JSON object on the last stdout line.
"""

from __future__ import annotations

import json
import sys
import time

import ray

from specmesh.cluster.actors import CONTROLLER_NAME, NAMESPACE

ROLES = ("prefill-0", "drafter-0", "verifier-0", "gateway-0")


def alive_nodes() -> list[dict]:
    return [{"node_id": n["NodeID"], "ip": n["NodeManagerAddress"],
             "resources": n["Resources"]} for n in ray.nodes() if n["Alive"]]


def wait_nodes(timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        nodes = alive_nodes()
        if len(nodes) >= 2 and any("drafter" in n["resources"] for n in nodes):
            return {"nodes": nodes}
        if time.monotonic() > deadline:
            raise TimeoutError(f"nodes did not join: {nodes}")
        time.sleep(0.3)


def actor_nodes() -> dict[str, str]:
    """Name -> node id of each live named actor, from the GCS actor table (the state API
    ``ray.util.state.list_actors`` needs the dashboard, which these tests do not start)."""
    out = {}
    for info in ray._private.state.actors().values():
        if info.get("Name") and info.get("State") == "ALIVE":
            out[info["Name"]] = info["Address"]["NodeID"]
    return out


def wait_ready(timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    actors = {}
    while len(actors) < len(ROLES):  # roles launched in the background appear one by one
        for iid in set(ROLES) - set(actors):
            try:
                actors[iid] = ray.get_actor(f"specmesh-{iid}", namespace=NAMESPACE)
            except ValueError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no actor specmesh-{iid} after {timeout} s") from None
        time.sleep(0.3 if len(actors) < len(ROLES) else 0)
    actors = {iid: actors[iid] for iid in ROLES}
    controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    while True:
        stats = {iid: ray.get(a.stats.remote(), timeout=30) for iid, a in actors.items()}
        roster = ray.get(controller.get_roster.remote(), timeout=30)
        if (len(roster) == len(ROLES) and len(stats["verifier-0"]["ready_peers"]) >= 2
                and stats["gateway-0"]["ready_verifiers"] == ["verifier-0"]):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"roles did not connect: roster={roster} stats={stats}")
        time.sleep(0.3)
    infos = {iid: ray.get(a.info.remote(), timeout=30) for iid, a in actors.items()}
    health = {iid: ray.get(a.health.remote(), timeout=30) for iid, a in actors.items()}
    return {"nodes": alive_nodes(), "actor_nodes": actor_nodes(), "infos": infos,
            "roster": roster, "health": health,
            "num_ray_calls": {iid: s["num_ray_calls"] for iid, s in stats.items()}}


def named() -> dict:
    return {"named": sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                            if a["namespace"] == NAMESPACE)}


def main() -> None:
    cmd, address = sys.argv[1], sys.argv[2]
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False,
             logging_level="WARNING")
    if cmd == "nodes":
        out = wait_nodes(float(sys.argv[3]))
    elif cmd == "ready":
        out = wait_ready(float(sys.argv[3]))
    elif cmd == "named":
        out = named()
    else:
        raise SystemExit(f"unknown command {cmd!r}")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
