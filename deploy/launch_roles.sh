#!/usr/bin/env bash
# Join the four specmesh roles to a running Ray cluster, in dependency order:
# prefill, drafter, verifier, gateway (or the roles ROLES lists). Run it on the head node after `ray up deploy/cluster.yaml`
# (for example `ray exec deploy/cluster.yaml 'bash ~/specmesh/deploy/launch_roles.sh'`).
#
# Each `specmesh launch` creates the named controller if it does not exist yet, creates one
# detached role actor (pinned to a node type by its custom resource), waits until the actor is
# up and prints its roster entry as one JSON line. The actors outlive this script; stop them
# with deploy/stop_roles.sh (or `ray down`). The first launch settles what `auto` decides for the
# cluster (dtype, max model length, drafter) in the controller; every later launch, of this
# script or a separate `specmesh launch`, follows it (and one given another value explicitly
# is refused with the value the cluster runs).
#
# Environment (all optional):
#   RAY_ADDRESS      Ray cluster to join (default: auto, i.e. the cluster of this node)
#   SPECMESH         the specmesh command (default: specmesh)
#   INSTANCE         suffix of the instance ids, <role>-<INSTANCE> (default: 0)
#   ROLES            the roles to launch, in order (default: "prefill drafter verifier gateway")
#   GATEWAY_PORT     HTTP port of the gateway (default: 8000; 0 = any free port)
#   PREFILL_HOST, DRAFTER_HOST, VERIFIER_HOST, GATEWAY_HOST
#                    address each role binds and advertises (ZMQ, and HTTP for the gateway):
#                    auto (default for prefill, drafter, verifier) = the IP of the node Ray runs
#                    it on, resolved again wherever Ray restarts it; 0.0.0.0 = every interface,
#                    advertising the node IP; the gateway defaults to 127.0.0.1 (HTTP reachable
#                    through an SSH tunnel only; auto or 0.0.0.0 exposes it to the network)
#   PREFILL_GPUS, VERIFIER_GPUS, DRAFTER_GPUS
#                    GPUs each role actor reserves (default: 0)
# Any arguments are passed to every `specmesh launch`, e.g.
#   deploy/launch_roles.sh --model /models/SmolLM2-135M-Instruct --num-speculative-tokens 4
set -euo pipefail

address="${RAY_ADDRESS:-auto}"
instance="${INSTANCE:-0}"
gateway_port="${GATEWAY_PORT:-8000}"
read -r -a specmesh <<< "${SPECMESH:-specmesh}"
read -r -a roles <<< "${ROLES:-prefill drafter verifier gateway}"

for role in "${roles[@]}"; do
    host_var="$(printf '%s' "$role" | tr '[:lower:]' '[:upper:]')_HOST"
    gpus_var="$(printf '%s' "$role" | tr '[:lower:]' '[:upper:]')_GPUS"
    if [ "$role" = gateway ]; then default_host=127.0.0.1; else default_host=auto; fi
    host="${!host_var:-$default_host}"
    gpus="${!gpus_var:-0}"
    echo "[launch_roles] $role-$instance on $host (gpus: $gpus)" >&2
    "${specmesh[@]}" launch "$role" --address "$address" --instance-id "$role-$instance" \
        --host "$host" --num-gpus "$gpus" --port "$gateway_port" "$@"
done
echo "[launch_roles] all roles launched" >&2
