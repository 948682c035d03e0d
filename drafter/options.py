"""The option schema of a drafting method: the keys ``--drafter NAME:KEY=VALUE+KEY=VALUE``
accepts, typed, bounded and documented once, on the method (:attr:`Proposer.options`). The
command line parses and checks ``--drafter`` values with it and writes ``--help`` from it;
the parsed values are the keyword arguments the method's factory receives.

Syntax of the text after the method (``ngram:min=1+width=4``): items joined by ``+``, each
``KEY=VALUE``. A method may have one *positional* option (a path, typically), whose value can
be given without its key (``eagle:PATH`` is ``eagle:head=PATH``); an item that does not start
with ``KEY=`` belongs to it (the loose items joined by ``+`` again: ``draft-model:/m/a+b`` is
the path ``/m/a+b``; a path whose ``+``-separated piece starts with ``KEY=`` needs the key
form). Keys are case-sensitive; a key given twice is an error.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: an item of the form KEY=VALUE
_KEY_ITEM = re.compile(r"^([A-Za-z_][A-Za-z0-9_-]*)=(.*)$", re.S)
#: option types, as the help text names them
TYPES = {int: "integer", float: "number", str: "text", bool: "true/false", "path": "a path"}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class OptionError(ValueError):
    """A ``--drafter`` option text the schema refuses; the message names the key and what
    it accepts."""


@dataclass(frozen=True)
class Option:
    """One key of a method's option schema.

    ``key``: as typed (``min``); ``kwarg``: the factory's keyword argument it sets (default:
    ``key``); ``type``: ``int``, ``float``, ``str``, ``bool`` or ``"path"`` (a non-empty
    string); ``default``: what the method uses when the key is absent (shown in the help; not
    passed: the factory applies it); ``minimum`` / ``maximum``: inclusive bounds of a number;
    ``choices``: the values allowed; ``required``: the method cannot run without it;
    ``positional``: the value may be given without ``KEY=`` (one per schema); ``flag``: a
    command-line flag that sets it as well (``--ngram-tree-width``; the key wins when both
    are given); ``help``: one line for ``--help``.
    """

    key: str
    type: Any = str
    help: str = ""
    default: Any = None
    kwarg: str = ""
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple = ()
    required: bool = False
    positional: bool = False
    flag: str | None = None

    def __post_init__(self) -> None:
        if self.type not in TYPES:
            raise TypeError(f"option {self.key!r}: type must be one of {list(TYPES)}")
        if not _KEY_ITEM.match(self.key + "="):
            raise TypeError(f"option key {self.key!r} is not KEY (letters, digits, _ and -)")
        if self.positional and self.type not in (str, "path"):
            raise TypeError(f"option {self.key!r}: only a text or path option is positional")
        if not self.kwarg:
            object.__setattr__(self, "kwarg", self.key)

    @property
    def flag_dest(self) -> str | None:
        """The argparse destination of :attr:`flag` (``ngram_tree_width``), or None."""
        return self.flag.lstrip("-").replace("-", "_") if self.flag else None

    def describe(self) -> str:
        """What the key accepts: ``"integer >= 1"``, ``"one of float32, bfloat16"``..."""
        if self.choices:
            return "one of " + ", ".join(str(c) for c in self.choices)
        kind = TYPES[self.type]
        if self.minimum is not None and self.maximum is not None:
            return f"{kind} in [{self.minimum}, {self.maximum}]"
        if self.minimum is not None:
            return f"{kind} >= {self.minimum}"
        if self.maximum is not None:
            return f"{kind} <= {self.maximum}"
        return kind

    def convert(self, value: Any) -> Any:
        """``value`` (text as typed, or a value a flag parsed) as this option's type.

        Raises:
            OptionError: a value of another type, out of bounds or not among the choices,
                naming the key and what it accepts.
        """
        bad = OptionError(f"{self.key} must be {self.describe()}, got {value!r}")
        try:
            if self.type is bool:
                out = value if isinstance(value, bool) else _parse_bool(str(value))
            elif self.type == "path":
                out = str(value)
                if not out:
                    raise ValueError
            elif self.type is int and isinstance(value, float):
                raise ValueError
            else:
                out = self.type(value)
        except ValueError:
            raise bad from None
        if self.choices and out not in self.choices:
            raise bad
        if self.minimum is not None and out < self.minimum:
            raise bad
        if self.maximum is not None and out > self.maximum:
            raise bad
        return out

    def help_line(self) -> str:
        """``"min=N  integer >= 1 (default 2): shortest suffix match"``."""
        parts = [self.describe()]
        if self.required:
            parts.append("required")
        elif self.default is not None:
            parts.append(f"default {self.default}")
        if self.flag:
            parts.append(f"also {self.flag}")
        return f"{self.key}: {self.help} ({'; '.join(parts)})" if self.help else \
            f"{self.key}: {'; '.join(parts)}"


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(text)


@dataclass(frozen=True)
class OptionSchema:
    """The keys of one method (:class:`Option`) and ``check``, a check across keys (e.g.
    ``min <= max``) that raises ValueError, called with the parsed keyword arguments."""

    options: tuple[Option, ...] = ()
    check: Callable[[dict], None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        keys = [o.key for o in self.options]
        if len(set(keys)) != len(keys):
            raise TypeError(f"option keys repeat: {keys}")
        if sum(o.positional for o in self.options) > 1:
            raise TypeError("at most one option may be positional")

    @property
    def keys(self) -> list[str]:
        return [o.key for o in self.options]

    @property
    def positional(self) -> Option | None:
        return next((o for o in self.options if o.positional), None)

    def option(self, key: str) -> Option:
        """The option called ``key``.

        Raises:
            OptionError: no such key, naming the keys there are.
        """
        for o in self.options:
            if o.key == key:
                return o
        raise OptionError(f"unknown key {key!r}; " + self.accepted())

    def accepted(self) -> str:
        """``"keys: min, max, width"`` or ``"it takes no options"``."""
        return f"keys: {', '.join(self.keys)}" if self.options else "it takes no options"

    def parse(self, text: str, flag_values: Mapping[str, Any] | None = None) -> dict:
        """The keyword arguments ``text`` (``"min=1+width=4"``, ``"PATH"``, ``""``) sets, by
        their :attr:`Option.kwarg`, plus those the schema's flags set in ``flag_values``
        (:meth:`with_flags`); absent keys are left out (the factory's defaults apply).

        Raises:
            OptionError: an unknown or repeated key, a bad value, a value without a key where
                the method has no positional option, a required key missing, or ``check``
                refused the result.
        """
        found: dict[str, Any] = {}
        loose: list[str] = []
        if text:
            for item in text.split("+"):
                m = _KEY_ITEM.match(item)
                if m is None:
                    loose.append(item)
                    continue
                key, value = m.group(1), m.group(2)
                opt = self.option(key)
                if opt.kwarg in found:
                    raise OptionError(f"key {key!r} is given twice")
                found[opt.kwarg] = opt.convert(value)
        if loose:
            pos = self.positional
            if pos is None:
                raise OptionError(f"expected KEY=VALUE items joined by '+', got "
                                  f"{'+'.join(loose)!r}; " + self.accepted())
            if pos.kwarg in found:
                raise OptionError(f"key {pos.key!r} is given twice")
            found[pos.kwarg] = pos.convert("+".join(loose))
        return self.finish(self.with_flags(found, flag_values or {}))

    def finish(self, kwargs: dict) -> dict:
        """``kwargs`` after the required-keys and cross-key checks.

        Raises:
            OptionError: a required key missing, or ``check`` refused them.
        """
        for o in self.options:
            if o.required and o.kwarg not in kwargs:
                how = f"{o.key}=VALUE" + (" or the value alone" if o.positional else "")
                raise OptionError(f"key {o.key!r} is required: {o.help or o.describe()} "
                                  f"(give {how})")
        if self.check is not None:
            try:
                self.check(kwargs)
            except ValueError as err:
                raise OptionError(str(err)) from None
        return kwargs

    def with_flags(self, kwargs: dict, flag_values: Mapping[str, Any]) -> dict:
        """``kwargs`` plus the values of this schema's flags in ``flag_values`` (argparse
        destination -> value; None: not given) for keys ``kwargs`` does not set.

        Raises:
            OptionError: a flag's value the option refuses (naming the flag).
        """
        out = dict(kwargs)
        for o in self.options:
            value = flag_values.get(o.flag_dest) if o.flag else None
            if value is None or o.kwarg in out:
                continue
            try:
                out[o.kwarg] = o.convert(value)
            except OptionError as err:
                raise OptionError(f"{o.flag}: {err}") from None
        return out

    def help_lines(self) -> list[str]:
        return [o.help_line() for o in self.options]


#: the schema of a method without options
NO_OPTIONS = OptionSchema()
