"""The drafting-method registry (drafter/registry.py) and its plugins: the built-ins are the
modules of one package; a plugin is an entry point of ``specmesh.drafters`` (a distribution
written to a temporary directory) or an import path (``--drafter package.module:Class``);
registration names every missing interface method in one TypeError; a built-in name is
never shadowed; ``--drafter``, its help, train-drafter and the thread plan read the
registry."""

from __future__ import annotations

import pkgutil

import pytest
from helpers.plugins import COPYCAT_SOURCE, HALF_SOURCE, forget_modules, write_dist

import specmesh.drafter.proposers as builtin_package
import specmesh.drafter.registry as registry
from helpers.proposers import NullProposer
from specmesh.cluster.drafter_option import drafter_help, parse_drafter
from specmesh.drafter.proposer import Proposer
from specmesh.drafter.registry import (
    create_proposer,
    get_method,
    register_proposer,
    registered_methods,
    runs_a_model,
    seed_state_of,
    trainable_methods,
)

GROUP = registry.ENTRY_POINT_GROUP


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """``make(dist, modules, entry_points)`` writes a distribution and puts it on sys.path;
    the registry is restored and the plugin modules forgotten afterwards."""
    registry.spellings()  # the built-ins, loaded before the copy the test registers into
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    made: list[str] = []

    def make(dist, modules, entry_points=None):
        root = write_dist(tmp_path / dist, dist, modules, entry_points or {})
        monkeypatch.syspath_prepend(str(root))
        made.extend(m.split(".")[0] for m in modules)
        return root

    yield make
    forget_modules(tuple(made))


def test_builtins_are_every_module_of_the_methods_package():
    modules = {m.name for m in pkgutil.iter_modules(builtin_package.__path__)}
    assert modules == {"ngram", "eagle", "draft_model", "suffix", "pard", "medusa", "dspark",
                       "frozen_kv_mtp", "dflash"}
    keys = registered_methods()
    for name in modules:  # each module registers the method named after it
        assert name in keys and registry.is_builtin(name)
        assert get_method(name).__module__ == f"{builtin_package.__name__}.{name}"
    assert get_method("draft-model") is get_method("draft_model")  # its user spelling
    assert registry.spellings()[:5] == ["dflash", "draft-model", "dspark", "eagle",
                                        "frozen-kv-mtp"]


def test_an_entry_point_plugin_is_found_by_name_and_parsed_with_its_schema(plugins):
    plugins("copycat-dist", {"copycat_ep.drafting": COPYCAT_SOURCE},
            {GROUP: {"copycat": "copycat_ep.drafting:CopycatProposer"}})
    assert parse_drafter("copycat") == ("copycat", {})
    assert parse_drafter("copycat:span=2") == ("copycat", {"span": 2})
    with pytest.raises(SystemExit, match=r"--drafter copycat:span=0: span must be integer >= 1"):
        parse_drafter("copycat:span=0")
    with pytest.raises(SystemExit, match=r"unknown key 'width'; keys: span"):
        parse_drafter("copycat:width=2")
    p = create_proposer("copycat", {"span": 2})
    assert p.propose("r", [5, 6, 7, 5, 6], 2) == [7, 5]
    assert "copycat" in registered_methods() and not registry.is_builtin("copycat")
    assert "copycat: copies what followed" in drafter_help()
    assert "span: tail tokens to match (integer >= 1; default 1)" in drafter_help()
    assert seed_state_of("copycat") == "" and not runs_a_model("copycat")


def test_an_import_path_resolves_with_and_without_options(plugins):
    plugins("copycat-path-dist", {"copycat_path.mod": COPYCAT_SOURCE})
    key = "copycat_path.mod:CopycatProposer"
    assert parse_drafter(key) == (key, {})
    assert parse_drafter(f"{key}:span=3") == (key, {"span": 3})
    assert get_method(key).__name__ == "CopycatProposer"
    assert create_proposer(key, {"span": 3}).span == 3
    with pytest.raises(SystemExit, match=r"span must be integer >= 1, got 'x'"):
        parse_drafter(f"{key}:span=x")
    with pytest.raises(SystemExit, match=r"cannot import 'copycat_nosuch.mod'"):
        parse_drafter("copycat_nosuch.mod:CopycatProposer")
    with pytest.raises(SystemExit, match=r"has no 'Nope'"):
        parse_drafter("copycat_path.mod:Nope")


def test_a_method_name_wins_over_an_import_path_of_the_same_spelling():
    """``ngram:Foo`` is the n-gram method with a malformed option text, not module ``ngram``."""
    with pytest.raises(SystemExit, match=r"--drafter ngram:Foo: expected KEY=VALUE .*keys: min"):
        parse_drafter("ngram:Foo")


def test_a_plugin_missing_interface_methods_fails_registration_naming_every_one(plugins):
    plugins("half-dist", {"half_plugin.mod": HALF_SOURCE},
            {GROUP: {"half": "half_plugin.mod:HalfProposer"}})
    for name in ("half", "half_plugin.mod:HalfProposer"):  # entry point, import path
        with pytest.raises(TypeError, match=r"HalfProposer does not implement close, rollback "
                                            r"\(the abstract methods of Proposer: close, open, "
                                            r"propose, rollback\)"):
            get_method(name)
    with pytest.raises(SystemExit, match="does not implement close, rollback"):
        parse_drafter("half")
    assert "half" not in registry._REGISTRY

    class Duck:  # not a Proposer at all
        def propose(self, request_id, context_token_ids, num_tokens):
            return []

    with pytest.raises(TypeError, match=r"Duck does not subclass .*Proposer; Duck does not "
                                        r"implement close, open, rollback"):
        register_proposer(Duck)

    class WrongArity(Proposer):
        name = "wrong-arity-test"

        def open(self, request_id):
            pass

        def propose(self, request_id, context_token_ids, num_tokens):
            return []

        def rollback(self, request_id, num_context_tokens):
            pass

    with pytest.raises(TypeError, match=r"does not implement close .*WrongArity.open takes 2 "
                                        r"parameters, Proposer.open 3"):
        register_proposer(WrongArity)


def test_builtin_names_cannot_be_shadowed(plugins):
    shadow = COPYCAT_SOURCE.replace("class CopycatProposer", 'class Shadow')
    plugins("shadow-dist", {"shadow_plugin.mod": shadow},
            {GROUP: {"eagle": "shadow_plugin.mod:Shadow"}})
    for call in (registered_methods, lambda: get_method("copycat-unknown"),
                 lambda: parse_drafter("copycat-unknown")):
        with pytest.raises((ValueError, SystemExit),
                           match=r"entry point 'eagle = shadow_plugin.mod:Shadow' \(group "
                                 r"specmesh.drafters\) of distribution 'shadow-dist 0.1' names "
                                 r"drafting method 'eagle', a built-in name"):
            call()
    assert get_method("eagle").__module__ == "specmesh.drafter.proposers.eagle"


def test_builtin_user_spellings_cannot_be_shadowed_either(plugins):
    plugins("shadow2-dist", {"shadow2_plugin.mod": COPYCAT_SOURCE},
            {GROUP: {"draft-model": "shadow2_plugin.mod:CopycatProposer"}})
    with pytest.raises(ValueError, match="'shadow2-dist 0.1' names drafting method "
                                         "'draft-model', a built-in name"):
        registered_methods()


def test_a_plugin_module_cannot_take_a_builtin_or_a_registered_name(plugins):
    class Impostor(NullProposer):
        name = "ngram"

    with pytest.raises(ValueError, match=r"'ngram' is built in \(specmesh.drafter.proposers."
                                         r"ngram.NgramProposer\): module .*test_method_registry "
                                         r"\(.*Impostor\) cannot shadow it"):
        register_proposer(Impostor)
    Impostor.name = "impostor-test"
    register_proposer(Impostor)

    class Second(Impostor):
        pass

    with pytest.raises(ValueError, match=r"'impostor-test' is already registered by .*Impostor"):
        register_proposer(Second)


def test_an_entry_points_class_name_must_be_its_name(plugins):
    named = COPYCAT_SOURCE.replace('    summary =', '    name = "other"\n    summary =')
    plugins("named-dist", {"named_plugin.mod": named},
            {GROUP: {"copycat-named": "named_plugin.mod:CopycatProposer"}})
    with pytest.raises(TypeError, match=r"the class's `name` is 'other', not the entry point's "
                                        r"'copycat-named'"):
        get_method("copycat-named")


def test_train_drafter_finds_trainers_in_the_registry():
    from specmesh.cluster.cli import build_parser

    assert trainable_methods() == ["dflash", "draft-model", "dspark", "eagle", "frozen-kv-mtp",
                                  "medusa", "pard"]
    assert get_method("ngram").trainer is None
    args = build_parser().parse_args(["train-drafter", "--method", "draft-model", "--out", "x"])
    assert args.method == "draft-model"
    with pytest.raises(SystemExit):  # argparse: not a choice
        build_parser().parse_args(["train-drafter", "--method", "ngram", "--out", "x"])


def test_the_default_thread_plan_asks_whether_a_method_runs_a_model():
    from specmesh.cluster.options import is_model_drafter

    assert [runs_a_model(m) for m in ("ngram", "eagle", "draft_model", "draft-model")] == \
        [False, True, True, True]
    assert is_model_drafter("eagle") and not is_model_drafter("ngram")
    assert not runs_a_model("no-such-method-test")


def test_schema_defaults_are_the_proposers_own():
    """The defaults a method's schema shows are those its proposer applies when the key is
    left out (the schema documents them; the factory applies them)."""
    import inspect

    for name in ("ngram", "draft_model"):
        cls = get_method(name)
        params = inspect.signature(cls.__init__).parameters
        for o in cls.options.options:
            if o.kwarg in params and isinstance(o.default, (int, float)):
                assert params[o.kwarg].default == o.default, (name, o.key)
