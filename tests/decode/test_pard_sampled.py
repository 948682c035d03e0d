"""Sampled requests with the PARD drafter (drafter/proposers/pard.py) on tiny float64 models,
in-process: seeded output equals the plain coupled reference (drafts made); unseeded sampled
output keeps the target's distribution at output positions 2 and 3 (chi-square against the
exact marginals), drafts accepted and their rows sent, for the rejection and the block rule.
PARD's rows are each block position's own distribution (independent of the drafts before it),
which is what the rules need."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers.models import tiny_llama

from specmesh.cluster.inprocess import InProcessCluster
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


def _cluster(model, cfg, draft, draft_cfg, mask_id, *, k=4, num_blocks=256, **kw):
    proposer = PardProposer(draft, draft_cfg, mask_id, k, num_blocks=num_blocks, block_size=4)
    return InProcessCluster(model, cfg, num_speculative_tokens=k,
                            num_kv_blocks=kw.pop("num_kv_blocks", 256), block_size=4,
                            proposer=proposer, draft_method="pard", **kw)


def test_seeded_output_with_pard_is_the_coupled_reference(one_thread):
    hf, model, cfg = tiny_llama(seed=1, dtype=torch.float64, vocab_size=96)
    _, draft, dcfg = tiny_llama(seed=2, dtype=torch.float64, vocab_size=96, num_layers=1)
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=42),
              SamplingParams(max_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=7),
              SamplingParams(max_tokens=16, temperature=1.3, min_p=0.05, seed=2**64 - 1),
              SamplingParams(max_tokens=16, temperature=1.0, seed=-5)]
    refs = [seeded_reference(hf, p, sp) for p, sp in zip(PROMPTS, params)]
    c = _cluster(model, cfg, draft, dcfg, 95)
    assert [r.token_ids for r in c.generate(PROMPTS, params)] == refs
    assert c.verifier.stats.num_draft_tokens > 0


SMALL_VOCAB = 6
DIST_PROMPT = de_bruijn(SMALL_VOCAB, 2)
DIST_SAMPLING = SamplingParams(max_tokens=4, temperature=0.9, top_k=4, ignore_eos=True)
NUM_SAMPLES = 400
BATCH = 200


@pytest.mark.slow  # thousands of sampled requests end to end
@pytest.mark.parametrize("rule", ["auto", "block"])
def test_sampled_distribution_with_pard_matches_the_target(rule, one_thread):
    hf, model, cfg = tiny_llama(seed=5, dtype=torch.float64, vocab_size=SMALL_VOCAB,
                                init_std=0.15)
    _, draft, dcfg = tiny_llama(seed=6, dtype=torch.float64, vocab_size=SMALL_VOCAB,
                                init_std=0.15, num_layers=1)
    exact = exact_marginals(hf, DIST_PROMPT, DIST_SAMPLING, (2, 3))
    c = _cluster(model, cfg, draft, dcfg, SMALL_VOCAB - 1, k=3, num_blocks=4096,
                 num_kv_blocks=4096, window=3, max_num_seqs=BATCH, max_queue_len=BATCH,
                 adaptive_drafts=False, verify_rule=rule, drafter_options={"seed": 1})
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
    assert 0.1 * st.num_draft_tokens < st.num_accepted_tokens < st.num_draft_tokens
    assert seen and all(seen)
    for pos in (2, 3):
        counts = [0] * SMALL_VOCAB
        for s in samples:
            counts[s[pos]] += 1
        p = chi2_pvalue(counts, exact[pos].tolist())
        assert p > 1e-3, (rule, pos, counts, exact[pos].tolist())
