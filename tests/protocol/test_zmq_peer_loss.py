"""A peer we dialled that dies is seen as gone (issue 9 scenario 3, transport side): a closed
connection, and a frozen process or dead node that closes nothing (the DEALER heartbeat times
out), both call ``on_disconnect`` and make the peer not ready until its next HelloAck.

The heartbeat's timing is libzmq's: these tests wait for what must happen (failing only when
it never does, after :data:`HANG_S`) and show which mechanism did it by a control connection,
never by how long it took (a busy machine makes everything later)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from specmesh.protocol.zmq_transport import ZmqMailbox

ROOT = Path(__file__).resolve().parents[2]


#: seconds after which a wait for something that must happen fails as hung
HANG_S = 60.0


def _pump(mailboxes, cond, what: str) -> None:
    """recv on every mailbox of ``mailboxes`` until ``cond()``.

    Raises:
        AssertionError: ``what`` did not happen within :data:`HANG_S`.
    """
    deadline = time.monotonic() + HANG_S
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {HANG_S:g} s"
        for mb in mailboxes:
            mb.recv(0.01)


def _pump_for(mailboxes, seconds: float) -> None:
    """recv on every mailbox of ``mailboxes`` for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for mb in mailboxes:
            mb.recv(0.01)


def test_closed_peer_is_reported_and_not_ready():
    server = ZmqMailbox("verifier-0", "verifier")
    lost: list[str] = []
    client = ZmqMailbox("gateway-0", "gateway", on_disconnect=lost.append)
    try:
        client.connect("verifier-0", server.endpoint)
        _pump([server, client], lambda: client.ready("verifier-0"), "connected")
        server.close()
        _pump([client], lambda: lost, "on_disconnect")
        assert lost == ["verifier-0"] and not client.ready("verifier-0")
    finally:
        client.close()
        server.close()


def test_frozen_peer_is_dropped_by_the_heartbeat():
    code = ("import sys; from specmesh.protocol.zmq_transport import ZmqMailbox\n"
            "mb = ZmqMailbox('verifier-0', 'verifier'); print(mb.endpoint, flush=True)\n"
            "while True: mb.recv(0.05)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lost: list[str] = []
    client = ZmqMailbox("gateway-0", "gateway", on_disconnect=lost.append,
                        heartbeat_ivl_ms=200, heartbeat_timeout_ms=1000)
    # the control: the same peer dialled without a heartbeat, which only a closed connection
    # could tell about
    control_lost: list[str] = []
    control = ZmqMailbox("gateway-1", "gateway", on_disconnect=control_lost.append,
                         heartbeat_ivl_ms=0)
    try:
        endpoint = proc.stdout.readline().strip()
        assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
        client.connect("verifier-0", endpoint)
        control.connect("verifier-0", endpoint)
        both = [client, control]
        _pump(both, lambda: client.ready("verifier-0") and control.ready("verifier-0"),
              "connected")
        # heartbeats flow while the peer runs: connected past the heartbeat timeout
        _pump_for(both, 1.5)
        assert not lost and client.ready("verifier-0")
        os.kill(proc.pid, signal.SIGSTOP)  # no FIN, no RST: only the heartbeat can tell
        _pump(both, lambda: lost, "the heartbeat's on_disconnect")
        assert lost == ["verifier-0"] and not client.ready("verifier-0")
        control.recv(0.01)
        # nothing was closed: the control connection still knows of no loss
        assert not control_lost and control.ready("verifier-0")
    finally:
        client.close()
        control.close()
        proc.kill()
        proc.wait(5)
