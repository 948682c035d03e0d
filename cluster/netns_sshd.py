"""The SSH server of one namespace host (issue 39; the hosts themselves are
cluster/netns_hosts.py): the run's client key and one host key per host, and an ``sshd -D`` that
listens only on the host's address and runs as the first process of the host's own PID and
mount namespaces, with root's home (named by a per-host /etc/passwd) and Ray's temp dir
(``/tmp/ray``) bind-mounted per host, so what ``ray up`` writes there stays per host and per
run. Also the small process helpers the hosts share (running a command, killing a PID, waiting
for a TCP port)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

SSH_PORT = 22
SSHD = "/usr/sbin/sshd"
READY_TIMEOUT_S = 20.0
#: Ray's default temp dir; each host has its own
RAY_TMP = "/tmp/ray"


def make_keys(dir_: str, key: str, tag: str, host_names: list[str]) -> None:
    """The client key ``key`` (ed25519, no passphrase), admitted for root by every host's sshd
    (``dir_/authorized_keys``), and one host key ``dir_/host_key_<name>`` per host.

    Raises:
        RuntimeError: ssh-keygen failed (its stderr).
    """
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"specmesh-{tag}", "-f", key])
    shutil.copy(key + ".pub", os.path.join(dir_, "authorized_keys"))
    for name in host_names:
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
             os.path.join(dir_, f"host_key_{name}")])


def launch_sshd(dir_: str, name: str, ip: str, netns: str, home: str) -> subprocess.Popen:
    """sshd -D as the first process of host ``name``'s new PID and mount namespaces (with
    /proc of that PID namespace mounted), inside its network namespace ``netns``, listening on
    ``ip``; root's home there is ``home`` (made here, with an empty ``.bashrc``). Its config,
    log and pid file go to ``dir_``. Returns the launching process at once; its namespace's
    first process is :func:`wait_first_child`'s.
    """
    cfg = os.path.join(dir_, f"sshd_{name}.conf")
    Path(cfg).write_text("\n".join([
        f"ListenAddress {ip}:{SSH_PORT}",
        f"HostKey {dir_}/host_key_{name}",
        f"AuthorizedKeysFile {dir_}/authorized_keys",
        "PermitRootLogin prohibit-password", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
        f"PidFile {dir_}/sshd_{name}.pid", "PrintMotd no", "MaxStartups 100",
        "MaxSessions 100", ""]))
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation dir
    log = open(os.path.join(dir_, f"sshd_{name}.log"), "wb")  # noqa: SIM115
    os.makedirs(home, mode=0o700, exist_ok=True)
    Path(home, ".bashrc").touch()
    # the host's own home for root: /etc/passwd of the host's mount namespace only names
    # it (what `ray up` writes to ~, ~/.bashrc included, stays in the run's dir; /root
    # itself stays visible, e.g. for a Python installed under it)
    passwd = os.path.join(dir_, f"passwd_{name}")
    Path(passwd).write_text("".join(
        _with_home(line, home) if line.startswith("root:") else line
        for line in Path("/etc/passwd").read_text().splitlines(keepends=True)))
    # and its own /tmp/ray, as a machine has: Ray's default temp dir holds the address
    # that `--address auto` joins (ray_current_cluster), which must be this host's cluster
    ray_tmp = os.path.join(dir_, f"tmp_ray_{name}")
    os.makedirs(ray_tmp, exist_ok=True)
    os.makedirs(RAY_TMP, exist_ok=True)
    start = (f"mount --bind {passwd} /etc/passwd && mount --bind {ray_tmp} {RAY_TMP} && "
             f"exec {SSHD} -D -e -f {cfg}")
    proc = subprocess.Popen(
        ["ip", "netns", "exec", netns, "unshare", "--pid", "--fork", "--mount-proc",
         "--kill-child", "sh", "-c", start],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc


def wait_first_child(proc: subprocess.Popen, name: str, dir_: str) -> int:
    """The PID of the first child of :func:`launch_sshd`'s ``proc`` (PID 1 of host ``name``'s
    new PID namespace), once it exists.

    Raises:
        RuntimeError: sshd exited (with its log from ``dir_``), or no such process within
            ``READY_TIMEOUT_S``.
    """
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd of {name} exited ({proc.returncode}): "
                               f"{Path(dir_, f'sshd_{name}.log').read_text()}")
        pid = _first_child(proc.pid)
        if pid:
            return pid
        if time.monotonic() > deadline:
            raise RuntimeError(f"sshd of {name}: no process in its PID namespace")
        time.sleep(0.05)


def ssh_argv(key: str, ip: str, command: str) -> list[str]:
    """``ssh root@ip command`` with the private key ``key`` (no known-hosts file)."""
    return ["ssh", "-i", key, "-o", "StrictHostKeyChecking=no", "-o",
            "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
            f"root@{ip}", command]


def run(argv: list[str], check: bool = True) -> None:
    """Run ``argv``; with ``check``, a nonzero exit raises RuntimeError with its stderr."""
    p = subprocess.run(argv, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")


def kill(pid: int) -> None:
    """SIGKILL ``pid`` if nonzero; a process already gone is fine."""
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def wait_gone(pids: Callable[[], list[int]], timeout_s: float = 5.0) -> None:
    """Wait (at most ``timeout_s``) until ``pids()``, processes just killed, is empty, reaping
    those that are this process's children (a SIGKILL lands asynchronously, and a child stays
    listed until reaped)."""
    deadline = time.monotonic() + timeout_s
    while (left := pids()) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not ours: its parent (or init) reaps it
                pass
        time.sleep(0.02)


def wait_tcp(ip: str, port: int, timeout: float) -> None:
    """Return once ``ip:port`` accepts a TCP connection; RuntimeError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((ip, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on {ip}:{port} after {timeout} s") from None
            time.sleep(0.1)


def _with_home(passwd_line: str, home: str) -> str:
    """An /etc/passwd line with its home directory (6th field) replaced."""
    fields = passwd_line.rstrip("\n").split(":")
    fields[5] = home
    return ":".join(fields) + "\n"


def _first_child(pid: int) -> int:
    """The first child of ``pid`` (``unshare --fork``'s child: PID 1 of the new namespace),
    0 while there is none."""
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            kids = (task / "children").read_text().split()
            if kids:
                return int(kids[0])
    except OSError:
        pass
    return 0
