"""The verification-rule interface: the registry, the greedy rule on a ragged batch, and the
verify step handing each request's logits to its rule (a scripted runner stands in for the
model, so the rows each rule sees are known exactly)."""

from __future__ import annotations

import pytest
import torch

import decode.verification as verification
from decode.request import Request
from decode.scheduler import PlannedRequest
from decode.verification import (
    GreedyRule,
    RuleBatch,
    VerificationRule,
    get_rule,
    register_rule,
    rule_name_for,
)
from decode.verify_step import VerifyStep
from protocol.messages import SamplingParams

VOCAB = 11


def one_hot_logits(token_ids: list[int]) -> torch.Tensor:
    """[len, VOCAB] logits whose argmax row i is token_ids[i]."""
    out = torch.zeros(len(token_ids), VOCAB)
    out[torch.arange(len(token_ids)), torch.tensor(token_ids)] = 5.0
    return out


def test_greedy_rule_on_a_ragged_batch():
    # request 0: drafts [3, 4, 5], target argmax [3, 4, 9, 1] -> accept 2, recovered 9
    # request 1: no drafts, target argmax [6] -> bonus 6
    # request 2: drafts [2], target argmax [2, 7] -> accept 1, bonus 7
    batch = RuleBatch(draft_token_ids=torch.tensor([3, 4, 5, 2]),
                      cu_num_draft_tokens=torch.tensor([3, 3, 4]),
                      target_logits=one_hot_logits([3, 4, 9, 1, 6, 2, 7]),
                      sampling=[SamplingParams()] * 3)
    out, accept_len = GreedyRule().verify(batch)
    assert accept_len.tolist() == [2, 0, 1]
    assert [row[: a + 1] for row, a in zip(out.tolist(), accept_len.tolist())] == \
        [[3, 4, 9], [6], [2, 7]]


def test_registry_refuses_non_rules_nameless_rules_and_name_clashes():
    with pytest.raises(TypeError):
        register_rule(object())  # type: ignore[arg-type]

    class Nameless(VerificationRule):
        def verify(self, batch):
            raise AssertionError

    with pytest.raises(TypeError, match="no string `name`"):
        register_rule(Nameless())

    class Impostor(GreedyRule):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_rule(Impostor())
    with pytest.raises(KeyError, match="known: .*greedy"):
        get_rule("beam")


def test_rule_for_sampling_params():
    assert rule_name_for(SamplingParams(temperature=0.0)) == "greedy"
    assert rule_name_for(SamplingParams(temperature=0.0, seed=3)) == "greedy"
    assert rule_name_for(SamplingParams(temperature=1e-6, seed=3)) == "greedy"
    assert rule_name_for(SamplingParams(temperature=0.7)) == "rejection"
    assert rule_name_for(SamplingParams(temperature=0.7, seed=0)) == "coupled"
    with pytest.raises(ValueError, match="top_p"):
        rule_name_for(SamplingParams(temperature=0.7, top_p=0.0))


class ScriptedRunner:
    """Returns the given per-request logits and records the chunks it was asked to run."""

    def __init__(self, logits: list[torch.Tensor]) -> None:
        self.logits = logits
        self.chunks = []

    def forward(self, chunks, logits="last"):
        assert logits == "all"
        self.chunks = chunks
        return self.logits


def planned(rid: str, drafts: list[int], temperature: float = 0.0) -> PlannedRequest:
    req = Request(request_id=rid, gateway="gw", prompt_token_ids=[1, 2, 3],
                  sampling=SamplingParams(max_tokens=16, temperature=temperature),
                  num_speculative_tokens=4)
    req.output_token_ids = [8]
    req.block_table = [0]
    return PlannedRequest(req, drafts)


def test_verify_step_groups_requests_by_rule(monkeypatch):
    """A new rule plugs in through the registry alone: the verify step hands it exactly its
    requests' drafts and logit rows, and merges outputs back in plan order."""
    seen: list[RuleBatch] = []

    class AcceptAll(VerificationRule):
        name = "accept-all"

        def verify(self, batch):
            seen.append(batch)
            k = batch.cu_num_draft_tokens.diff(prepend=torch.zeros(1, dtype=torch.long))
            out = torch.full((batch.batch_size, int(k.max()) + 1), -1)
            start = 0
            for b, n in enumerate(k.tolist()):
                out[b, :n] = batch.draft_token_ids[start:start + n]
                out[b, n] = 0
                start += n
            return out, k

    monkeypatch.setattr(verification, "_RULES", dict(verification._RULES))
    register_rule(AcceptAll())
    monkeypatch.setattr("decode.verify_step.rule_name_for",
                        lambda s: "accept-all" if s.temperature > 0 else "greedy")
    plan = [planned("g", [4, 5]), planned("s", [7, 7, 7], temperature=1.0), planned("g2", [])]
    runner = ScriptedRunner([one_hot_logits([4, 9, 3]), torch.randn(4, VOCAB),
                             one_hot_logits([2])])
    outputs = VerifyStep(runner).run(plan)  # type: ignore[arg-type]
    assert [c.token_ids for c in runner.chunks] == [[8, 4, 5], [8, 7, 7, 7], [8]]
    assert [c.start_pos for c in runner.chunks] == [3, 3, 3]
    assert [(o.token_ids, o.accept_len, o.num_draft_tokens) for o in outputs] == \
        [([4, 9], 1, 2), ([7, 7, 7, 0], 3, 3), ([2], 0, 0)]
    (batch,) = seen
    assert batch.draft_token_ids.tolist() == [7, 7, 7]
    assert torch.equal(batch.target_logits, runner.logits[1])
