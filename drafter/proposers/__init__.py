"""The built-in drafting methods, one module each; importing this package imports every module
in it, and each registers its method (drafter/registry.py). A new method is a new module here
(plus its tests): nothing else names it."""

import importlib as _importlib
import pkgutil as _pkgutil

for _info in sorted(_pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _info.name.startswith("_"):
        _importlib.import_module(f"{__name__}.{_info.name}")
