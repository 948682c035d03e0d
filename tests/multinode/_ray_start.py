"""``ray start`` that keeps a node on the loopback address (tests/multinode only).

Ray on Linux rewrites ``--node-ip-address=127.0.0.1`` to the machine's outward address
(``services.resolve_ip_for_localhost``), so two nodes on one machine would talk over that
address. Here the node address stays 127.0.0.1. The processes this one starts (raylet agents,
workers) inherit ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` from the test, which makes their own
address lookup answer 127.0.0.1 too; this process alone needs multi-node support switched back
on, or ``ray start --address`` (a worker node) refuses to run.

    python _ray_start.py <ray start arguments>
"""

import sys

import ray._private.ray_constants as ray_constants
import ray._private.services as services

ray_constants.ENABLE_RAY_CLUSTER = True
services.get_node_ip_address = lambda address=None: "127.0.0.1"

from ray.scripts.scripts import main  # noqa: E402

if __name__ == "__main__":
    sys.argv = ["ray", "start", *sys.argv[1:]]
    sys.exit(main())
