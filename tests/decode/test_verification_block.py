"""The ``block`` verification rule (block verification, arXiv 2403.10444) through
decode/verification.py: ``verify_rule="block"`` gives unseeded sampled requests the block rule
and leaves greedy and seeded requests on theirs, in the rule choice, in the verify step, in the
verifier worker and from ``specmesh serve --verify-rule block``; unknown values are refused."""

from __future__ import annotations

import argparse

import pytest
import torch

from specmesh.decode.config import VerifierConfig
from specmesh.decode.request import Request
from specmesh.decode.rules import RuleSet, get_rule, rule_classes, verify_rule_choices
from specmesh.decode.scheduler import PlannedRequest
from specmesh.decode.verification import BlockRule, RuleBatch
from specmesh.decode.verify_step import VerifyStep
from specmesh.engine.sampling import processed_probs
from specmesh.kernels.block_verify import block_verify_noise, block_verify_ref
from specmesh.protocol.messages import SamplingParams

VOCAB = 11
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
SEEDED = SamplingParams(max_tokens=16, temperature=0.9, seed=123)
SAMPLED = SamplingParams(max_tokens=16, temperature=1.0, top_k=6)


def rule_name_for(sampling: SamplingParams, verify_rule: str = "auto") -> str:
    """The name of the rule the registry picks for a chain request under ``verify_rule``."""
    return RuleSet(VerifierConfig(verify_rule=verify_rule)).select(sampling).name


def test_rule_choice_with_verify_rule_block():
    assert verify_rule_choices() == ("auto", "block", "synthetic")  # synthetic: its own tests
    assert rule_name_for(SAMPLED, "block") == "block"
    assert rule_name_for(GREEDY, "block") == "greedy"
    assert rule_name_for(SamplingParams(temperature=1e-6), "block") == "greedy"
    assert rule_name_for(SEEDED, "block") == "coupled"
    # auto keeps today's choice
    assert rule_name_for(SAMPLED) == rule_name_for(SAMPLED, "auto") == "rejection"
    assert rule_name_for(SEEDED, "auto") == "coupled" and rule_name_for(GREEDY) == "greedy"
    assert isinstance(get_rule("block"), BlockRule)


def test_unknown_verify_rules_are_refused():
    with pytest.raises(ValueError, match="unknown verify_rule 'tree'.*auto.*block"):
        rule_name_for(SAMPLED, "tree")
    with pytest.raises(ValueError, match="unknown verify_rule 'rejection'"):
        VerifierConfig(verify_rule="rejection")  # a rule, but not one a deployment picks
    with pytest.raises(ValueError, match="unknown verify_rule"):
        VerifyStep(runner=None, verify_rule="Block")  # type: ignore[arg-type]
    assert VerifierConfig().verify_rule == "auto"


def test_block_rule_runs_block_verification_on_processed_rows():
    """The rule processes every row with the request's parameters and runs the block kernel
    with noise from the batch's generator (and full draft probs when the drafter sent them)."""
    torch.manual_seed(0)
    logits = torch.randn(7, VOCAB)
    drafts, cu = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([3, 5])
    draft_probs = torch.softmax(torch.randn(5, VOCAB), dim=-1)
    for dp in (None, draft_probs):
        batch = RuleBatch(draft_token_ids=drafts, cu_num_draft_tokens=cu, target_logits=logits,
                          sampling=[SAMPLED, SAMPLED], draft_probs=dp,
                          generator=torch.Generator().manual_seed(4))
        out, accept_len = get_rule("block").verify(batch)
        target = processed_probs(logits, [SAMPLED, SAMPLED], [4, 3])
        uniform, noise = block_verify_noise(cu, VOCAB, generator=torch.Generator().manual_seed(4))
        want_out, want_len = block_verify_ref(drafts, cu, dp, target, uniform, noise)
        assert torch.equal(out, want_out) and torch.equal(accept_len, want_len)


class ScriptedRunner:
    def __init__(self, logits: list[torch.Tensor]) -> None:
        self.logits = logits

    def forward(self, chunks, logits="last"):
        return self.logits


def planned(rid: str, drafts: list[int], sampling: SamplingParams) -> PlannedRequest:
    req = Request(request_id=rid, gateway="gw", prompt_token_ids=[1, 2, 3], sampling=sampling,
                  num_speculative_tokens=4)
    req.output_token_ids = [8, 3]
    req.block_table = [0]
    return PlannedRequest(req, drafts)


@pytest.mark.parametrize("verify_rule", ["auto", "block"])
def test_verify_step_selects_block_for_unseeded_sampled_requests_only(monkeypatch, verify_rule):
    seen: dict[str, list[list[int]]] = {}

    for cls in rule_classes():
        def spy(self, batch, _verify=cls.verify):
            seen.setdefault(self.name, []).append(batch.draft_token_ids.tolist())
            return _verify(self, batch)

        monkeypatch.setattr(cls, "verify", spy)
    torch.manual_seed(1)
    logits = [torch.randn(3, VOCAB), torch.randn(3, VOCAB), torch.randn(4, VOCAB),
              torch.randn(2, VOCAB)]

    def plan():
        return [planned("g", [4, 5], GREEDY), planned("c", [2, 6], SEEDED),
                planned("r", [1, 7, 1], SAMPLED), planned("r2", [9], SAMPLED)]

    outputs = VerifyStep(ScriptedRunner(logits), seed=5, verify_rule=verify_rule).run(plan())
    sampled_rule = "block" if verify_rule == "block" else "rejection"
    assert seen == {"greedy": [[4, 5]], "coupled": [[2, 6]], sampled_rule: [[1, 7, 1, 9]]}
    # greedy and seeded rows do not depend on the deployment's rule
    seen.clear()
    other = "auto" if verify_rule == "block" else "block"
    again = VerifyStep(ScriptedRunner(logits), seed=5, verify_rule=other).run(plan())
    assert [(o.token_ids, o.accept_len) for o in outputs[:2]] == \
        [(o.token_ids, o.accept_len) for o in again[:2]]
    if verify_rule == "block":  # the sampled rows are block verification's, with that noise
        target = processed_probs(torch.cat(logits[2:]), [SAMPLED, SAMPLED], [4, 2])
        cu = torch.tensor([3, 4])
        uniform, noise = block_verify_noise(cu, VOCAB, generator=torch.Generator().manual_seed(5))
        want, want_len = block_verify_ref(torch.tensor([1, 7, 1, 9]), cu, None, target,
                                          uniform, noise)
        assert [o.accept_len for o in outputs[2:]] == want_len.tolist()
        assert [o.token_ids for o in outputs[2:]] == \
            [row[: a + 1] for row, a in zip(want.tolist(), want_len.tolist())]


def test_verifier_worker_and_serve_option_carry_the_rule():
    from specmesh.cluster.config import ClusterConfig
    from specmesh.cluster.options import add_cluster_options

    assert ClusterConfig.create(verify_rule="block").verifier.verify_rule == "block"
    assert ClusterConfig().verifier.verify_rule == "auto"
    with pytest.raises(ValueError, match="verify_rule"):
        ClusterConfig.create(verify_rule="tree")
    p = argparse.ArgumentParser()
    add_cluster_options(p)
    assert p.parse_args([]).verify_rule == "auto"
    assert p.parse_args(["--verify-rule", "block"]).verify_rule == "block"
    with pytest.raises(SystemExit):
        p.parse_args(["--verify-rule", "tree"])


def test_cli_serve_verify_rule_block_reaches_the_verifier_config(monkeypatch):
    import specmesh.cluster.options as options
    from specmesh.cluster.cli import build_parser

    monkeypatch.setattr("specmesh.cluster.drafter_option.shipped_head_for", lambda model: None)
    args = build_parser().parse_args(["serve", "--verify-rule", "block", "--device", "cpu"])
    assert options.cluster_config(args).verifier.verify_rule == "block"
    args = build_parser().parse_args(["serve", "--device", "cpu"])
    assert options.cluster_config(args).verifier.verify_rule == "auto"


def test_in_process_cluster_with_block_rule():
    """Through the workers (tiny model): the verifier runs the block rule for the unseeded
    request; greedy and seeded outputs are the ones verify_rule='auto' gives."""
    from specmesh.cluster.inprocess import InProcessCluster
    from helpers.models import tiny_llama

    _, model, cfg = tiny_llama(seed=1, dtype=torch.float64, vocab_size=96)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 11, 12, 11, 12, 11], [3] * 9]
    params = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, temperature=0.8,
                                                            seed=7),
              SamplingParams(max_tokens=12, temperature=0.8)]
    results = {}
    for rule in ("auto", "block"):
        c = InProcessCluster(model, cfg, num_speculative_tokens=3, num_kv_blocks=128,
                             block_size=4, verify_rule=rule)
        assert c.verifier.verify_step.verify_rule == rule
        results[rule] = c.generate(prompts, params)
    for auto, block in zip(results["auto"][:2], results["block"][:2]):
        assert auto.token_ids == block.token_ids
    sampled = results["block"][2]
    assert len(sampled.token_ids) == 12 and sampled.error in (None, "")
    assert all(0 <= t < 96 for t in sampled.token_ids)
