"""Keep an embedded, single-machine Ray on 127.0.0.1.

Ray on Linux replaces a node address of 127.0.0.1 with the machine's routable address unless
the environment variable ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is ``0``. Ray reads that
variable once, when ``ray`` is first imported, and the processes Ray starts inherit it. So
:func:`use_loopback` must run before the first ``import ray`` of the process: the CLI calls it
for ``serve`` / ``demo`` / ``bench``, ``tests/conftest.py`` at import. ``specmesh launch`` (a
role joining a real multi-node cluster) must not call it.
"""

from __future__ import annotations

import os
import sys

LOOPBACK_ENV_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


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
