"""Compiled CPU kernels: a C++ source under ``kernels/`` built on first use with the machine's
compiler and loaded with ctypes (docs/architecture.md, 'Running on CPU').
:mod:`kernels.cpu_attention` and
:mod:`kernels.gguf_matmul` are built this way.

Build: ``g++ -O3 -march=native -ffp-contract=off -fopenmp -shared`` (``$CXX`` if set) into
``$SPECMESH_KERNEL_CACHE`` (default ``~/.cache/specmesh/kernels``), named by a hash of the
source, the flags, the compiler and the CPU's feature flags, so a shared home across machines
never loads code built for another CPU; written to a temporary name and renamed, so concurrent
processes can build at once. The OpenMP runtime is the one torch already loaded
(``libgomp.so.1``), so a kernel runs on torch's threads (``torch.get_num_threads()``).
Without a compiler the kernel is unavailable and its caller keeps its torch path. Whether a
caller uses a kernel at all is the process's CPU backend's choice (engine/backend.py), made by
the caller: this module only builds and loads.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared",
         "-std=c++17")


def cpu_flags() -> str:
    """The CPU's feature flags line (/proc/cpuinfo), or the processor name."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def cache_dir() -> Path:
    """Where built kernels are kept (``$SPECMESH_KERNEL_CACHE``, else ``$XDG_CACHE_HOME`` or
    ``~/.cache``, then ``specmesh/kernels``)."""
    root = os.environ.get("SPECMESH_KERNEL_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specmesh" / "kernels"


def compiler() -> str | None:
    """``$CXX``, else g++ or c++ on the PATH, else None."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


class CpuKernel:
    """One compiled kernel library: built once per source, flags, compiler and CPU, loaded
    once per process, its entry points typed from ``entries`` (name -> (argtypes, restype)).

    ``what`` names it in messages ("the CPU attention kernel"); ``fallback`` says what runs
    instead when it cannot be built (logged once).
    """

    def __init__(self, source: Path, what: str, fallback: str,
                 entries: dict[str, tuple[list, object]]) -> None:
        self.source, self.what, self.fallback = source, what, fallback
        self.entries = entries
        self.lib: ctypes.CDLL | None = None
        self.failed: str | None = None
        self._lock = threading.Lock()

    def build(self) -> Path:
        """Compile the source (once per source, flags, compiler and CPU) and return the
        library's path.

        Raises:
            RuntimeError: no C++ compiler, or the compiler failed (its output in the message).
        """
        cxx = compiler()
        if not cxx:
            raise RuntimeError(f"no C++ compiler (g++ / $CXX) to build {self.what}")
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
        key = hashlib.sha256("\0".join([self.source.read_text(), " ".join(FLAGS), version,
                                        platform.machine(), cpu_flags()]).encode()).hexdigest()
        out = cache_dir() / f"{self.source.stem}-{key[:16]}.so"
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            done = subprocess.run([cxx, *FLAGS, str(self.source), "-o", tmp],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"building {self.what} failed ({cxx}):\n"
                                   f"{done.stderr[-4000:]}")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return out

    def library(self) -> ctypes.CDLL | None:
        """The loaded library, built on first call; None when it cannot be built (logged
        once; the caller then keeps its torch path)."""
        if self.lib is not None or self.failed is not None:
            return self.lib
        with self._lock:
            if self.lib is None and self.failed is None:
                try:
                    lib = ctypes.CDLL(str(self.build()))
                    for name, (argtypes, restype) in self.entries.items():
                        getattr(lib, name).argtypes = argtypes
                        getattr(lib, name).restype = restype
                    self.lib = lib
                except (RuntimeError, OSError, AttributeError) as e:
                    self.failed = str(e)
                    log.warning("%s unavailable, %s: %s", self.what, self.fallback, e)
        return self.lib

    def reset(self) -> None:
        """Forget the loaded library and any failure, so the next call builds again (tests)."""
        self.lib, self.failed = None, None


__all__ = ["FLAGS", "CpuKernel", "cache_dir", "compiler", "cpu_flags"]
