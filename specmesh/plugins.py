"""What the drafting-method and verification-rule registries share about plugins: checking a
class against its base interface, finding the entry points of a group, importing an object
by its ``package.module:Name`` path. Standard library only: every layer may import it.

A plugin is a class in another distribution. It reaches specmesh either through an entry
point (``importlib.metadata`` group ``specmesh.drafters`` / ``specmesh.verify_rules``, the
entry point's name being the method's or rule's name) or, for drafting methods, through its
import path on the command line (``--drafter package.module:Class``). Registration checks the
class against the abstract methods of its base (pytest's and SGLang's plugin guards check a
hand-kept list of names; reflecting over the base keeps the check in step with the interface)
and names every method it lacks in one TypeError.
"""

from __future__ import annotations

import importlib
import inspect
import re
from importlib import metadata

#: a dotted Python module path (``package.module``)
_MODULE_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
#: a Python identifier
_IDENTIFIER = re.compile(r"^[A-Za-z_]\w*$")


def interface_errors(cls: object, base: type) -> list[str]:
    """What keeps ``cls`` from implementing ``base``: ``"not a subclass of ..."``, one entry
    naming every abstract method of ``base`` it leaves unimplemented, one per method whose
    positional parameters differ in number from the base's. Empty when it implements it."""
    if not inspect.isclass(cls):
        return [f"{cls!r} is not a class"]
    errors = []
    if not issubclass(cls, base):
        errors.append(f"{cls.__name__} does not subclass {base.__module__}.{base.__qualname__}")
    wanted = sorted(getattr(base, "__abstractmethods__", ()))
    missing = [m for m in wanted if _unimplemented(getattr(cls, m, None))]
    if missing:
        errors.append(f"{cls.__name__} does not implement {', '.join(missing)} (the abstract "
                      f"methods of {base.__qualname__}: {', '.join(wanted)})")
    for meth in wanted:
        if meth in missing:
            continue
        want = _positional(getattr(base, meth))
        got = _positional(getattr(cls, meth))
        if want is not None and got is not None and got != want:
            errors.append(f"{cls.__name__}.{meth} takes {got} parameters, {base.__qualname__}."
                          f"{meth} {want}")
    return errors


def _unimplemented(attr: object) -> bool:
    """Whether a class attribute leaves an interface method open: absent, or still abstract."""
    return attr is None or bool(getattr(attr, "__isabstractmethod__", False))


def _positional(fn: object) -> int | None:
    """Positional parameters of ``fn`` (self included); None when it takes ``*args``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def check_interface(cls: object, base: type, what: str) -> None:
    """Raise TypeError unless ``cls`` implements ``base`` (:func:`interface_errors`), naming
    ``what`` (e.g. ``"drafting method"``) and every problem at once."""
    errors = interface_errors(cls, base)
    if errors:
        raise TypeError(f"{what} {getattr(cls, '__name__', cls)!r}: " + "; ".join(errors))


def name_taken(kind: str, name: str, cls: type, other: type, source: str,
               builtin: bool) -> ValueError:
    """The error for ``cls`` (from ``source``: a module, an entry point, an import path)
    asking for the ``name`` that ``other`` holds in the registry of ``kind`` ("drafting
    method", "verification rule"); ``builtin``: ``other`` is built in, which no plugin
    shadows."""
    if builtin:
        return ValueError(f"{kind} {name!r} is built in ({qualname(other)}): {source} "
                          f"({qualname(cls)}) cannot shadow it; give the plugin another name")
    return ValueError(f"{kind} {name!r} is already registered by {qualname(other)}; "
                      f"{source} ({qualname(cls)}) cannot take it")


def qualname(cls: type) -> str:
    """``module.QualName`` of ``cls``, as errors name a class."""
    return f"{cls.__module__}.{cls.__qualname__}"


def entry_points(group: str) -> list[metadata.EntryPoint]:
    """The entry points of ``group`` in every distribution on ``sys.path`` now (read from the
    distributions' metadata each call, so a path added later counts), by name."""
    return sorted(metadata.entry_points(group=group), key=lambda ep: ep.name)


def origin(ep: metadata.EntryPoint) -> str:
    """``"entry point 'name = pkg.mod:Cls' of distribution 'dist 1.0'"``: where a plugin
    comes from, for error messages."""
    dist = getattr(ep, "dist", None)
    where = f" of distribution '{dist.name} {dist.version}'" if dist is not None else ""
    return f"entry point '{ep.name} = {ep.value}' (group {ep.group}){where}"


def load_entry_point(ep: metadata.EntryPoint) -> object:
    """``ep.load()``, with an import failure reported as ImportError naming the entry point
    and its distribution."""
    try:
        return ep.load()
    except Exception as err:  # noqa: BLE001 - any failure of a plugin's import is reported
        raise ImportError(f"cannot load {origin(ep)}: {type(err).__name__}: {err}") from err


def is_import_path(text: str) -> bool:
    """Whether ``text`` has the form ``package.module:Name`` (a module path, a colon, an
    identifier)."""
    module, sep, name = text.partition(":")
    return bool(sep) and bool(_MODULE_PATH.match(module)) and bool(_IDENTIFIER.match(name))


def import_object(path: str) -> object:
    """The object named by ``package.module:Name``.

    Raises:
        ValueError: ``path`` is not of that form.
        ImportError: the module cannot be imported or has no such name (the message says
            which).
    """
    if not is_import_path(path):
        raise ValueError(f"{path!r} is not an import path of the form package.module:Name")
    module_name, _, name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"cannot import {module_name!r} (from {path!r}): {err}") from err
    try:
        return getattr(module, name)
    except AttributeError:
        raise ImportError(f"module {module_name!r} has no {name!r} (from {path!r})") from None
