"""Test hosts made of Linux namespaces on one machine (issue 39): each host is a network
namespace (its own interface ``eth0`` with a private address, its own loopback) joined to the
others by a veth pair into one bridge, plus a PID and mount namespace (so ``ray stop`` run on a
host sees only that host's processes, as on a real machine), and an SSH server listening only
on the host's address with a host key and a client key made for the run.

The hosts share this machine's files, so the project's virtualenv works inside them
(``nsenter`` / ``ssh root@IP``), except root's home and ``/tmp/ray``, which are per host
(cluster/netns_sshd.py). The bridge holds the subnet's ``.1`` (cluster/netns_bridge.py), so
``ray up`` run here reaches the hosts ``.2``, ``.3``, ... over SSH. Needs root, iproute2,
util-linux (``unshare``, ``nsenter``) and openssh-server (``sshd``).

    python -m specmesh.cluster.netns_hosts up [--hosts 3] [--dir DIR] [--render-config YAML]
    python -m specmesh.cluster.netns_hosts down DIR

``up`` prints the hosts as one JSON line and keeps them until interrupted (Ctrl-C, SIGTERM);
then, or when setting up fails half-way, everything is removed: sshd and every process of the
hosts, the namespaces, veth pairs and bridge, the temp dir. ``down DIR`` removes what a run
whose process was killed left (it reads ``DIR/hosts.json``); every ``up`` also removes first
the hosts of earlier runs whose process is gone (:func:`remove_stale`).
"""

from __future__ import annotations

import argparse
import fcntl
import ipaddress
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specmesh.cluster.netns_bridge import add_bridge, add_host_link, free_subnet, ip
from specmesh.cluster.netns_config import render_config
from specmesh.cluster.netns_sshd import (READY_TIMEOUT_S, SSH_PORT, SSHD, kill, launch_sshd,
                                         make_keys, ssh_argv, wait_first_child, wait_gone,
                                         wait_tcp)

#: subnets tried in order; the first one no interface of this machine uses is taken
SUBNETS = [f"10.77.{i}.0/24" for i in range(256)]
#: serialises the choice of subnet and names between concurrent runs on one machine
LOCK_PATH = "/tmp/specmesh-netns.lock"


@dataclass
class Host:
    """One namespace host: its namespace, address, the bridge side of its veth pair
    (``veth``, in this machine's namespace) and the PID of its namespaces' first process."""

    name: str
    netns: str
    ip: str
    veth: str
    init_pid: int = 0
    sshd_pid: int = 0


@dataclass
class NetnsHosts:
    """Two or more namespace hosts on one bridge. ``up()`` makes them, ``down()`` removes
    whatever exists of them (safe on a half-made set and to call twice).

    Attributes:
        count: number of hosts (``h0`` is meant as the head).
        dir: the run's temp dir: keys, sshd configs, logs, ``hosts.json``.
        tag: 6 hex digits naming the run's namespaces (``sm<tag>h<i>``), veths
            (``smv<tag>h<i>``) and bridge (``smb<tag>``).
    """

    count: int = 3
    dir: str = ""
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    subnet: str = ""
    bridge: str = ""
    bridge_ip: str = ""
    hosts: list[Host] = field(default_factory=list)
    owner_pid: int = field(default_factory=os.getpid)

    @property
    def key(self) -> str:
        """The client's private key (ed25519) that every host's sshd admits for root."""
        return os.path.join(self.dir, "id_ed25519")

    @property
    def ips(self) -> list[str]:
        return [h.ip for h in self.hosts]

    def in_subnet(self, address: str) -> bool:
        """Whether ``address`` (an IP) lies in the hosts' subnet."""
        try:
            return ipaddress.ip_address(address) in ipaddress.ip_network(self.subnet)
        except ValueError:
            return False

    def up(self) -> NetnsHosts:
        """Make the bridge, the namespaces with their veth pairs and addresses, the keys and
        one sshd per host; returns once every sshd accepts connections. On any failure the
        half-made set is removed before the error propagates.

        Raises:
            RuntimeError: not root, a tool missing, or a step failed (its command and stderr).
        """
        if os.geteuid() != 0:
            raise RuntimeError("namespace hosts need root (ip netns, unshare)")
        for tool in ("ip", "unshare", "nsenter", "ssh-keygen", SSHD):
            if shutil.which(tool) is None:
                raise RuntimeError(f"namespace hosts need {tool!r} (apt-get install -y "
                                   "iproute2 util-linux openssh-server)")
        self.dir = self.dir or tempfile.mkdtemp(prefix="smnetns-", dir="/tmp")
        os.makedirs(self.dir, exist_ok=True)
        try:
            with open(LOCK_PATH, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                remove_stale()
                self._network()
            self._keys()
            for h in self.hosts:
                self._sshd(h)
            self._save()
            for h in self.hosts:
                wait_tcp(h.ip, SSH_PORT, READY_TIMEOUT_S)
        except BaseException:
            self.down()
            raise
        return self

    def _network(self) -> None:
        self.subnet = free_subnet(SUBNETS)
        net = ipaddress.ip_network(self.subnet)
        self.bridge, self.bridge_ip = f"smb{self.tag}", str(net[1])
        self._save()  # from here on, down() knows what to remove
        add_bridge(self.bridge, self.bridge_ip, net.prefixlen)
        for i in range(self.count):
            h = Host(name=f"h{i}", netns=f"sm{self.tag}h{i}", ip=str(net[2 + i]),
                     veth=f"smv{self.tag}h{i}")
            self.hosts.append(h)
            self._save()
            add_host_link(h.netns, h.veth, f"smp{self.tag}h{i}", h.ip, net.prefixlen,
                          self.bridge, self.bridge_ip)

    def _keys(self) -> None:
        make_keys(self.dir, self.key, self.tag, [h.name for h in self.hosts])

    def _sshd(self, h: Host) -> None:
        """Host ``h``'s sshd (cluster/netns_sshd.py), recording its PIDs as they appear."""
        proc = launch_sshd(self.dir, h.name, h.ip, h.netns, self.home(h))
        h.sshd_pid = proc.pid
        h.init_pid = wait_first_child(proc, h.name, self.dir)

    def down(self) -> None:
        """Remove every process of the hosts (killing a PID namespace's first process kills
        the namespace's every process), the namespaces, veths, bridge and the temp dir.
        Tolerates what does not exist (a half-made set, a second call)."""
        for h in self.hosts:
            for pid in (h.init_pid, h.sshd_pid):
                kill(pid)
            for pid in self.pids(h):  # anything left in the host's namespaces
                kill(pid)
            wait_gone(lambda: self.pids(h))
        for h in self.hosts:
            ip("netns", "del", h.netns, check=False)
            ip("link", "del", h.veth, check=False)
        if self.bridge:
            ip("link", "del", self.bridge, check=False)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.hosts = []

    def _save(self) -> None:
        Path(self.dir, "hosts.json").write_text(json.dumps(self.describe()))

    def describe(self) -> dict:
        """The run as JSON: subnet, bridge, key, hosts (name, netns, ip, veth, PIDs)."""
        out = asdict(self)
        out["key"] = self.key
        return out

    @classmethod
    def load(cls, dir_: str) -> NetnsHosts:
        """The run described by ``dir_/hosts.json`` (for ``down`` after a crash)."""
        return cls.load_description(json.loads(Path(dir_, "hosts.json").read_text()))

    @classmethod
    def load_description(cls, described: dict) -> NetnsHosts:
        """The run that ``describe()`` returned ``described`` for."""
        d = dict(described)
        d.pop("key", None)
        d["hosts"] = [Host(**h) for h in d["hosts"]]
        return cls(**d)

    def argv(self, h: Host, argv: list[str], wd: str | None = None) -> list[str]:
        """``argv`` run inside host ``h``'s network, PID and mount namespaces (as a process
        started over SSH there would be), in directory ``wd`` (default: the current one)."""
        return ["nsenter", "-t", str(h.init_pid), "-n", "-p", "-m",
                f"--wd={wd or os.getcwd()}", "--", *argv]

    def home(self, h: Host) -> str:
        """Host ``h``'s home directory of root (its /etc/passwd names it)."""
        return os.path.join(self.dir, f"home_{h.name}")

    def ssh_argv(self, h: Host, command: str) -> list[str]:
        """``ssh root@h.ip command`` with the run's key (no known-hosts file)."""
        return ssh_argv(self.key, h.ip, command)

    def pids(self, h: Host) -> list[int]:
        """Every process in host ``h``'s PID namespace (from this machine's /proc)."""
        if not h.init_pid:
            return []
        try:
            ns = os.readlink(f"/proc/{h.init_pid}/ns/pid")
        except OSError:
            return []
        out = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if os.readlink(entry / "ns" / "pid") == ns:
                        out.append(int(entry.name))
                except OSError:
                    pass
        return out

    def counters(self) -> dict[str, dict[str, int]]:
        """host name -> rx_bytes / tx_bytes / rx_packets / tx_packets of its veth's bridge
        side (this machine's /sys/class/net; rx there is what the host sent)."""
        out = {}
        for h in self.hosts:
            base = Path("/sys/class/net", h.veth, "statistics")
            out[h.name] = {k: int((base / k).read_text()) for k in (
                "rx_bytes", "tx_bytes", "rx_packets", "tx_packets")}
        return out


def remove_stale(tmp: str = "/tmp") -> list[str]:
    """Remove the hosts of earlier runs whose process is gone (killed before it could clean
    up: SIGKILL, a CI timeout): every ``smnetns-*/hosts.json`` under ``tmp`` whose
    ``owner_pid`` no longer runs. Returns their dirs."""
    removed = []
    for path in Path(tmp).glob("smnetns-*/hosts.json"):
        try:
            run = NetnsHosts.load(str(path.parent))
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if run.owner_pid and not Path(f"/proc/{run.owner_pid}").exists():
            run.down()
            removed.append(str(path.parent))
    return removed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specmesh.cluster.netns_hosts",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="make the hosts; keep them until interrupted")
    u.add_argument("--hosts", type=int, default=3, help="number of hosts (>= 2; default 3)")
    u.add_argument("--dir", default="", help="the run's temp dir (default: a new /tmp/smnetns-*)")
    u.add_argument("--render-config", metavar="YAML", default=None,
                   help="write this ray up config (deploy/cluster-local.yaml) for the hosts "
                        "to DIR/cluster.yaml, with this checkout and its venv")
    d = sub.add_parser("down", help="remove what a killed `up` left")
    d.add_argument("dir")
    args = p.parse_args(argv)
    if args.cmd == "down":
        NetnsHosts.load(args.dir).down()
        return 0
    if args.hosts < 2:
        p.error("--hosts must be >= 2")
    hosts = NetnsHosts(count=args.hosts, dir=args.dir)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    try:
        hosts.up()
        info = hosts.describe()
        if args.render_config:
            token = os.path.join(hosts.dir, "auth_token")
            Path(token).write_text(secrets.token_hex(32))
            repo = str(Path(__file__).resolve().parents[1])
            out = Path(hosts.dir, "cluster.yaml")
            out.write_text(render_config(Path(args.render_config).read_text(), hosts, repo,
                                         sys.prefix, token))
            info.update(config=str(out), token=token)
        print(json.dumps(info), flush=True)
        while not stop["now"]:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        hosts.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
