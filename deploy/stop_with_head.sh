#!/usr/bin/env bash
# Stops Ray on this worker node once the head's Ray is gone. `ray down` with Ray's local
# (on-premise) provider runs `ray stop` on the head only (a cloud provider terminates the worker
# machines instead); a worker's raylet then exits by itself, but not every Ray process does
# (a log monitor with nothing to publish never notices), so deploy/cluster-local.yaml starts
# this in the background on each worker, after `ray start`.
#
#   stop_with_head.sh HEAD_IP [GCS_PORT]
#
# Checks the head's GCS port every 5 s; after 3 failed connections in a row, runs `ray stop`
# (this machine's Ray processes) and exits.
set -u
head="$1"
port="${2:-6379}"
misses=0
while [ "$misses" -lt 3 ]; do
    sleep 5
    if (exec 3<>"/dev/tcp/$head/$port") 2> /dev/null; then
        misses=0
    else
        misses=$((misses + 1))
    fi
done
echo "[stop_with_head] $head:$port gone: ray stop" >&2
exec ray stop
