"""The registry of verification rules and the choice of a request's rule (docs/architecture.md,
'Verification rules').

A rule (:class:`VerificationRule`) declares when it applies to a request:
:meth:`~VerificationRule.applies` reads a :class:`RuleQuery` (the request's sampling
parameters and sampling mode, the deployment's ``verify_rule``, whether the request's drafts
form a tree) and :attr:`~VerificationRule.priority` orders the rules; a request is verified by
the applicable rule of highest priority (ties: by name). Nothing else chooses: the verify
step, the scheduler (may it plan a draft tree?), the CLI's ``--verify-rule`` choices and
help, the config's checks and the gateway's flag on responses all ask this module.

Besides ``applies``, a rule declares ``selectable`` (a deployment may pick it with
``verify_rule=NAME`` / ``--verify-rule NAME``, described by ``help``; :data:`AUTO` picks none
and leaves each request to the rules that apply by themselves), ``judges_trees`` (it verifies
draft trees, :meth:`~VerificationRule.verify_tree`), ``exact`` (the committed tokens are
distributed as the target's own; a rule that is not, the synthetic-acceptance ablation, must
be selectable, and the gateway flags the responses of a deployment that picks it),
``uses_draft_probs``, and :meth:`~VerificationRule.from_config` /
:meth:`~VerificationRule.check_config` for the settings it reads from the verifier's config.

Rules come from the built-in modules (:data:`BUILTIN_MODULES`: every concrete rule class
they define is registered on the registry's first use), plugin modules calling
:func:`register_rule`, and entry points of the group :data:`ENTRY_POINT_GROUP`
(``specmesh.verify_rules``), loaded on the registry's first use in each process (the
verifier role's included). Registration checks the class against :class:`VerificationRule`
(every missing method named in one TypeError); a built-in name is never shadowed.

Imports no torch at load (the config's checks import it only for a rule other than auto).
"""

from __future__ import annotations

import importlib
import inspect
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from specmesh.plugins import (
    check_interface,
    entry_points,
    load_entry_point,
    name_taken,
    origin,
)

if TYPE_CHECKING:  # (decode.config.VerifierConfig and decode.verification.RuleBatch, named in
    # annotations, are not imported: both modules import this one)
    import torch

    from specmesh.protocol.messages import SamplingParams

#: ``verify_rule`` value that picks no rule: each request gets the rules that apply by
#: themselves (greedy, coupled, rejection, tree)
AUTO = "auto"
AUTO_HELP = ("greedy at temperature 0, coupled for seeded requests, standard rejection "
             "sampling for the other sampled ones, tree verification for draft trees")
#: the entry-point group of verification-rule plugins
ENTRY_POINT_GROUP = "specmesh.verify_rules"
#: the modules whose rules are built in
BUILTIN_MODULES = ("specmesh.decode.verification", "specmesh.decode.synthetic")


@dataclass(frozen=True)
class RuleQuery:
    """What a rule's :meth:`~VerificationRule.applies` sees of one request: ``sampling`` (its
    SamplingParams), ``mode`` (engine.sampling.sampling_mode: ``greedy``, ``coupled`` or
    ``random``), ``verify_rule`` (the deployment's) and ``tree`` (its drafts form a tree)."""

    sampling: SamplingParams
    mode: str
    verify_rule: str = AUTO
    tree: bool = False


class VerificationRule(ABC):
    """Decides, for each request of a :class:`~decode.verification.RuleBatch`, how many drafts
    pass and which target token follows them. Must be exact (the committed tokens distributed
    as the target's own; greedy: equal to its argmax) unless it declares ``exact = False``.
    The declarations are documented in the module docstring."""

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    selectable: ClassVar[bool] = False
    help: ClassVar[str] = ""
    judges_trees: ClassVar[bool] = False
    exact: ClassVar[bool] = True
    #: whether the rule reads ``RuleBatch.draft_probs`` (the verify step builds them only then)
    uses_draft_probs: ClassVar[bool] = False

    @abstractmethod
    def applies(self, query: RuleQuery) -> bool:
        """Whether this rule may verify the request ``query`` describes."""

    @abstractmethod
    def verify(self, batch: RuleBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(output_token_ids [batch, max_k + 1], accept_len [batch])``.

        Raises:
            ValueError: inconsistent shapes (as the kernels raise).
        """

    def verify_tree(self, batch: RuleBatch
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a rule that ``judges_trees``: ``(output_token_ids, accept_len,
        accepted_node_ids [batch, max_depth])`` over ``batch.parents``.

        Raises:
            TypeError: the rule does not judge trees (``judges_trees`` False; the registry
                never gives it a tree, so this is a caller's error).
        """
        raise TypeError(f"rule {self.name!r} does not verify draft trees (judges_trees is "
                        f"False)")

    @classmethod
    def from_config(cls, config: VerifierConfig) -> VerificationRule:
        """The rule as one verifier runs it, from the settings of ``config`` it reads (default:
        none). Raises ValueError for settings it refuses."""
        return cls()

    @classmethod
    def check_config(cls, config: VerifierConfig) -> None:
        """Raise ValueError for settings of ``config`` this rule owns that are wrong (e.g. a
        parameter given without picking the rule). Default: none."""


_RULES: dict[str, type[VerificationRule]] = {}
_BUILTIN: set[str] = set()
_lock = threading.RLock()
_state = {"loaded": "no"}  # "no" -> "loading" -> "yes"


def _check_declarations(cls: type[VerificationRule], what: str) -> str:
    """The rule's name, after TypeError for declarations the system cannot use."""
    name = getattr(cls, "name", None)
    problems = []
    if not isinstance(name, str) or not name:
        problems.append("no string `name`")
    elif name == AUTO:
        problems.append(f"{AUTO!r} is not a rule name (it picks no rule)")
    if not isinstance(cls.priority, int):
        problems.append("priority is not an int")
    if cls.judges_trees and cls.verify_tree is VerificationRule.verify_tree:
        problems.append("judges_trees without verify_tree")
    if not cls.exact and not cls.selectable:
        problems.append("a rule that is not exact must be selectable (picked by a deployment, "
                        "never applied by itself)")
    if cls.selectable and not cls.help:
        problems.append("a selectable rule needs `help` (its --verify-rule text)")
    if problems:
        raise TypeError(f"{what} {cls.__name__!r}: " + "; ".join(problems))
    return name


def _add(cls: type[VerificationRule], source: str, name: str | None = None) -> None:
    name = name or cls.name
    with _lock:
        other = _RULES.get(name)
        if other is not None and other is not cls:
            raise name_taken("verification rule", name, cls, other, source, name in _BUILTIN)
        _RULES[name] = cls
        if cls.__module__ in BUILTIN_MODULES:
            _BUILTIN.add(name)


def register_rule(cls: type[VerificationRule]) -> type[VerificationRule]:
    """Class decorator: register the rule ``cls`` under ``cls.name``.

    Raises:
        TypeError: ``cls`` does not implement :class:`VerificationRule` (every missing method
            named) or declares something unusable (no name, ``auto``, a tree judge without
            ``verify_tree``, an inexact rule that is not selectable).
        ValueError: the name is taken (a built-in's is never shadowed).
    """
    check_interface(cls, VerificationRule, "verification rule")
    _check_declarations(cls, "verification rule")
    _load()
    _add(cls, f"module {cls.__module__}")
    return cls


def _load() -> None:
    """Register the rules the built-in modules define (every concrete VerificationRule class
    of theirs), then every entry point of the group; once per process."""
    with _lock:
        if _state["loaded"] != "no":
            return
        _state["loaded"] = "loading"
        try:
            for module_name in BUILTIN_MODULES:
                module = importlib.import_module(module_name)
                for obj in vars(module).values():
                    if (inspect.isclass(obj) and issubclass(obj, VerificationRule)
                            and obj.__module__ == module_name and not inspect.isabstract(obj)):
                        check_interface(obj, VerificationRule, "verification rule")
                        _check_declarations(obj, "verification rule")
                        _add(obj, f"module {module_name}")
        except BaseException:
            _state["loaded"] = "no"
            _RULES.clear()
            _BUILTIN.clear()
            raise
        _state["loaded"] = "yes"
    load_plugins()


def load_plugins() -> None:
    """Register the rules of every entry point of :data:`ENTRY_POINT_GROUP` not registered
    yet (read again each call).

    Raises:
        ValueError: an entry point named like a built-in rule (naming its distribution).
        TypeError, ImportError: a plugin that cannot be loaded or registered.
    """
    _load()
    for ep in entry_points(ENTRY_POINT_GROUP):
        if ep.name in _BUILTIN:
            raise ValueError(f"{origin(ep)} names verification rule {ep.name!r}, a built-in "
                             "name, which plugins cannot shadow; rename the entry point")
        if ep.name in _RULES:
            continue
        cls = load_entry_point(ep)
        check_interface(cls, VerificationRule, f"{origin(ep)}: verification rule")
        name = _check_declarations(cls, f"{origin(ep)}: verification rule")
        if name != ep.name:
            raise TypeError(f"{origin(ep)}: the rule's `name` is {name!r}, not the entry "
                            f"point's {ep.name!r}")
        _add(cls, origin(ep))


def rule_classes() -> list[type[VerificationRule]]:
    """Every registered rule, in the order a request's rule is chosen: highest priority first,
    then by name."""
    _load()
    return sorted(_RULES.values(), key=lambda c: (-c.priority, c.name))


def get_rule_class(name: str) -> type[VerificationRule]:
    """The rule registered as ``name``. Raises KeyError listing the known rules."""
    _load()
    try:
        return _RULES[name]
    except KeyError:
        raise KeyError(f"unknown verification rule {name!r}; known: {sorted(_RULES)}") from None


def get_rule(name: str, config: VerifierConfig | None = None) -> VerificationRule:
    """The rule registered as ``name``, built for ``config`` (None: with the rule's own
    defaults). Raises KeyError listing the known rules, ValueError for settings the rule
    refuses."""
    cls = get_rule_class(name)
    return cls() if config is None else cls.from_config(config)


def selectable_rules() -> dict[str, type[VerificationRule]]:
    """The rules a deployment may pick (``verify_rule``), by name."""
    return {c.name: c for c in sorted(rule_classes(), key=lambda c: c.name) if c.selectable}


def verify_rule_choices() -> tuple[str, ...]:
    """The values ``verify_rule`` may take: :data:`AUTO`, then the selectable rules' names."""
    return (AUTO, *selectable_rules())


def check_verify_rule(verify_rule: str) -> str:
    """``verify_rule`` if a deployment may pick it (:func:`verify_rule_choices`).

    Raises:
        ValueError: any other value, naming the allowed ones.
    """
    choices = verify_rule_choices()
    if verify_rule not in choices:
        raise ValueError(f"unknown verify_rule {verify_rule!r}; use one of "
                         f"{', '.join(choices)}")
    return verify_rule


def check_rule_settings(config: VerifierConfig) -> None:
    """The verification settings of ``config``: its ``verify_rule`` and every rule's own
    (:meth:`VerificationRule.check_config`). Raises ValueError."""
    check_verify_rule(config.verify_rule)
    for cls in rule_classes():
        cls.check_config(config)


def outputs_exact(verify_rule: str) -> bool:
    """Whether a deployment with ``verify_rule`` commits the target's own tokens: False when
    it picked a rule that is not ``exact`` (its responses and metrics say so). Raises
    ValueError for a ``verify_rule`` no deployment may pick."""
    check_verify_rule(verify_rule)
    return verify_rule == AUTO or selectable_rules()[verify_rule].exact


class RuleSet:
    """The rules of one verifier, built for its ``config`` (:meth:`VerificationRule.from_config`),
    and the choice of each request's rule.

    Raises:
        ValueError: a ``verify_rule`` no deployment may pick, or settings a rule refuses.
    """

    def __init__(self, config: VerifierConfig) -> None:
        self.verify_rule = check_verify_rule(config.verify_rule)
        self.rules = [cls.from_config(config) for cls in rule_classes()]

    def select(self, sampling: SamplingParams, tree: bool = False) -> VerificationRule:
        """The rule of a request with ``sampling`` (drafts as a tree when ``tree``): the first
        of :attr:`rules` that applies.

        Raises:
            ValueError: parameters no rule can verify (SamplingParams.invalid_reason; the
                verifier refuses such requests at admission), no rule applies, or the rule
                chosen for a tree does not judge trees.
        """
        # engine.sampling imports torch and triton: the registry stays torch-free (the CLI, the
        # pure-Python scheduler)
        from specmesh.engine.sampling import sampling_mode

        why = sampling.invalid_reason()
        if why:
            raise ValueError(why)
        query = RuleQuery(sampling, sampling_mode(sampling), self.verify_rule, tree)
        for rule in self.rules:
            if rule.applies(query):
                if tree and not rule.judges_trees:
                    raise ValueError(f"verification rule {rule.name!r} verifies chains; the "
                                     "scheduler planned a draft tree")
                return rule
        raise ValueError(f"no verification rule applies to {query}")

    def judges_trees(self, sampling: SamplingParams) -> bool:
        """Whether a request with ``sampling`` may have its drafts verified as a tree: the rule
        chosen for a tree judges trees (under a rule that judges chains only, e.g. synthetic
        acceptance, the scheduler plans a tree's branch 0 as a chain)."""
        from specmesh.engine.sampling import sampling_mode  # torch, triton: as in select

        query = RuleQuery(sampling, sampling_mode(sampling), self.verify_rule, True)
        rule = next((r for r in self.rules if r.applies(query)), None)
        return rule is not None and rule.judges_trees


__all__ = ["AUTO", "AUTO_HELP", "BUILTIN_MODULES", "ENTRY_POINT_GROUP", "RuleQuery", "RuleSet",
           "VerificationRule", "check_rule_settings", "check_verify_rule", "get_rule",
           "get_rule_class", "load_plugins", "outputs_exact", "register_rule", "rule_classes",
           "selectable_rules", "verify_rule_choices"]
