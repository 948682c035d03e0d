"""specmesh: speculative decoding on disaggregated prefill / verifier / drafter roles.

Every package is imported as ``specmesh.<name>`` (``specmesh.decode.scheduler``,
``specmesh.kernels.greedy_verify``); nothing is installed under a generic top-level name. The
packages live in the repository's top-level folders (``cluster/``, ``decode/``, ...), mapped
under this one in an installed wheel; in a source checkout or an editable install this
package's search path also covers the checkout's root, where those folders sit. The folders
have no ``__init__.py`` of their own, so a script run from the checkout's root that imports a
PyPI package of the same name (``import kernels``) gets that package, not ours.
"""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"

_ROOT = Path(__file__).resolve().parent.parent
if not (Path(__file__).resolve().parent / "cluster").is_dir() and (_ROOT / "cluster").is_dir():
    __path__.append(str(_ROOT))  # source checkout / editable install: the folders sit beside us
