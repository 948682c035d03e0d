"""The verifier's paged KV pool in shared memory, for a drafter on the same node that reads it
without owning a KV pool of its own (frozen-KV MTP, docs/drafters.md, 'Frozen-KV MTP').

Owner side (:class:`SharedKVFile`): the verifier's :class:`~engine.kv_cache.KVCache` tensor
``[num_layers, 2, num_slots, num_kv_heads, head_dim]`` lives in a file under ``/dev/shm``
(tmpfs: RAM, no disk I/O; the temp directory where there is none), mapped ``MAP_SHARED``
read-write: the verifier's forwards write it as they write any cache, bit for bit the same
values (the mapping changes where the bytes live, not what is computed). The file is removed
when the owner is collected or its process exits; files left by a process that died without
cleaning up (a killed role) are removed by the next owner on the node.

Reader side (:func:`map_read_only`): the drafter maps the same file with ``PROT_READ`` only
(``mmap.ACCESS_READ``): any write through the returned tensor is refused by the kernel
(SIGSEGV), so the drafter cannot disturb the verifier's KV even by a bug. It reads only the
rows the verifier said are committed (protocol.messages.TargetKVRows).
"""

from __future__ import annotations

import math
import mmap
import os
import tempfile
import warnings
import weakref

import torch

from specmesh.engine.dtypes import dtype_name, model_dtype
from specmesh.protocol.colocation import node_identity
from specmesh.protocol.messages import SharedKVPool

#: prefix of the pool files (``<prefix><owner name>-<pid>``)
FILE_PREFIX = "specmesh-kv-"
#: where pool files go when it exists and is writable (tmpfs on Linux)
SHM_DIR = "/dev/shm"


def shared_kv_dir() -> str:
    """The directory pool files go to: ``/dev/shm`` where it is a writable directory, else
    the temp directory."""
    if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK):
        return SHM_DIR
    return tempfile.gettempdir()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, not ours to clean
        return True
    return True


def remove_stale_files(directory: str) -> int:
    """Remove pool files under ``directory`` whose owning process is gone; returns how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(FILE_PREFIX):
            continue
        pid = name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            try:
                os.unlink(os.path.join(directory, name))
                removed += 1
            except OSError:
                pass
    return removed


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class SharedKVFile:
    """A KV pool tensor of ``shape`` and ``dtype`` backed by a new shared-memory file named
    after ``owner`` (e.g. the verifier's instance id): :attr:`tensor` (zeros, writable) and
    :meth:`describe` (what the Hello announces). ``block_size``: tokens per KV block of the
    pool (announced with it).

    Raises:
        OSError: the file cannot be created or sized (no room in ``/dev/shm``: start the
            verifier with a smaller ``--kv-cache-mb``, or give the container a larger shm).
    """

    def __init__(self, owner: str, shape: tuple[int, ...], dtype: str | torch.dtype,
                 block_size: int, directory: str | None = None) -> None:
        self.dtype = model_dtype(dtype)
        self.shape = tuple(int(s) for s in shape)
        self.block_size = int(block_size)
        directory = directory or shared_kv_dir()
        remove_stale_files(directory)
        safe = "".join(c if c.isalnum() or c in "._" else "_" for c in owner)
        self.path = os.path.join(directory, f"{FILE_PREFIX}{safe}-{os.getpid()}")
        numel = math.prod(self.shape)
        nbytes = numel * torch.empty((), dtype=self.dtype).element_size()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            if nbytes:  # the room taken now: a full tmpfs fails here, not with SIGBUS later
                os.posix_fallocate(fd, 0, nbytes)
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            _unlink(self.path)
            raise
        os.close(fd)
        self.device, self.inode, self.nbytes = st.st_dev, st.st_ino, nbytes
        self._finalizer = weakref.finalize(self, _unlink, self.path)  # also at exit
        self.tensor = torch.from_file(self.path, shared=True, size=numel,
                                      dtype=self.dtype).view(self.shape)

    def describe(self) -> SharedKVPool:
        """The pool as the verifier's Hello announces it (this node's identity included)."""
        return SharedKVPool(node=node_identity(), path=self.path, device=self.device,
                            inode=self.inode, shape=list(self.shape),
                            dtype=dtype_name(self.dtype), block_size=self.block_size)

    def close(self) -> None:
        """Remove the file now (the mapping stays valid for whoever still holds it)."""
        self._finalizer()


class ReadOnlyKV:
    """A verifier's KV pool mapped read-only (:func:`map_read_only`): :attr:`data` the
    ``[num_layers, 2, num_slots, num_kv_heads, head_dim]`` tensor (writes fault), and the
    pool's description :attr:`pool`."""

    def __init__(self, pool: SharedKVPool, mapping: mmap.mmap, data: torch.Tensor) -> None:
        self.pool = pool
        self._mapping = mapping  # kept alive as long as the tensor is
        self.data = data
        self.block_size = pool.block_size

    def rows(self, layer: int, block_table: list[int], num_rows: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``layer`` at positions ``[0, num_rows)`` of the request whose
        blocks are ``block_table``: two ``[num_rows, num_kv_heads, head_dim]`` copies (the
        transient inputs of one draft call's attention, freed after it; never a pool).

        Raises:
            ValueError: a layer out of range, a block table too short for ``num_rows`` or a
                block id outside the pool.
        """
        num_layers, _, num_slots = self.data.shape[:3]
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer {layer} out of range [0, {num_layers})")
        bs = self.block_size
        need = -(-num_rows // bs)
        if len(block_table) < need:
            raise ValueError(f"block table of {len(block_table)} blocks for {num_rows} rows "
                             f"of {bs}")
        blocks = torch.tensor(block_table[:need], dtype=torch.long)
        if need and (int(blocks.min()) < 0 or int(blocks.max()) >= num_slots // bs):
            raise ValueError(f"block id out of range [0, {num_slots // bs})")
        slots = (blocks[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1)[:num_rows]
        kv = self.data[layer].index_select(1, slots)
        return kv[0], kv[1]


def map_read_only(pool: SharedKVPool) -> ReadOnlyKV:
    """Map the pool ``pool`` describes with read access only (PROT_READ, MAP_SHARED): the
    verifier's writes are seen, ours are impossible.

    Raises:
        OSError: the file cannot be opened.
        ValueError: it is smaller than the pool's shape needs, or not the file described
            (device / inode differ).
    """
    fd = os.open(pool.path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (pool.device, pool.inode):
            raise ValueError(f"{pool.path} is not the verifier's KV pool file")
        if st.st_size < pool.nbytes:
            raise ValueError(f"{pool.path} holds {st.st_size} bytes, the pool needs "
                             f"{pool.nbytes}")
        mapping = mmap.mmap(fd, pool.nbytes, access=mmap.ACCESS_READ) if pool.nbytes else None
    finally:
        os.close(fd)
    dtype = model_dtype(pool.dtype)
    if mapping is None:
        data = torch.empty(tuple(pool.shape), dtype=dtype)
    else:
        with warnings.catch_warnings():  # torch warns of the read-only buffer: it is meant
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(mapping, dtype=dtype).view(tuple(pool.shape))
    return ReadOnlyKV(pool, mapping, data)
