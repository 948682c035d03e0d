"""One namespace: every project package imports as ``specmesh.<folder>``, nothing installs under
a generic top-level name, and a PyPI package whose name matches one of our folders (``kernels``,
which transformers >= 5.25 imports) is the one a plain ``import`` finds, even from the
checkout's root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import specmesh

REPO_ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("benchmarks", "cluster", "data", "decode", "drafter", "engine", "gateway", "kernels",
           "prefill", "protocol")


def test_folders_are_parts_of_the_namespace_only() -> None:
    for folder in FOLDERS:
        assert (REPO_ROOT / folder).is_dir()
        assert not (REPO_ROOT / folder / "__init__.py").exists(), \
            f"{folder}/__init__.py would make `import {folder}` find our folder first"
    import specmesh.decode.scheduler
    import specmesh.kernels.greedy_verify

    assert Path(specmesh.kernels.greedy_verify.__file__).parent.name == "kernels"
    assert specmesh.decode.scheduler.__name__ == "specmesh.decode.scheduler"


def test_pypi_kernels_is_not_shadowed_from_the_checkout_root() -> None:
    """``import kernels`` run from the checkout's root (cwd first on sys.path, as with
    ``python -m pytest`` or ``python -c``) imports the PyPI package, next to specmesh."""
    code = ("import kernels, specmesh.kernels.greedy_verify, transformers, sys\n"
            "from pathlib import Path\n"
            "root = Path(sys.argv[1]).resolve()\n"
            "f = Path(kernels.__file__).resolve()\n"
            "assert f.parent != root / 'kernels', f'import kernels found our folder: {f}'\n"
            "print(f)\n")
    out = subprocess.run([sys.executable, "-c", code, str(REPO_ROOT)], cwd=REPO_ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "site-packages" in out.stdout or "dist-packages" in out.stdout


def test_version_is_the_distribution_version() -> None:
    from importlib.metadata import version

    assert specmesh.__version__ == version("specmesh")
