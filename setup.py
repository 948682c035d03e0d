"""Package layout: every top-level folder of the checkout installs as ``specmesh.<folder>``.

The folders stay where they are (``cluster/``, ``decode/``, ...) and have no ``__init__.py``, so
nothing installs under a generic top-level name; metadata lives in pyproject.toml.
"""

from setuptools import find_namespace_packages, setup

#: the checkout's top-level folders that are parts of the ``specmesh`` package
FOLDERS = ("benchmarks", "cluster", "data", "decode", "drafter", "engine", "gateway", "kernels",
           "prefill", "protocol")

package_dir = {"specmesh": "specmesh"}
packages = ["specmesh"]
for folder in FOLDERS:
    package_dir[f"specmesh.{folder}"] = folder
    packages.append(f"specmesh.{folder}")
    packages += [f"specmesh.{folder}.{sub}" for sub in find_namespace_packages(
        folder, exclude=["*__pycache__*", "__pycache__"])]

setup(packages=packages, package_dir=package_dir)
