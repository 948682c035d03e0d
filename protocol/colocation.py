"""Co-location of a drafter with its verifier, for a drafting method that reads the verifier's
KV pool through shared memory (a frozen-KV MTP assistant, docs/drafters.md, 'Frozen-KV MTP').

Such a drafter can only run on the verifier's node: the pool is a file under ``/dev/shm`` the
drafter maps read-only. A verifier that shares its pool says where in its Hello
(:class:`~protocol.messages.SharedKVPool`); the drafter refuses the Hello, with a reason that
says what to do, when it carries no pool, when the verifier's node identity is not its own, or
when the file under that path is missing or not the one the verifier created (another device
or inode: a container that mounts another ``/dev/shm``, a path reused). The node identity is
the host name and the kernel's boot id: two containers on one host with separate ``/dev/shm``
mounts share the boot id but not, in general, the host name, and the file identity check
catches the rest.
"""

from __future__ import annotations

import os
import socket

from specmesh.protocol.messages import SharedKVPool

#: where Linux keeps the id of the running kernel's boot (random, new at every boot)
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def node_identity() -> str:
    """This node's identity: ``"<host name>/<boot id>"`` (the boot id ``"unknown"`` where the
    kernel does not expose one)."""
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as f:
            boot = f.read().strip() or "unknown"
    except OSError:
        boot = "unknown"
    return f"{socket.gethostname()}/{boot}"


def shared_kv_refusal(pool: SharedKVPool | None, peer: str, method: str,
                      node: str | None = None) -> str:
    """Why a drafter of ``method`` on node ``node`` (default: :func:`node_identity`) cannot
    read the KV pool verifier ``peer`` announced in its Hello (``pool``; None: it shares
    none); "" when it can.

    The reasons name the fix: run the drafter role on the verifier's node, or choose a method
    that does not read the target's KV."""
    fix = (f"the {method!r} drafting method reads the verifier's KV pool through shared "
           "memory, so its drafter must run on the verifier's node; co-locate them or choose "
           "another --drafter")
    if pool is None:
        return f"verifier {peer!r} shares no KV pool (Hello.shared_kv is empty): {fix}"
    here = node if node is not None else node_identity()
    if pool.node != here:
        return f"verifier {peer!r} runs on node {pool.node!r}, this drafter on {here!r}: {fix}"
    try:
        st = os.stat(pool.path)
    except OSError as err:
        return (f"verifier {peer!r}'s KV pool {pool.path!r} is not visible here "
                f"({err.strerror}): {fix}")
    if (st.st_dev, st.st_ino) != (pool.device, pool.inode):
        return (f"{pool.path!r} here is not the file verifier {peer!r} created (device/inode "
                f"{st.st_dev}/{st.st_ino} != {pool.device}/{pool.inode}): {fix}")
    if st.st_size < pool.nbytes:
        return (f"verifier {peer!r}'s KV pool {pool.path!r} holds {st.st_size} bytes, its "
                f"shape {list(pool.shape)} of {pool.dtype} needs {pool.nbytes}")
    return ""
