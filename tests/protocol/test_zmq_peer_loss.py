"""A peer we dialled that dies is seen as gone (issue 9 scenario 3, transport side): a closed
connection, and a frozen process or dead node that closes nothing (the DEALER heartbeat times
out), both call ``on_disconnect`` and make the peer not ready until its next HelloAck."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from specmesh.protocol.zmq_transport import ZmqMailbox

ROOT = Path(__file__).resolve().parents[2]


def _pump(mb, cond, timeout_s: float) -> float:
    """recv on ``mb`` until ``cond()``; returns the seconds it took."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "condition not met in time"
        mb.recv(0.02)
    return time.monotonic() - t0


def test_closed_peer_is_reported_and_not_ready():
    server = ZmqMailbox("verifier-0", "verifier")
    lost: list[str] = []
    client = ZmqMailbox("gateway-0", "gateway", on_disconnect=lost.append)
    try:
        client.connect("verifier-0", server.endpoint)
        deadline = time.monotonic() + 5
        while not client.ready("verifier-0"):
            assert time.monotonic() < deadline
            server.recv(0.01)
            client.recv(0.01)
        server.close()
        assert _pump(client, lambda: lost, 3.0) < 3.0
        assert lost == ["verifier-0"] and not client.ready("verifier-0")
    finally:
        client.close()
        server.close()


def test_frozen_peer_is_dropped_by_the_heartbeat():
    code = ("import sys; from protocol.zmq_transport import ZmqMailbox\n"
            "mb = ZmqMailbox('verifier-0', 'verifier'); print(mb.endpoint, flush=True)\n"
            "while True: mb.recv(0.05)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lost: list[str] = []
    client = ZmqMailbox("gateway-0", "gateway", on_disconnect=lost.append,
                        heartbeat_ivl_ms=200, heartbeat_timeout_ms=1000)
    try:
        endpoint = proc.stdout.readline().strip()
        assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
        client.connect("verifier-0", endpoint)
        _pump(client, lambda: client.ready("verifier-0"), 10.0)
        time.sleep(0.5)  # heartbeats flow while the peer runs: still connected
        client.recv(0.05)
        assert not lost and client.ready("verifier-0")
        os.kill(proc.pid, signal.SIGSTOP)  # no FIN, no RST: only the heartbeat can tell
        took = _pump(client, lambda: lost, 5.0)
        assert 0.5 < took < 5.0 and not client.ready("verifier-0")
    finally:
        client.close()
        proc.kill()
        proc.wait(5)
