"""The registry of drafting methods: every place that turns a method's name into behaviour (the
``--drafter`` parser and ``--help``, the drafter role's factory, the seed state the prefill and
verifier roles ship, ``specmesh train-drafter --method``, the bench, the default thread plan)
asks it, never a chain of ``if`` on names.

Where methods come from, in the order a name is looked up:

1. built-ins: every module of the package ``specmesh.drafter.proposers`` (imported on the
   registry's first use; a new method is one new module there, plus its tests);
2. a method registered by name already (a plugin module that called :func:`register_proposer`);
3. an import path, ``package.module:Class`` (the registry key is the path itself, so every
   process resolves it by importing the module: the CLI driver and the Ray role processes
   alike);
4. entry points of the group :data:`ENTRY_POINT_GROUP` (``specmesh.drafters``), the entry
   point's name being the method's: ``[project.entry-points."specmesh.drafters"]`` /
   ``copycat = "mypkg.copycat:CopycatProposer"``. Read again on every miss, so a
   distribution added to ``sys.path`` later counts.

Registration checks the class against :class:`Proposer` (drafter/proposer.py): a TypeError
names every abstract method it lacks and every method whose arity differs
(``specmesh.plugins.interface_errors``), and unknown declarations. A built-in name can never
be taken by another class: a plugin module or entry point that tries raises ValueError naming
it (module, or entry point and distribution).
"""

from __future__ import annotations

import importlib
import pkgutil
import threading

from specmesh.drafter.options import OptionSchema
from specmesh.drafter.proposer import DRAFT_SHAPES, DraftTarget, Proposer
from specmesh.engine.hidden_layers import SEED_STATE_KINDS
from specmesh.plugins import (
    check_interface,
    entry_points,
    import_object,
    is_import_path,
    load_entry_point,
    name_taken,
    origin,
)

#: the entry-point group of drafting-method plugins
ENTRY_POINT_GROUP = "specmesh.drafters"
#: the package whose modules are the built-in methods
BUILTIN_PACKAGE = "specmesh.drafter.proposers"

_REGISTRY: dict[str, type[Proposer]] = {}
_BUILTIN: set[str] = set()
_lock = threading.RLock()
_state = {"builtins": "no"}  # "no" -> "loading" -> "yes"


def _check_declarations(cls: type[Proposer]) -> None:
    """TypeError for a declaration the system cannot use (see :class:`Proposer`)."""
    problems = []
    if cls.draft_shape not in DRAFT_SHAPES:
        problems.append(f"draft_shape {cls.draft_shape!r} is not one of {DRAFT_SHAPES}")
    if cls.seed_state not in SEED_STATE_KINDS:
        problems.append(f"seed_state {cls.seed_state!r} is not one of {SEED_STATE_KINDS}")
    if not isinstance(cls.options, OptionSchema):
        problems.append("options is not a drafter.options.OptionSchema")
    if cls.trainer is not None and not callable(cls.trainer):
        problems.append("trainer is neither None nor callable")
    seeds = getattr(cls, "makes_prefill_seed", False)
    if not isinstance(seeds, bool):
        problems.append("makes_prefill_seed is not a bool")
    elif seeds:
        if not cls.seed_state:
            problems.append("makes_prefill_seed without a seed_state (the step reads it)")
        lacking = [m for m in ("make_prefill_seed", "adopt_prefill_seed")
                   if getattr(cls, m, None) in (None, getattr(Proposer, m))]
        if lacking:
            problems.append(f"makes_prefill_seed without {' and '.join(lacking)}")
    if problems:
        raise TypeError(f"drafting method {cls.__name__!r}: " + "; ".join(problems))


def _add(key: str, cls: type[Proposer], source: str) -> type[Proposer]:
    """Register ``cls`` under ``key`` (and its ``cli_name``); ``source`` says where it came
    from, for the error when the name is taken."""
    with _lock:
        taken = {k: c for k, c in _REGISTRY.items() if c is not cls}
        spellings = {key} | ({cls.cli_name} if cls.cli_name else set())
        for other_key, other in taken.items():
            clash = spellings & ({other_key} | ({other.cli_name} if other.cli_name else set()))
            if not clash:
                continue
            raise name_taken("drafting method", clash.pop(), cls, other, source,
                             other_key in _BUILTIN)
        _REGISTRY[key] = cls
        if cls.__module__.startswith(BUILTIN_PACKAGE + "."):
            _BUILTIN.add(key)
    return cls


def register_proposer(cls: type[Proposer]) -> type[Proposer]:
    """Class decorator: register ``cls`` under ``cls.name`` (built-in methods and plugin
    modules use it; entry points and import paths are registered on lookup).

    Raises:
        TypeError: ``cls`` does not implement :class:`Proposer` (every missing method named),
            has no string ``name`` or declares something unknown.
        ValueError: the name (or ``cli_name``) is taken: a built-in's (never shadowed) or
            another class's.
    """
    check_interface(cls, Proposer, "drafting method")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"drafting method {cls.__name__!r} has no string `name`")
    _check_declarations(cls)
    _load_builtins()
    return _add(name, cls, f"module {cls.__module__}")


def _load_builtins() -> None:
    """Import every module of :data:`BUILTIN_PACKAGE` once (each registers its method)."""
    with _lock:
        if _state["builtins"] != "no":
            return
        _state["builtins"] = "loading"
        try:
            package = importlib.import_module(BUILTIN_PACKAGE)
            for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
                if not info.name.startswith("_"):
                    importlib.import_module(f"{BUILTIN_PACKAGE}.{info.name}")
        except BaseException:
            _state["builtins"] = "no"
            raise
        _state["builtins"] = "yes"
    _check_entry_point_names()


def _check_entry_point_names() -> list:
    """The group's entry points (not imported), after refusing any that would shadow a
    built-in name.

    Raises:
        ValueError: an entry point named like a built-in method, naming its distribution.
    """
    eps = entry_points(ENTRY_POINT_GROUP)
    builtin = {s for k in _BUILTIN for s in (k, _REGISTRY[k].cli_name) if s}
    for ep in eps:
        if ep.name in builtin:
            raise ValueError(f"{origin(ep)} names drafting method {ep.name!r}, a built-in "
                             "name, which plugins cannot shadow; rename the entry point")
    return eps


def _register_entry_point(ep) -> type[Proposer]:  # noqa: ANN001
    cls = load_entry_point(ep)
    check_interface(cls, Proposer, f"{origin(ep)}: drafting method")
    declared = getattr(cls, "name", None)
    if declared not in (None, ep.name) and _REGISTRY.get(declared) is not cls:
        raise TypeError(f"{origin(ep)}: the class's `name` is {declared!r}, not the entry "
                        f"point's {ep.name!r}")
    _check_declarations(cls)
    return _add(ep.name, cls, origin(ep))


def _by_spelling(name: str) -> str | None:
    if name in _REGISTRY:
        return name
    return next((k for k, c in _REGISTRY.items() if c.cli_name == name), None)


def method_key(name: str) -> str:
    """The registry key of the method a user calls ``name`` (``draft-model`` ->
    ``draft_model``; an import path or entry point is loaded and registered first).

    Raises:
        KeyError: no such method, listing the known ones.
        TypeError, ValueError, ImportError: a plugin that cannot be registered (see
            :func:`register_proposer`) or imported.
    """
    _load_builtins()
    key = _by_spelling(name)
    if key is not None:
        return key
    if is_import_path(name):
        cls = import_object(name)
        check_interface(cls, Proposer, f"drafting method {name!r}")
        _check_declarations(cls)
        _add(name, cls, f"import path {name!r}")
        return name
    for ep in _check_entry_point_names():
        if ep.name == name:
            _register_entry_point(ep)
            return name
    raise KeyError(f"unknown drafting method {name!r}; known: {', '.join(spellings())} "
                   "(or a plugin's package.module:Class)")


def get_method(name: str) -> type[Proposer]:
    """The method (its :class:`Proposer` class) a user calls ``name``. Raises as
    :func:`method_key`."""
    return _REGISTRY[method_key(name)]


#: the name the drafter worker and older callers use
get_proposer = get_method


def load_plugins() -> None:
    """Register every entry point of the group now (``--help`` and ``registered_methods``
    list them all). Raises as :func:`method_key`."""
    _load_builtins()
    for ep in _check_entry_point_names():
        if _by_spelling(ep.name) is None:
            _register_entry_point(ep)


def registered_methods() -> list[str]:
    """The registry keys of every method: built-ins, entry points, and those registered
    otherwise so far; sorted."""
    load_plugins()
    return sorted(_REGISTRY)


def is_builtin(name: str) -> bool:
    """Whether ``name`` (a key or a user spelling) is a built-in method."""
    _load_builtins()
    return _by_spelling(name) in _BUILTIN


def spelling(key: str) -> str:
    """How users type the method registered as ``key`` (its ``cli_name``, else the key)."""
    cls = _REGISTRY.get(key)
    return (cls.cli_name or key) if cls is not None else key


def spellings() -> list[str]:
    """Every method as users type it: built-ins first, sorted, then the others."""
    _load_builtins()
    keys = sorted(_BUILTIN) + sorted(k for k in _REGISTRY if k not in _BUILTIN)
    return [spelling(k) for k in keys]


def _lenient(name: str) -> type[Proposer] | None:
    """The method ``name``, or None when no method has that name."""
    try:
        return get_method(name)
    except KeyError:
        return None


def seed_state_of(method: str) -> str:
    """The seed-state kind the method ``method`` declares (:attr:`Proposer.seed_state`);
    ``""`` for an unknown name."""
    cls = _lenient(method)
    return cls.seed_state if cls is not None else ""


def seed_state_for(method: str, kwargs: dict | None = None,
                   target: DraftTarget | None = None) -> str:
    """The seed state a drafter of ``method`` built with ``kwargs`` for ``target`` needs (a
    feature head's depends on the head it loads, see :meth:`Proposer.seed_state_for`); ``""``
    for an unknown name."""
    cls = _lenient(method)
    return cls.seed_state_for(dict(kwargs or {}), target) if cls is not None else ""


def seed_state_kinds() -> dict[str, str]:
    """Method -> seed state, for every registered method that needs one: what the cluster tells
    the prefill worker (``PrefillConfig.seed_states``), which may not import drafter/."""
    _load_builtins()
    return {name: cls.seed_state for name, cls in sorted(_REGISTRY.items()) if cls.seed_state}


def makes_prefill_seed(method: str) -> bool:
    """Whether the method ``method`` runs its first draft step at the prefill
    (:attr:`Proposer.makes_prefill_seed`); False for an unknown name."""
    cls = _lenient(method)
    return bool(cls.makes_prefill_seed) if cls is not None else False


def runs_a_model(method: str) -> bool:
    """Whether the method ``method`` runs a model (:attr:`Proposer.runs_a_model`: its drafts
    cost forwards that compete with the verifier's for the cores); False for an unknown
    name."""
    cls = _lenient(method)
    return bool(cls.runs_a_model) if cls is not None else False


def supports_corpus(method: str) -> bool:
    """Whether the method ``method`` drafts from corpora loaded at run time
    (:attr:`Proposer.supports_corpus`); False for an unknown name."""
    cls = _lenient(method)
    return bool(cls.supports_corpus) if cls is not None else False


def create_proposer(method: str, kwargs: dict | None = None,
                    target: DraftTarget | None = None) -> Proposer:
    """A proposer of ``method`` for ``target`` (default: :class:`DraftTarget`'s defaults)
    built by the method's factory (:meth:`Proposer.create`). Raises as :func:`get_method` and
    the factory."""
    return get_method(method).create(dict(kwargs or {}), target or DraftTarget())


def trainable_methods() -> list[str]:
    """The methods ``specmesh train-drafter --method`` accepts (those with a trainer), as
    users type them."""
    load_plugins()
    return [s for s in spellings() if get_method(s).trainer is not None]


__all__ = ["BUILTIN_PACKAGE", "ENTRY_POINT_GROUP", "create_proposer", "get_method",
           "get_proposer", "is_builtin", "load_plugins", "makes_prefill_seed", "method_key",
           "register_proposer",
           "registered_methods", "runs_a_model", "seed_state_for", "seed_state_kinds",
           "seed_state_of", "spelling", "spellings", "supports_corpus", "trainable_methods"]
