"""``--drafter``: which drafting method a cluster runs, as a user names it. The methods, their
options (typed, bounded, with help text) and their flags come from the registry
(drafter/registry.py, drafter/options.py); nothing here knows a method by name.

Forms (:data:`DRAFTER_FORMS`):

- ``NAME`` or ``NAME:KEY=VALUE+KEY=VALUE``: a registered method (built-in, or an entry point
  of the group ``specmesh.drafters``) with keys of its option schema; a method with a
  positional option also takes ``NAME:VALUE`` (``eagle:PATH``, ``draft-model:PATH``);
- ``package.module:Class`` or ``package.module:Class:KEY=VALUE+...``: a plugin class by its
  import path. The part before the first colon is looked up as a method name first, so the
  two forms never clash: it is an import path only when no method has that name (a plugin
  module named like a method needs its package path);
- ``auto`` (the default): the form :func:`resolve_auto_drafter` picks for the target.
"""

from __future__ import annotations

import argparse
import os
import textwrap
from collections.abc import Mapping
from typing import Any

from specmesh.cluster.auto import resolve_auto_drafter as choose_auto_drafter
from specmesh.drafter.options import OptionError
from specmesh.drafter.registry import (
    ENTRY_POINT_GROUP,
    get_method,
    load_plugins,
    method_key,
    registered_methods,
    spelling,
    spellings,
)
from specmesh.engine.devices import resolve_device
from specmesh.plugins import is_import_path

#: the forms of ``--drafter``, for help and error messages
DRAFTER_FORMS = "auto | NAME[:KEY=VALUE+...] | NAME:VALUE | package.module:Class[:KEY=VALUE+...]"
#: width of the method list in ``--help``
HELP_WIDTH = 100
#: what ``--drafter auto`` means, for ``--help`` (:func:`resolve_auto_drafter` decides)
AUTO_HELP = ("the EAGLE head shipped for the target where it has one and it does not slow the "
             "verifier (its own device, or cores to spare: cluster/auto.py), else ngram (the "
             "default)")


def shipped_head_for(model: str | None):  # noqa: ANN201
    """The head shipped for ``model`` (its config files are read, not its weights), or None."""
    # torch and triton (the EAGLE drafter, the engine's loader): this module stays torch-free
    from specmesh.drafter.proposers.eagle import shipped_head
    from specmesh.engine.loader import model_name

    try:
        return shipped_head(model_name(model))
    except (FileNotFoundError, ValueError):
        return None


def resolve_auto_drafter(model: str | None) -> str:
    """The ``--drafter`` form ``auto`` stands for with target ``model`` (:data:`AUTO_HELP`);
    :func:`parse_drafter` is its one caller. The choice and its reason: cluster/auto.py."""
    return auto_drafter(model)[0]


def auto_drafter(model: str | None = None, device: str = "auto",
                 plans: tuple[dict, dict] | None = None) -> tuple[str, str]:
    """``--drafter auto`` for ``model`` on this machine: (the form it means, why), from the
    shipped EAGLE head, the verifier's device and the thread ``plans`` (the threads per role
    with a model drafter, and with n-gram; default: the default plans of this machine's
    cores). See :func:`cluster.auto.resolve_auto_drafter`,
    which decides."""
    # torch (cluster.config: engine.dtypes), triton (the loader): this module stays torch-free
    from specmesh.cluster.config import default_threads
    from specmesh.engine.loader import model_name

    head = shipped_head_for(model)
    try:
        target = model_name(model)
    except (FileNotFoundError, ValueError):
        target = str(model)
    try:
        on_gpu = resolve_device(device).type == "cuda"
    except ValueError:
        on_gpu = False
    with_model, plain = plans or (default_threads(model_drafter=True), default_threads())
    return choose_auto_drafter(None if head is None else str(head), target,
                                os.cpu_count() or 1, on_gpu, with_model["verifier"],
                                plain["verifier"], with_model.get("drafter", 1))


def split_drafter(form: str) -> tuple[str, str | None]:
    """``(method name or import path, option text)`` of a ``--drafter`` form other than
    ``auto``; the option text is None when the form has no colon after the method.

    Raises:
        KeyError: no method has the name and the form is no import path.
        TypeError, ValueError, ImportError: a plugin the registry cannot register.
    """
    head, sep, rest = form.partition(":")
    try:
        method_key(head)
        return head, rest if sep else None
    except KeyError:
        if sep:
            cls_name, sep2, options = rest.partition(":")
            path = f"{head}:{cls_name}"
            if is_import_path(path):
                method_key(path)
                return path, options if sep2 else None
        raise


def parse_drafter(spec: str, model: str | None = None,
                  flags: Mapping[str, Any] | None = None) -> tuple[str, dict]:
    """(registry key, keyword arguments of the method's factory) of a ``--drafter`` value for
    target ``model``; ``flags`` holds the values of the methods' own command-line flags by
    argparse destination (``{"ngram_tree_width": 3}``; None: not given), which set the keys
    they stand for unless ``spec`` sets them.

    Raises:
        SystemExit: an unknown method (naming the known ones and the forms), a key or value
            the method's schema refuses (naming the key and what it accepts), a flag value
            out of bounds, or a plugin that cannot be loaded or registered.
    """
    flags = dict(flags or {})
    spec = (spec or "auto").strip()
    try:
        _check_flags(flags)
        form = resolve_auto_drafter(model) if spec == "auto" else spec
        name, text = split_drafter(form)
        key = method_key(name)
        schema = get_method(key).options
        if text == "":
            raise OptionError("nothing after the colon; " + schema.accepted())
        return key, schema.parse(text or "", flags)
    except KeyError as err:
        raise SystemExit(f"--drafter {spec!r}: {err.args[0]}; forms: {DRAFTER_FORMS}") from None
    except (OptionError, TypeError, ValueError, ImportError) as err:
        raise SystemExit(f"--drafter {spec}: {err}") from None


def drafter_from_args(args: argparse.Namespace) -> tuple[str, dict]:
    """:func:`parse_drafter` of the parsed options in ``args`` (``--drafter``, ``--model`` and
    the methods' flags). Raises as it."""
    return parse_drafter(getattr(args, "drafter", "auto"), getattr(args, "model", None),
                         vars(args))


def _flag_options() -> list:
    """Every option of every method that has a command-line flag."""
    return [o for key in registered_methods() for o in get_method(key).options.options
            if o.flag]


def _check_flags(flags: Mapping[str, Any]) -> None:
    """SystemExit naming the flag for a flag value its option refuses (whichever method
    runs)."""
    for o in _flag_options():
        value = flags.get(o.flag_dest)
        if value is None:
            continue
        try:
            o.convert(value)
        except OptionError as err:
            raise SystemExit(f"{o.flag}: {err}") from None


def add_drafter_options(p: argparse.ArgumentParser) -> None:
    """``--drafter`` and the flags the registered methods' options declare (e.g.
    ``--ngram-tree-width``), on an argparse parser; the methods and their keys are listed by
    :func:`drafter_help` (the parser's epilog)."""
    p.add_argument("--drafter", default="auto", metavar="METHOD",
                   help=f"drafting method: {DRAFTER_FORMS} (methods and their keys: below)")
    seen: set[str] = set()
    for key in registered_methods():
        for o in get_method(key).options.options:
            if not o.flag or o.flag in seen:
                continue
            seen.add(o.flag)
            p.add_argument(o.flag, type=o.type if o.type in (int, float) else str,
                           default=None, metavar=o.key.upper(),
                           help=f"{spelling(key)} drafter: {o.help} (= {spelling(key)}:"
                                f"{o.key}=...; {o.describe()}, default {o.default})")


def drafter_help() -> str:
    """The drafting methods, their summaries and keys, for ``--help`` (raw text)."""
    try:  # installed plugins are listed too
        load_plugins()
        broken = ""
    except (KeyError, TypeError, ValueError, ImportError) as err:  # help still prints
        broken = f"(a plugin could not be loaded: {err})"

    def block(text: str, indent: int) -> list[str]:
        return textwrap.wrap(text, width=HELP_WIDTH, initial_indent=" " * indent,
                             subsequent_indent=" " * (indent + 2))

    lines = ["drafting methods (--drafter METHOD[:KEY=VALUE+...]):",
             *block(f"auto: {AUTO_HELP}", 2), *block(broken, 2)]
    for name in spellings():
        cls = get_method(name)
        schema = cls.options
        summary = cls.summary or (cls.__doc__ or "").strip().split("\n")[0]
        lines += block(f"{name}: {summary}", 2)
        if schema.positional is not None:
            lines += block(f"{name}:VALUE is {name}:{schema.positional.key}=VALUE", 6)
        for line in schema.help_lines():
            lines += block(line, 6)
    lines += block(f"plugins: an entry point of the group {ENTRY_POINT_GROUP} (its name is the "
                   "method's), or --drafter package.module:Class[:KEY=VALUE+...]", 0)
    return "\n".join(lines)
