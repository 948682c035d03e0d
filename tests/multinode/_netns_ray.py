"""Ray nodes on the namespace hosts of cluster/netns_hosts.py (tests/multinode only): one
``ray start --block`` per host, run inside the host's namespaces with ``--node-ip-address`` =
the host's own address, so every node, role and driver talks over the hosts' veth links as on
separate machines. The counterpart of ``ray.cluster_utils.Cluster`` on 127.0.0.1, with the
same ``address`` / ``shutdown``. Started by _mn_setup.py from this machine's namespace; the
driver (_mn_driver.py) then runs on the head host itself (a Ray driver must run on a node of its
cluster) and joins with ``connect_and_wait``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import ray

from specmesh.cluster.netns_hosts import NetnsHosts

RAY_PORT = 6379
NODE_TIMEOUT_S = 90.0


class NetnsRayCluster:
    """A head on host 0 and one worker node per ``workers`` entry (its resources) on hosts
    1, 2, ..., each started with ``nsenter`` into its host from this machine's namespace, with
    ``env`` (the token of Ray's token authentication among it)."""

    def __init__(self, hosts: NetnsHosts, temp_dir: str, head_resources: dict,
                 workers: list[dict], env: dict) -> None:
        self.hosts, self.temp_dir, self.env = hosts, temp_dir, env
        self.head = hosts.hosts[0]
        self.address = f"{self.head.ip}:{RAY_PORT}"
        self.procs: list[subprocess.Popen] = []
        self._start(0, ["--head", f"--port={RAY_PORT}", "--include-dashboard=false",
                        f"--resources={json.dumps(head_resources)}"])
        _wait_tcp(self.head.ip, RAY_PORT, self.procs[0], NODE_TIMEOUT_S)
        for i, res in enumerate(workers, start=1):
            self._start(i, [f"--address={self.address}", f"--resources={json.dumps(res)}"])
        self.worker_ips = [hosts.hosts[i].ip for i in range(1, len(workers) + 1)]

    def _start(self, i: int, args: list[str]) -> None:
        h = self.hosts.hosts[i]
        ray_cli = str(Path(sys.executable).parent / "ray")
        cmd = self.hosts.argv(h, [
            ray_cli, "start", "--block", f"--node-ip-address={h.ip}", "--num-cpus=1",
            f"--temp-dir={os.path.join(self.temp_dir, h.name)}",
            "--object-store-memory=80000000", "--disable-usage-stats", *args])
        log = open(os.path.join(self.temp_dir, f"node-{h.name}.log"), "wb")  # noqa: SIM115
        env = {**self.env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}  # SIGTERM: stop now
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True))
        log.close()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-2000:]}"
                         for p in sorted(Path(self.temp_dir).glob("node-*.log")))

    def shutdown(self) -> None:
        """Worker nodes first, then the head (SIGTERM: ``ray start --block`` stops its
        processes); then anything whose command line names this cluster's temp dir."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if self.temp_dir in (entry / "cmdline").read_bytes().decode(
                            errors="replace"):
                        os.kill(int(entry.name), signal.SIGKILL)
                except (OSError, ProcessLookupError):
                    pass


def connect_and_wait(address: str, num_nodes: int, namespace: str,
                     timeout: float = NODE_TIMEOUT_S) -> None:
    """In the driver (on the head host): join the cluster at ``address`` and wait until
    ``num_nodes`` nodes are alive.

    Raises:
        TimeoutError: fewer nodes alive after ``timeout`` seconds.
    """
    ray.init(address=address, namespace=namespace, log_to_driver=False)
    deadline = time.monotonic() + timeout
    while len([n for n in ray.nodes() if n["Alive"]]) < num_nodes:
        if time.monotonic() > deadline:
            raise TimeoutError(f"nodes did not join: {ray.nodes()}")
        time.sleep(0.3)


def node_ids_by_ip(ips: list[str]) -> list[str]:
    """The Ray node ids of the alive nodes with these addresses, in order."""
    by_ip = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    return [by_ip[ip] for ip in ips]


def _wait_tcp(ip: str, port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start on {ip} exited with {proc.returncode}")
        try:
            with socket.create_connection((ip, port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {ip}:{port} after {timeout} s")
