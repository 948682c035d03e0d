"""The verification-rule interface: the registry, the greedy rule on a ragged batch, and the
verify step handing each request's logits to its rule (a scripted runner stands in for the
model, so the rows each rule sees are known exactly)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import specmesh.decode.rules as rules
from specmesh.decode.config import VerifierConfig
from specmesh.decode.request import Request
from specmesh.decode.rules import RuleSet, VerificationRule, get_rule, register_rule
from specmesh.decode.scheduler import PlannedRequest
from specmesh.decode.verification import GreedyRule, RuleBatch
from specmesh.decode.verify_step import VerifyStep
from specmesh.protocol.messages import SamplingParams

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


def test_registry_refuses_non_rules_nameless_rules_and_name_clashes(monkeypatch):
    rules.rule_classes()  # loaded before the copy the test registers into
    monkeypatch.setattr(rules, "_RULES", dict(rules._RULES))
    with pytest.raises(TypeError):
        register_rule(object())  # type: ignore[arg-type]

    class Nameless(VerificationRule):
        def applies(self, query):
            return False

        def verify(self, batch):
            raise AssertionError

    with pytest.raises(TypeError, match="no string `name`"):
        register_rule(Nameless)

    class Impostor(GreedyRule):
        pass

    with pytest.raises(ValueError, match="'greedy' is built in .*cannot shadow"):
        register_rule(Impostor)
    with pytest.raises(KeyError, match="known: .*greedy"):
        get_rule("beam")


def test_rule_for_sampling_params():
    def rule_name_for(sampling):
        return RuleSet(VerifierConfig()).select(sampling).name

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
        """Takes the sampled requests, before rejection sampling (priority 5 > 0)."""

        name = "accept-all"
        priority = 5

        def applies(self, query):
            return query.sampling.temperature > 0

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

    rules.rule_classes()  # loaded before the copy the test registers into
    monkeypatch.setattr(rules, "_RULES", dict(rules._RULES))
    register_rule(AcceptAll)
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


def test_rejection_rule_processes_every_row_and_uses_full_draft_probs():
    """Drafts sampled from the very distribution the target samples from always pass (full
    draft_probs: u * q < p with q == p); one-hot drafts outside top-k never do (every verified
    row, not only the bonus one, is processed with the request's top_k)."""
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    sp = SamplingParams(temperature=0.7, top_k=3)
    drafts = logits[:3].topk(3).indices[:, 0]  # each row's most likely token
    batch = RuleBatch(draft_token_ids=drafts, cu_num_draft_tokens=torch.tensor([3]),
                      target_logits=logits, sampling=[sp],
                      generator=torch.Generator().manual_seed(1))
    from specmesh.engine.sampling import processed_probs
    target_probs = processed_probs(logits, [sp], [4])
    full = dataclasses.replace(batch, draft_probs=target_probs[:3])
    for _ in range(20):
        out, accept_len = get_rule("rejection").verify(full)
        assert accept_len.tolist() == [3] and out[0, :3].tolist() == drafts.tolist()
        assert int(out[0, 3]) in logits[3].topk(3).indices.tolist()  # bonus inside top-k
    outside = logits[0].topk(VOCAB).indices[-1:]  # the least likely token of row 0
    low = RuleBatch(draft_token_ids=outside, cu_num_draft_tokens=torch.tensor([1]),
                    target_logits=logits[:2], sampling=[sp])
    for _ in range(20):
        out, accept_len = get_rule("rejection").verify(low)
        assert accept_len.tolist() == [0]
        assert int(out[0, 0]) in logits[0].topk(3).indices.tolist()  # recovered inside top-k


def test_coupled_rule_needs_positions():
    batch = RuleBatch(draft_token_ids=torch.tensor([1]), cu_num_draft_tokens=torch.tensor([1]),
                      target_logits=torch.randn(2, VOCAB),
                      sampling=[SamplingParams(temperature=1.0, seed=3)])
    with pytest.raises(ValueError, match="positions"):
        get_rule("coupled").verify(batch)


def test_verify_step_mixes_greedy_sampled_and_seeded_requests():
    """One forward, three rules: greedy rows match the argmax, the seeded row is the coupled
    rule at positions starting from the request's committed length, the sampled row comes from
    the verifier's generator (the same generator seed gives the same tokens)."""
    from specmesh.kernels.coupled_sample import coupled_sample_ref
    from specmesh.engine.sampling import processed_probs

    torch.manual_seed(0)
    greedy_logits = one_hot_logits([4, 9, 3])
    seeded_logits, sampled_logits = torch.randn(3, VOCAB), torch.randn(4, VOCAB)
    seeded_sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.8, seed=123)
    sampled_sp = SamplingParams(max_tokens=16, temperature=1.0)

    def plan():
        p = [planned("g", [4, 5]), planned("c", [2, 6]), planned("r", [1, 1, 1])]
        p[1].request.sampling, p[2].request.sampling = seeded_sp, sampled_sp
        p[1].request.output_token_ids = [8, 3, 3, 7]  # committed_len 4
        return p

    runs = []
    for _ in range(2):
        runner = ScriptedRunner([greedy_logits, seeded_logits, sampled_logits])
        runs.append(VerifyStep(runner, seed=5).run(plan()))  # type: ignore[arg-type]
    g, c, r = runs[0]
    assert (g.token_ids, g.accept_len) == ([4, 9], 1)
    want, want_len = coupled_sample_ref(
        torch.tensor([2, 6]), torch.tensor([2]), processed_probs(seeded_logits, [seeded_sp], [3]),
        torch.tensor([123]), torch.tensor([4]))
    assert c.accept_len == int(want_len[0]) and c.token_ids == want[0, :c.accept_len + 1].tolist()
    assert len(r.token_ids) == r.accept_len + 1 and r.num_draft_tokens == 3
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
