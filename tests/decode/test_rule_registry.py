"""The verification-rule registry (decode/rules.py): each rule's ``applies``, the order the
registry tries them in and the rule it picks per request, the values a deployment may pick,
whether its outputs are exact (synthetic acceptance is a rule chosen by configuration), and
rule plugins from entry points of ``specmesh.verify_rules``."""

from __future__ import annotations

import pytest
from helpers.plugins import forget_modules, write_dist

import specmesh.decode.rules as rules
from specmesh.decode.config import VerifierConfig
from specmesh.decode.rules import (
    RuleQuery,
    RuleSet,
    get_rule_class,
    load_plugins,
    outputs_exact,
    register_rule,
    rule_classes,
    verify_rule_choices,
)
from specmesh.decode.synthetic import SyntheticRule
from specmesh.decode.verification import BlockRule, CoupledRule, GreedyRule, RejectionRule, TreeRule
from specmesh.protocol.messages import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, seed=7)
SAMPLED = SamplingParams(temperature=0.8)
MODES = {"greedy": GREEDY, "coupled": SEEDED, "random": SAMPLED}
SYNTHETIC_CFG = VerifierConfig(verify_rule="synthetic", synthetic_acceptance=(0.5,))


def q(mode: str, verify_rule: str = "auto", tree: bool = False) -> RuleQuery:
    return RuleQuery(MODES[mode], mode, verify_rule, tree)


RULES = ("auto", "block", "synthetic")


@pytest.mark.parametrize("rule,true_for", [
    # a rule says when it may verify a request; which one does is the priorities' business
    (GreedyRule, [q("greedy", r, t) for r in RULES for t in (False, True)]),
    (CoupledRule, [q("coupled", r, t) for r in RULES for t in (False, True)]),
    (RejectionRule, [q("random", r, t) for r in RULES for t in (False, True)]),
    (BlockRule, [q("random", "block"), q("random", "block", tree=True)]),
    (TreeRule, [q(m, r, tree=True) for m in MODES for r in RULES]),
    (SyntheticRule, [q(m, "synthetic", t) for m in MODES for t in (False, True)]),
])
def test_each_rules_applies(rule, true_for):
    queries = [q(m, r, t) for m in MODES for r in RULES for t in (False, True)]
    inst = rule() if rule is not SyntheticRule else rule((0.5,))
    assert [x for x in queries if inst.applies(x)] == [x for x in queries if x in true_for]


def test_the_registry_tries_rules_by_priority():
    assert [c.name for c in rule_classes()][:6] == [
        "synthetic", "tree", "coupled", "greedy", "block", "rejection"]


@pytest.mark.parametrize("config,chains,trees", [
    (VerifierConfig(), {"greedy": "greedy", "coupled": "coupled", "random": "rejection"},
     "tree"),
    (VerifierConfig(verify_rule="block"),
     {"greedy": "greedy", "coupled": "coupled", "random": "block"}, "tree"),
    (SYNTHETIC_CFG, {"greedy": "synthetic", "coupled": "synthetic", "random": "synthetic"},
     None),
])
def test_the_registry_picks_each_requests_rule(config, chains, trees):
    rs = RuleSet(config)
    assert {m: rs.select(s).name for m, s in MODES.items()} == chains
    for s in MODES.values():
        assert rs.judges_trees(s) is (trees is not None)
        if trees is not None:
            assert rs.select(s, tree=True).name == trees
        else:  # synthetic acceptance judges chains: the scheduler never plans a tree
            with pytest.raises(ValueError, match="verifies chains"):
                rs.select(s, tree=True)
    with pytest.raises(ValueError, match="top_p"):
        rs.select(SamplingParams(temperature=0.7, top_p=0.0))


def test_the_values_a_deployment_picks_and_whether_its_outputs_are_exact():
    assert verify_rule_choices() == ("auto", "block", "synthetic")
    assert [outputs_exact(r) for r in verify_rule_choices()] == [True, True, False]
    for bad in ("tree", "rejection", "Block"):  # rules that apply by themselves, a typo
        with pytest.raises(ValueError, match=f"unknown verify_rule '{bad}'; use one of auto, "
                                             "block, synthetic"):
            VerifierConfig(verify_rule=bad)
        with pytest.raises(ValueError, match="unknown verify_rule"):
            outputs_exact(bad)
    with pytest.raises(ValueError, match="needs a synthetic_acceptance curve"):
        VerifierConfig(verify_rule="synthetic")
    with pytest.raises(ValueError, match="a curve needs verify_rule 'synthetic'"):
        VerifierConfig(verify_rule="block", synthetic_acceptance=(0.5,))
    assert get_rule_class("synthetic") is SyntheticRule


def test_a_verifier_plans_trees_only_where_its_rules_judge_them():
    """The scheduler asks the verifier's rules (decode/worker.py wires RuleSet.judges_trees)."""
    import torch
    from helpers.models import tiny_llama

    from specmesh.cluster.inprocess import InProcessCluster

    _, model, cfg = tiny_llama(seed=1, dtype=torch.float64, vocab_size=96)
    for kwargs, want in (({}, True), ({"verify_rule": "synthetic",
                                       "synthetic_acceptance": (0.5,)}, False)):
        c = InProcessCluster(model, cfg, num_speculative_tokens=2, num_kv_blocks=16,
                             block_size=4, **kwargs)
        assert c.verifier.scheduler.tree_verifiable(SAMPLED) is want


RULE_PLUGIN = '''
from specmesh.decode.rules import VerificationRule
from specmesh.decode.verification import GreedyRule


class EchoRule(GreedyRule):
    """Greedy verification, picked by a deployment (a plugin's selectable rule)."""

    name = "echo-test"
    priority = 90
    selectable = True
    help = "greedy verification of every chain"

    def applies(self, query):
        return query.verify_rule == self.name and not query.tree


class NoApplies(VerificationRule):
    name = "no-applies-test"

    def verify(self, batch):
        raise AssertionError
'''


@pytest.fixture
def rule_plugin(tmp_path, monkeypatch):
    """``make(entry_points)``: a distribution of RULE_PLUGIN with those entry points on
    sys.path; the registry restored afterwards."""
    rule_classes()  # the built-ins, loaded before the copy the test registers into
    monkeypatch.setattr(rules, "_RULES", dict(rules._RULES))

    def make(eps):
        root = write_dist(tmp_path / "rule-dist", "rule-dist", {"rule_plugin.mod": RULE_PLUGIN},
                          {rules.ENTRY_POINT_GROUP: eps})
        monkeypatch.syspath_prepend(str(root))

    yield make
    forget_modules(("rule_plugin",))


def test_an_entry_point_rule_is_picked_by_configuration(rule_plugin):
    rule_plugin({"echo-test": "rule_plugin.mod:EchoRule"})
    load_plugins()
    assert verify_rule_choices() == ("auto", "block", "echo-test", "synthetic")
    rs = RuleSet(VerifierConfig(verify_rule="echo-test"))
    assert [rs.select(s).name for s in MODES.values()] == ["echo-test"] * 3
    assert rs.select(SAMPLED, tree=True).name == "tree"
    assert RuleSet(VerifierConfig()).select(SAMPLED).name == "rejection"  # not picked: unused
    assert outputs_exact("echo-test")


def test_a_rule_plugin_missing_a_method_or_shadowing_a_builtin_is_refused(rule_plugin):
    rule_plugin({"no-applies-test": "rule_plugin.mod:NoApplies"})
    with pytest.raises(TypeError, match=r"NoApplies does not implement applies \(the abstract "
                                        r"methods of VerificationRule: applies, verify\)"):
        load_plugins()


def test_a_rule_plugin_cannot_shadow_a_builtin(rule_plugin):
    rule_plugin({"greedy": "rule_plugin.mod:EchoRule"})
    with pytest.raises(ValueError, match=r"entry point 'greedy = rule_plugin.mod:EchoRule' .*"
                                         r"'rule-dist 0.1' names verification rule 'greedy', a "
                                         r"built-in name"):
        load_plugins()


def test_rule_declarations_are_checked(rule_plugin):
    class Loose(GreedyRule):
        """Not exact and applied by itself: refused (it would change outputs unasked)."""

        name = "loose-test"
        exact = False

    with pytest.raises(TypeError, match="a rule that is not exact must be selectable"):
        register_rule(Loose)

    class Auto(GreedyRule):
        name = "auto"

    with pytest.raises(TypeError, match="'auto' is not a rule name"):
        register_rule(Auto)

    class Treeless(GreedyRule):
        name = "treeless-test"
        judges_trees = True

    with pytest.raises(TypeError, match="judges_trees without verify_tree"):
        register_rule(Treeless)
