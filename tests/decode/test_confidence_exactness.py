"""``--speculative-policy confidence`` end to end through the three in-process workers (real
encoded messages, float64 tiny random Llama): greedy output equals plain decode, drafts are
accepted, and a confidence head's predictions (DraftTailStream.draft_confidences, here scripted
by the test) keep the drafts it predicts to fail out of the verify forward."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from helpers.models import hf_greedy, tiny_llama
from helpers.proposers import OracleProposer
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.decode.cost_table import VerifyCostTable
from specmesh.protocol.messages import DraftTailStream, SamplingParams

MAX_TOKENS = 24
SIZES = (1, 2, 4, 8)


class EveryThirdWrongProposer(OracleProposer):
    """The known greedy continuation, except a wrong token at every output position ``p``
    with ``p % 3 == 2`` (after it nothing matches the context, so it drafts nothing more)."""

    name = "third-wrong-test"

    def __init__(self, prompts, refs, vocab_size):  # noqa: ANN001
        super().__init__(prompts, refs)
        self.prompt_lens = [len(p) for p in prompts]
        self.vocab_size = vocab_size

    def propose(self, request_id, context_token_ids, num_tokens):  # noqa: ANN001, ANN201
        n = len(context_token_ids)
        for seq, plen in zip(self.seqs, self.prompt_lens):
            if seq[:n] == context_token_ids:
                return [(t + 1) % self.vocab_size if (n + j - plen) % 3 == 2 else t
                        for j, t in enumerate(seq[n:n + num_tokens])]
        return []


def head_confidence(position: int) -> float:
    """A scripted (perfect) confidence head for EveryThirdWrongProposer."""
    return 0.02 if position % 3 == 2 else 0.97


@pytest.fixture(scope="module")
def tiny():
    hf, model, cfg = tiny_llama(seed=1, dtype=torch.float64, vocab_size=96)
    rng = random.Random(0)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [1, 2, 3], [rng.randrange(96) for _ in range(37)],
               [11, 12, 11, 12, 11, 12, 11], [40]]
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return model, cfg, prompts, refs


def _cluster(model, cfg, proposer, policy, head=False):  # noqa: ANN001, ANN202
    c = InProcessCluster(model, cfg, num_speculative_tokens=4, num_kv_blocks=256, block_size=4,
                         proposer=proposer, speculative_policy=policy)
    # a scripted profile: one more token per request costs a tenth of a one-token step
    c.verifier.scheduler.draft_budget.table = VerifyCostTable(
        SIZES, SIZES, {(b, w): 1.0 + 0.1 * (w - 1) for b in SIZES for w in SIZES})
    if head:  # the drafter sends a confidence per draft, as a trained head would
        send = c.drafter.send

        def with_confidences(peer, msg):  # noqa: ANN001, ANN202
            if isinstance(msg, DraftTailStream) and msg.draft_token_ids:
                msg = msgspec.structs.replace(msg, draft_confidences=[
                    head_confidence(msg.start_pos + j) for j in range(len(msg.draft_token_ids))])
            return send(peer, msg)

        c.drafter.send = with_confidences
    return c


def _generate(c, prompts):  # noqa: ANN001, ANN202
    params = [SamplingParams(max_tokens=MAX_TOKENS - (i % 3)) for i in range(len(prompts))]
    return c.generate(prompts, params), params


def test_confidence_policy_greedy_equals_plain_decode_and_accepts(tiny):
    model, cfg, prompts, refs = tiny
    c = _cluster(model, cfg, OracleProposer(prompts, refs), "confidence")
    res, params = _generate(c, prompts)
    for r, ref, sp in zip(res, refs, params):
        assert r.token_ids == ref[:sp.max_tokens]
    st = c.verifier.stats
    assert st.num_accepted_tokens > 0 and st.num_accepted_tokens == st.num_draft_tokens
    budget = c.verifier.scheduler.confidence_budget.stats
    assert budget.num_steps > 0 and budget.num_fallback_steps == 0
    assert budget.realised_accepted > 0 and budget.predicted_accepted > 0


def test_head_confidences_keep_failing_drafts_out_and_stay_exact(tiny):
    model, cfg, prompts, refs = tiny
    runs = {}
    for policy in ("fixed", "confidence"):
        c = _cluster(model, cfg, EveryThirdWrongProposer(prompts, refs, cfg.vocab_size),
                     policy, head=True)
        res, params = _generate(c, prompts)
        for r, ref, sp in zip(res, refs, params):
            assert r.token_ids == ref[:sp.max_tokens]
        runs[policy] = c
    fixed, conf = runs["fixed"].verifier.stats, runs["confidence"].verifier.stats
    assert conf.num_accepted_tokens > 0
    rejected = {p: s.num_draft_tokens - s.num_accepted_tokens for p, s in
                (("fixed", fixed), ("confidence", conf))}
    assert rejected["confidence"] < rejected["fixed"]
    budget = runs["confidence"].verifier.scheduler.confidence_budget.stats
    # the perfect head's predictions track what was accepted
    assert budget.num_steps > 0
    assert budget.predicted_accepted == pytest.approx(budget.realised_accepted, rel=0.15)


def test_policy_flag_and_prometheus_sums(tiny):
    import types

    from prometheus_client import CollectorRegistry, generate_latest

    from specmesh.cluster.cli import build_parser
    from specmesh.cluster.metrics import RoleCollector
    from specmesh.cluster.options import policy_settings

    args = build_parser().parse_args(["serve", "--speculative-policy", "confidence"])
    assert policy_settings(args) == {"speculative_policy": "confidence"}
    model, cfg, prompts, refs = tiny
    c = _cluster(model, cfg, OracleProposer(prompts, refs), "confidence")
    res, params = _generate(c, prompts[:2])
    assert [r.token_ids for r in res] == [ref[:sp.max_tokens]
                                          for ref, sp in zip(refs, params)]
    registry = CollectorRegistry()
    registry.register(RoleCollector(types.SimpleNamespace(
        role="verifier", instance_id="verifier-0", worker=c.verifier)))
    text = generate_latest(registry).decode()
    st = c.verifier.scheduler.confidence_budget.stats

    def value(name: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(name + "_total{"))
        return float(line.split()[-1])

    assert value("specmesh:spec_decode_confidence_realised_accepted") == \
        st.realised_accepted > 0
    assert value("specmesh:spec_decode_confidence_predicted_accepted") == \
        pytest.approx(st.predicted_accepted)
    assert value("specmesh:spec_decode_confidence_steps") == st.num_steps > 0


@pytest.mark.parametrize("draft", ["same", "small"])
def test_draft_model_greedy_q_is_sent_calibrated_and_exact(tiny, draft):
    """A draft model sends each greedy draft's probability (DraftTailStream.draft_token_probs);
    the verifier scores greedy drafts with it through its calibration, and the output is
    plain decode's."""
    from specmesh.drafter.proposers.draft_model import DraftModelProposer

    model, cfg, prompts, refs = tiny
    draft_model = model if draft == "same" else tiny_llama(
        seed=7, dtype=torch.float64, vocab_size=96, hidden_size=32, num_layers=1, num_heads=2,
        num_kv_heads=1)[1]
    p = DraftModelProposer(dtype="float64", loaded=draft_model, num_blocks=64, block_size=4,
                           target_vocab_size=cfg.vocab_size)
    c = InProcessCluster(model, cfg, num_speculative_tokens=4, num_kv_blocks=256, block_size=4,
                         draft_method="draft_model", proposer=p, speculative_policy="confidence")
    c.verifier.scheduler.draft_budget.table = VerifyCostTable(
        SIZES, SIZES, {(b, w): 1.0 + 0.1 * (w - 1) for b in SIZES for w in SIZES})
    res, params = _generate(c, prompts)
    for r, ref, sp in zip(res, refs, params):
        assert r.token_ids == ref[:sp.max_tokens]
    sched = c.verifier.scheduler
    cal = sched.draft_confidences.calibration
    judged = sum(t.num_judged for (key, _), t in cal.tables.items()
                 if key == "draft_model:q:greedy")
    assert judged > 0  # greedy q arrived on the wire and was calibrated on outcomes
    assert sched.confidence_budget.stats.num_steps > 0
    if draft == "same":  # the target drafting for itself: every verified draft accepted
        st = c.verifier.stats
        assert st.num_accepted_tokens == st.num_draft_tokens > 0


def test_budget_zero_steps_run_keep_the_drafter_going_and_probe(tiny):
    """Drafts that never pay (each token of width costs a whole step): the budget is 0, the
    steps still commit one token each, the drafter keeps drafting, and a probe step every
    PROBE_EVERY verifies first drafts."""
    from specmesh.decode.confidence_budget import PROBE_EVERY

    model, cfg, prompts, refs = tiny
    c = _cluster(model, cfg, OracleProposer(prompts, refs), "confidence")
    c.verifier.scheduler.draft_budget.table = VerifyCostTable(
        SIZES, SIZES, {(b, w): float(w) for b in SIZES for w in SIZES})
    res, params = _generate(c, prompts[:1])
    assert res[0].token_ids == refs[0][:params[0].max_tokens]
    budget = c.verifier.scheduler.confidence_budget.stats
    assert budget.num_probe_steps >= 1 and budget.num_steps >= PROBE_EVERY
    st = c.verifier.stats
    # only the probes verified drafts: one each, all accepted (the oracle)
    assert st.num_draft_tokens == st.num_accepted_tokens == budget.num_probe_steps
    assert c.drafter.stats.num_draft_tokens_sent > st.num_draft_tokens
