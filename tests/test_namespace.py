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


def test_no_source_imports_a_folder_by_its_bare_name() -> None:
    """Every import of a project module, in code and in code strings (subprocesses, ``-c``),
    goes through ``specmesh.``: run from the checkout's root a bare ``from protocol.x import``
    would still work (the folder is a namespace portion there) but load a second copy of the
    module under another name. The import-direction checker's own cases name modules as
    their folders on purpose."""
    import re

    folders = "|".join(FOLDERS)
    bare = re.compile(rf"(?:^|[;\"'])\s*(?:from\s+(?:{folders})(?:\.\w+)*\s+import\s+\w"
                      rf"|import\s+(?:{folders})\.\w|-m\s+(?:{folders})\.\w)")
    skip = {REPO_ROOT / "tests" / "test_import_direction.py"}
    found = []
    for path in sorted(REPO_ROOT.rglob("*.py")):
        if {".venv", ".git", "build"} & set(path.relative_to(REPO_ROOT).parts) or path in skip:
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if bare.search(line):
                found.append(f"{path.relative_to(REPO_ROOT)}:{n}: {line.strip()}")
    assert not found, "imports without the specmesh. prefix:\n" + "\n".join(found)
