"""Full draft probabilities end to end (issue 8): a model drafter (the standalone draft-model
proposer on tiny float64 models) samples unseeded sampled requests' drafts from its processed
distribution and sends it as DraftTailStream.draft_probs; seeded requests draft the coupled
rule's Gumbel-max token; the verifier's rejection and block rules use the rows.

- a drafter whose distribution is the target's own has every sampled draft accepted when its
  rows reach the rule (``min(1, p / q) = 1``), far fewer when they do not (one-hot: ``p(x)``);
- with another model as drafter, the distribution of output tokens at positions 2 and 3 matches
  the exact marginals (chi-square), drafts accepted, for the rejection and the block rule;
- seeded output with the model drafter equals the plain coupled reference, nearly every draft
  accepted when the drafter is the target;
- rows that are not distributions are a protocol error for the request only.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers.models import tiny_llama

from specmesh.cluster.inprocess import InProcessCluster
from specmesh.decode.draft_probs import batch_draft_probs, checked_draft_probs
from specmesh.drafter.proposers.draft_model import DraftModelProposer
from specmesh.engine.frames import tensor_to_buffer
from specmesh.protocol.messages import SamplingParams


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_HERE = Path(__file__).resolve().parent
chi2_pvalue = _load("_chi2", _HERE.parent / "kernels" / "_chi2.py").chi2_pvalue
_sampled = _load("_sampled_decoding", _HERE / "test_sampled_decoding.py")
exact_marginals, de_bruijn, seeded_reference = (_sampled.exact_marginals, _sampled.de_bruijn,
                                                _sampled.seeded_reference)

VOCAB = 96
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 11, 12, 11, 12, 11], [40, 41, 42], [3] * 9]


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(seed=1, dtype=torch.float64, vocab_size=VOCAB)


def _cluster(model, cfg, draft_model, *, num_blocks=128, **kw):
    proposer = DraftModelProposer(dtype="float64", loaded=draft_model, num_blocks=num_blocks,
                                  block_size=4)
    return InProcessCluster(model, cfg, num_speculative_tokens=kw.pop("k", 4),
                            num_kv_blocks=kw.pop("num_kv_blocks", 256), block_size=4,
                            proposer=proposer, draft_method="draft_model", **kw)


@pytest.mark.parametrize("rule", ["auto", "block"])
def test_self_drafted_samples_pass_when_their_rows_reach_the_rule(tiny, rule, one_thread):
    """q == p: ``u * q < p`` always holds (float32 rounding aside), where one-hot drafts would
    pass with ``p(x)`` (about 0.1 here, measured with ``draft_probs=False``)."""
    _, model, cfg = tiny
    c = _cluster(model, cfg, model, verify_rule=rule, drafter_options={"seed": 0})
    res = c.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=1.0))
    assert all(len(r.token_ids) == 12 for r in res)
    st = c.verifier.stats
    assert st.num_draft_tokens > 0
    assert st.num_accepted_tokens > 0.97 * st.num_draft_tokens, st


def test_seeded_output_with_a_model_drafter_is_the_coupled_reference(tiny, one_thread):
    hf, model, cfg = tiny
    _, other, _ = tiny_llama(seed=2, dtype=torch.float64, vocab_size=VOCAB)
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=42),
              SamplingParams(max_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=7),
              SamplingParams(max_tokens=16, temperature=1.3, min_p=0.05, seed=2**64 - 1),
              SamplingParams(max_tokens=16, temperature=1.0, seed=-5)]
    refs = [seeded_reference(hf, p, sp) for p, sp in zip(PROMPTS, params)]
    for name, draft in (("self", model), ("other", other)):
        c = _cluster(model, cfg, draft)
        assert [r.token_ids for r in c.generate(PROMPTS, params)] == refs, name
        st = c.verifier.stats
        assert st.num_draft_tokens > 0, name
        if name == "self":  # the drafter samples with the target's noise: it drafts its token
            assert st.num_accepted_tokens >= 0.95 * st.num_draft_tokens, (name, st)


SMALL_VOCAB = 6
DIST_PROMPT = de_bruijn(SMALL_VOCAB, 2)
DIST_SAMPLING = SamplingParams(max_tokens=4, temperature=0.9, top_k=4, ignore_eos=True)
NUM_SAMPLES = 400
BATCH = 200


@pytest.mark.slow  # thousands of sampled requests end to end; seeded runs above stay fast
@pytest.mark.parametrize("rule", ["auto", "block"])
def test_sampled_distribution_with_draft_probs_matches_the_target(rule, one_thread):
    hf, model, cfg = tiny_llama(seed=5, dtype=torch.float64, vocab_size=SMALL_VOCAB,
                                init_std=0.15)
    _, draft, _ = tiny_llama(seed=6, dtype=torch.float64, vocab_size=SMALL_VOCAB, init_std=0.15)
    exact = exact_marginals(hf, DIST_PROMPT, DIST_SAMPLING, (2, 3))
    c = _cluster(model, cfg, draft, k=3, num_blocks=4096, num_kv_blocks=4096, window=3,
                 max_num_seqs=BATCH, max_queue_len=BATCH, adaptive_drafts=False,
                 verify_rule=rule, drafter_options={"seed": 1})
    c.verifier.verify_step.generator().manual_seed(13)
    c.prefill._generator(torch.device("cpu")).manual_seed(29)
    seen = []
    real_add = c.verifier.lifecycle.add_tail

    def spy(peer, msg):  # the rows travel on the wire
        seen.append(msg.draft_probs is not None or not msg.draft_token_ids)
        return real_add(peer, msg)

    c.verifier.lifecycle.add_tail = spy  # type: ignore[method-assign]
    samples: list[list[int]] = []
    while len(samples) < NUM_SAMPLES:
        res = c.generate([DIST_PROMPT] * BATCH, DIST_SAMPLING)
        assert all(r.finish_reason == "length" for r in res)
        samples += [r.token_ids for r in res]
    st = c.verifier.stats
    assert st.num_draft_tokens >= NUM_SAMPLES
    assert 0.2 * st.num_draft_tokens < st.num_accepted_tokens < st.num_draft_tokens
    assert seen and all(seen)
    for pos in (2, 3):
        counts = [0] * SMALL_VOCAB
        for s in samples:
            counts[s[pos]] += 1
        p = chi2_pvalue(counts, exact[pos].tolist())
        assert p > 1e-3, (rule, pos, counts, exact[pos].tolist())


# -- checks of the rows on the verifier ---------------------------------------------------------


def test_rows_that_are_not_draft_distributions_are_refused():
    good = torch.tensor([[0.25, 0.75, 0.0], [1.0, 0.0, 0.0]])
    assert torch.equal(checked_draft_probs(tensor_to_buffer(good), [1, 0], 3), good)
    bad = {
        "shape": (good[:1], [1, 0], 3),
        "vocab": (good, [1, 0], 4),
        "negative": (torch.tensor([[1.5, -0.5, 0.0], [1.0, 0.0, 0.0]]), [0, 0], 3),
        "nan": (torch.tensor([[float("nan"), 1.0, 0.0], [1.0, 0.0, 0.0]]), [1, 0], 3),
        "sum": (torch.tensor([[0.5, 0.4, 0.0], [1.0, 0.0, 0.0]]), [1, 0], 3),
        "zero-at-draft": (good, [2, 0], 3),
        "dtype": (good.to(torch.int32), [1, 0], 3),
    }
    for name, (rows, drafts, vocab) in bad.items():
        with pytest.raises(ValueError):
            checked_draft_probs(tensor_to_buffer(rows), drafts, vocab)
        assert name


def test_drafts_without_rows_get_one_hot_rows_in_a_mixed_batch():
    row = torch.tensor([0.5, 0.5, 0.0])
    out = batch_draft_probs([1, 2, 0], [row, None, row], 3)
    assert torch.equal(out, torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [0.5, 0.5, 0.0]]))
    assert batch_draft_probs([1, 2], [None, None], 3) is None


def test_a_peer_sending_bad_rows_only_loses_its_drafts(tiny):
    """Rows that are not distributions quarantine the request's drafter; the request still
    finishes (as plain decode) and the verifier keeps running."""
    _, model, cfg = tiny
    c = _cluster(model, cfg, model, k=4)
    real_send = c.drafter.send

    def corrupt(peer, msg):
        if getattr(msg, "draft_probs", None) is not None:
            rows = torch.full(tuple(msg.draft_probs.shape), -1.0)
            msg = type(msg)(request_id=msg.request_id, base_committed_len=msg.base_committed_len,
                            start_pos=msg.start_pos, draft_token_ids=msg.draft_token_ids,
                            draft_probs=tensor_to_buffer(rows))
        return real_send(peer, msg)

    c.drafter.send = corrupt  # type: ignore[method-assign]
    res = c.generate(PROMPTS[:2], SamplingParams(max_tokens=12, temperature=1.0))
    assert all(len(r.token_ids) == 12 and r.finish_reason == "length" for r in res)
    assert c.verifier.stats.num_protocol_errors > 0
