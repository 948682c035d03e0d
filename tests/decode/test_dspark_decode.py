"""The DSpark drafter (drafter/proposers/dspark.py) through the in-process cluster on tiny
float64 models, with an active Markov correction: greedy output equals plain decoding with
drafts accepted and the confidence head's predictions sent one per draft in [0, 1]
(DraftTailStream.draft_confidences, kept by the verifier as head confidences); seeded output
equals the plain coupled reference; unseeded sampled output keeps the target's distribution
at output positions 2 and 3 (chi-square against the exact marginals) with the rows sent, the
rows being the corrected distributions (not PARD's uncorrected ones)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers.models import tiny_llama

from specmesh.cluster.inprocess import InProcessCluster
from specmesh.drafter.draft_sampling import DraftSampling
from specmesh.drafter.dspark_markov import MarkovHead
from specmesh.drafter.head_confidences import split_confidences
from specmesh.drafter.proposers.dspark import DSparkProposer
from specmesh.drafter.proposers.pard import PardProposer
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

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 11, 12, 11, 12, 11], [40, 41, 42], [3] * 9]


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _head(cfg, std: float, seed: int = 0, kind: str = "gated") -> MarkovHead:
    torch.manual_seed(seed)
    head = MarkovHead(kind, cfg.hidden_size, 4, cfg.vocab_size)
    with torch.no_grad():
        head.to_vocab.weight.normal_(0, std)
    return head


def _cluster(model, cfg, proposer, *, k=4, num_kv_blocks=256, **kw):
    return InProcessCluster(model, cfg, num_speculative_tokens=k, num_kv_blocks=num_kv_blocks,
                            block_size=4, proposer=proposer, draft_method="dspark", **kw)


def _spy_tails(c) -> list:
    seen = []
    real_add = c.verifier.lifecycle.add_tail

    def spy(peer, msg):
        seen.append(msg)
        return real_add(peer, msg)

    c.verifier.lifecycle.add_tail = spy  # type: ignore[method-assign]
    return seen


def test_greedy_output_is_plain_decode_with_drafts_accepted_and_confidences_sent(one_thread):
    _, model, cfg = tiny_llama(seed=1, dtype=torch.float64, vocab_size=96)
    # the target itself as the backbone (its first draft is the target's token) and a small
    # Markov correction: drafts are accepted and the correction is on
    proposer = DSparkProposer(model, cfg, _head(cfg, 0.05, kind="rnn"), 95, 4, num_blocks=256,
                              block_size=4)
    plain = InProcessCluster(model, cfg, num_speculative_tokens=0, num_kv_blocks=256,
                             block_size=4)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    want = [r.token_ids for r in plain.generate(PROMPTS, params)]
    c = _cluster(model, cfg, proposer, goodput_drafts=False)
    seen = _spy_tails(c)
    assert [r.token_ids for r in c.generate(PROMPTS, params)] == want
    st = c.verifier.stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0
    segs = [m for m in seen if m.draft_token_ids]
    assert segs and all(len(m.draft_confidences) == len(m.draft_token_ids) for m in segs)
    assert all(0.0 <= x <= 1.0 for m in segs for x in m.draft_confidences)
    assert all(len(m.draft_token_probs) == len(m.draft_token_ids) for m in segs)
    assert proposer.stats.num_markov_steps > 0


def test_the_confidence_policy_budgets_with_the_head_and_stays_exact(one_thread):
    """``--speculative-policy confidence``: the budget scores DSpark's drafts with the head's
    confidences (kind ``head``), decides steps on a cost table, and the output is plain."""
    from specmesh.decode.cost_table import VerifyCostTable  # the verifier's profile table

    _, model, cfg = tiny_llama(seed=1, dtype=torch.float64, vocab_size=96)
    proposer = DSparkProposer(model, cfg, _head(cfg, 0.05), 95, 4, num_blocks=256,
                              block_size=4)
    plain = InProcessCluster(model, cfg, num_speculative_tokens=0, num_kv_blocks=256,
                             block_size=4)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    want = [r.token_ids for r in plain.generate(PROMPTS, params)]
    c = _cluster(model, cfg, proposer, speculative_policy="confidence")
    sched = c.verifier.scheduler
    sizes = (1, 2, 4, 8)
    sched.draft_budget.table = VerifyCostTable(
        sizes, sizes, {(b, w): 1.0 + 0.1 * (w - 1) for b in sizes for w in sizes})
    kinds: list[str] = []
    real_score = sched.draft_confidences.score

    def spy(*args, **kwargs):
        out = real_score(*args, **kwargs)
        kinds.extend(out.kinds)
        return out

    sched.draft_confidences.score = spy  # type: ignore[method-assign]
    assert [r.token_ids for r in c.generate(PROMPTS, params)] == want
    assert "head" in kinds and sched.confidence_budget.stats.num_steps > 0
    assert c.verifier.stats.num_accepted_tokens > 0


def test_seeded_output_with_dspark_is_the_coupled_reference(one_thread):
    hf, model, cfg = tiny_llama(seed=1, dtype=torch.float64, vocab_size=96)
    _, draft, dcfg = tiny_llama(seed=2, dtype=torch.float64, vocab_size=96, num_layers=1)
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=42),
              SamplingParams(max_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=7),
              SamplingParams(max_tokens=16, temperature=1.3, min_p=0.05, seed=2**64 - 1),
              SamplingParams(max_tokens=16, temperature=1.0, seed=-5)]
    refs = [seeded_reference(hf, p, sp) for p, sp in zip(PROMPTS, params)]
    proposer = DSparkProposer(draft, dcfg, _head(dcfg, 1.0), 95, 4, num_blocks=256,
                              block_size=4)
    c = _cluster(model, cfg, proposer)
    assert [r.token_ids for r in c.generate(PROMPTS, params)] == refs
    assert c.verifier.stats.num_draft_tokens > 0


SMALL_VOCAB = 6
DIST_PROMPT = de_bruijn(SMALL_VOCAB, 2)
DIST_SAMPLING = SamplingParams(max_tokens=4, temperature=0.9, top_k=4, ignore_eos=True)
NUM_SAMPLES = 400
BATCH = 200


def test_sampled_rows_are_the_corrected_distributions():
    _, draft, dcfg = tiny_llama(seed=6, dtype=torch.float64, vocab_size=SMALL_VOCAB,
                                init_std=0.15, num_layers=1)
    how = DraftSampling(DIST_SAMPLING, 0, torch.Generator().manual_seed(0))
    d = DSparkProposer(draft, dcfg, _head(dcfg, 1.0), SMALL_VOCAB - 1, 3, num_blocks=64,
                       block_size=4)
    p = PardProposer(draft, dcfg, SMALL_VOCAB - 1, 3, num_blocks=64, block_size=4)
    d_rows = split_confidences(d.propose_sampled("r", DIST_PROMPT, 3, how)[1])[0]
    p_rows = p.propose_sampled("r", DIST_PROMPT, 3, how)[1]
    assert any(not torch.allclose(a, b, atol=1e-3) for a, b in zip(d_rows, p_rows))


@pytest.mark.slow  # thousands of sampled requests end to end
@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_sampled_distribution_with_dspark_matches_the_target(kind, one_thread):
    hf, model, cfg = tiny_llama(seed=5, dtype=torch.float64, vocab_size=SMALL_VOCAB,
                                init_std=0.15)
    _, draft, dcfg = tiny_llama(seed=6, dtype=torch.float64, vocab_size=SMALL_VOCAB,
                                init_std=0.15, num_layers=1)
    exact = exact_marginals(hf, DIST_PROMPT, DIST_SAMPLING, (2, 3))
    proposer = DSparkProposer(draft, dcfg, _head(dcfg, 1.0, kind=kind), SMALL_VOCAB - 1, 3,
                              num_blocks=4096, block_size=4)
    c = _cluster(model, cfg, proposer, k=3, num_kv_blocks=4096, window=3,
                 max_num_seqs=BATCH, max_queue_len=BATCH, adaptive_drafts=False,
                 drafter_options={"seed": 1})
    c.verifier.verify_step.generator().manual_seed(13)
    c.prefill._generator(torch.device("cpu")).manual_seed(29)
    seen = _spy_tails(c)
    samples: list[list[int]] = []
    while len(samples) < NUM_SAMPLES:
        res = c.generate([DIST_PROMPT] * BATCH, DIST_SAMPLING)
        assert all(r.finish_reason == "length" for r in res)
        samples += [r.token_ids for r in res]
    st = c.verifier.stats
    assert st.num_draft_tokens >= NUM_SAMPLES
    assert 0.1 * st.num_draft_tokens < st.num_accepted_tokens < st.num_draft_tokens
    assert seen and all(m.draft_probs is not None for m in seen if m.draft_token_ids)
    for pos in (2, 3):
        counts = [0] * SMALL_VOCAB
        for s in samples:
            counts[s[pos]] += 1
        p = chi2_pvalue(counts, exact[pos].tolist())
        assert p > 1e-3, (kind, pos, counts, exact[pos].tolist())
