#!/usr/bin/env bash
# Stop every specmesh actor (roles and controller, namespace "specmesh") of a Ray cluster; the
# Ray cluster itself keeps running. Run on a node of the cluster.
#   RAY_ADDRESS  Ray cluster (default: auto)
#   PYTHON       interpreter with specmesh installed (default: python3)
set -euo pipefail

"${PYTHON:-python3}" - "${RAY_ADDRESS:-auto}" <<'PY'
import sys

import ray

from cluster.actors import CONTROLLER_NAME, NAMESPACE

ray.init(address=sys.argv[1], namespace=NAMESPACE, log_to_driver=False)
names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["namespace"] == NAMESPACE)
# roles first (a role's stop() closes its sockets and threads), the controller last
roles = [n for n in names if n != CONTROLLER_NAME]
for name in roles + [n for n in names if n == CONTROLLER_NAME]:
    actor = ray.get_actor(name, namespace=NAMESPACE)
    if name != CONTROLLER_NAME:
        try:
            ray.get(actor.stop.remote(), timeout=20)
        except Exception as err:  # noqa: BLE001 - killed below anyway
            print(f"[stop_roles] {name}: stop() failed: {err!r}", file=sys.stderr)
    ray.kill(actor, no_restart=True)
    print(f"[stop_roles] stopped {name}", file=sys.stderr)
PY
