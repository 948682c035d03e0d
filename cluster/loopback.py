"""Keep an embedded, single-machine Ray on 127.0.0.1.

Ray on Linux replaces a node address of 127.0.0.1 with the machine's routable address unless
the environment variable ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is ``0``. Ray reads that
variable once, when ``ray`` is first imported, and the processes Ray starts inherit it. So
:func:`use_loopback` must run before the first ``import ray`` of the process: the CLI calls it
for ``serve`` / ``demo`` / ``bench``, ``tests/conftest.py`` at import. ``specmesh launch`` (a
role joining a real multi-node cluster) must not call it.

A role binds and advertises the IP of the node it runs on, resolved where it runs
(:func:`role_address`): Ray's node IP inside a Ray actor, so a role that Ray restarts on another
node advertises that node's address, not the one it was launched with
(docs/architecture.md, 'Cluster and health'); 127.0.0.1
on the embedded loopback Ray and in tests.
"""

from __future__ import annotations

import os
import socket
import sys

LOOPBACK_ENV_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
#: ``ClusterConfig.host`` / ``--host`` value meaning "the IP of the node the role runs on"
AUTO_HOST = "auto"
#: bind addresses that listen on every interface (the role then advertises its node IP)
WILDCARD_HOSTS = ("0.0.0.0", "::")


def loopback_enabled() -> bool:
    """True when Ray in this process was (or will be) imported with the loopback setting."""
    return os.environ.get(LOOPBACK_ENV_VAR) == "0"


def use_loopback() -> None:
    """Make the embedded Ray of this process (and of its children) stay on 127.0.0.1.

    Raises:
        RuntimeError: ``ray`` was imported already without the setting; the setting can no
            longer take effect in this process.
    """
    if loopback_enabled():
        return
    if "ray" in sys.modules:
        raise RuntimeError(
            "ray was imported before cluster.loopback.use_loopback(); call it first (Ray reads "
            f"{LOOPBACK_ENV_VAR} at import), or export {LOOPBACK_ENV_VAR}=0")
    os.environ[LOOPBACK_ENV_VAR] = "0"
    # Ray's uv hook would re-run role processes through `uv run`; specmesh roles run in the
    # driver's environment.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


def node_ip_address() -> str:
    """The IP of the node this process runs on: Ray's node IP when Ray is initialized in this
    process (inside a role actor: the node Ray placed it on, after a restart the new one);
    127.0.0.1 with the loopback setting; else the address of the default route (127.0.0.1
    without one). Never imports ray."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    if loopback_enabled():
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # UDP: sends nothing, only picks the route
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def role_address(host: str) -> tuple[str, str]:
    """``(bind, advertise)`` addresses of a role configured with ``host``, resolved where the
    role runs: ``auto`` (or empty) binds and advertises :func:`node_ip_address`; a wildcard
    (``0.0.0.0``) listens on every interface and advertises the node IP; any other address is
    used as given for both (it pins the role to a machine that has it)."""
    if not host or host == AUTO_HOST:
        ip = node_ip_address()
        return ip, ip
    if host in WILDCARD_HOSTS:
        return host, node_ip_address()
    return host, host
