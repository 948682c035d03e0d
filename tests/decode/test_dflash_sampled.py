"""The DFlash drafter (drafter/proposers/dflash.py) in-process on tiny float64 models, its
context fed by the verifier's hidden states of layers 1 and 0 (seed state "hidden:1,0"):
greedy output equals plain decode and seeded output equals the plain coupled reference, with
drafts made and accepted; unseeded sampled output keeps the target's distribution at output
positions 2 and 3 (chi-square against the exact marginals), drafts accepted and their rows
sent, for the rejection and the block rule."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers.models import tiny_llama

from specmesh.cluster.inprocess import InProcessCluster
from specmesh.drafter.dflash_config import DFlashConfig
from specmesh.drafter.dflash_model import DFlashDraft
from specmesh.drafter.proposers.dflash import DFlashProposer
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


def _dflash(model, cfg, seed: int, block: int = 4, std: float = 0.2) -> DFlashProposer:
    """A random 1-layer DFlash draft on the target's embedding and LM head, reading the
    outputs of the target's layers 1 and 0."""
    dcfg = DFlashConfig.for_target(cfg, num_layers=1, block=block, feature_layers=(1, 0))
    torch.manual_seed(seed)
    draft = DFlashDraft(dcfg).double()
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    draft.set_target_weights(model.model.embed_tokens.weight, model.lm_head.weight)
    return DFlashProposer(draft.eval().requires_grad_(False))


def _cluster(model, cfg, proposer, *, k=4, **kw):
    return InProcessCluster(model, cfg, num_speculative_tokens=k,
                            num_kv_blocks=kw.pop("num_kv_blocks", 256), block_size=4,
                            proposer=proposer, draft_method="dflash", **kw)


def test_greedy_output_with_dflash_is_plain_decode(one_thread):
    hf, model, cfg = tiny_llama(seed=1, dtype=torch.float64, vocab_size=8, init_std=0.15)
    params = SamplingParams(max_tokens=24)
    prompts = [[p % 8 for p in x] for x in PROMPTS]
    plain = InProcessCluster(model, cfg, num_speculative_tokens=0, num_kv_blocks=256,
                             block_size=4)
    want = [r.token_ids for r in plain.generate(prompts, params)]
    proposer = _dflash(model, cfg, 2)
    c = _cluster(model, cfg, proposer)
    assert [r.token_ids for r in c.generate(prompts, params)] == want
    st = c.verifier.stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0
    # the drafts came from context KVs the verifier's rows filled: the prompt's last row (in
    # PrefillDone, then DraftSync), then one per committed token (VerifyCommit), every byte
    # the verifier sent written into a context KV (float64 rows of layers 1 and 0)
    assert proposer.stats.num_context_rows > len(want)
    assert st.seed_state_bytes == len(want) * 2 * cfg.hidden_size * 8
    assert st.seed_state_sent_bytes == proposer.stats.num_context_rows * 2 * cfg.hidden_size * 8


def test_seeded_output_with_dflash_is_the_coupled_reference(one_thread):
    hf, model, cfg = tiny_llama(seed=1, dtype=torch.float64, vocab_size=96)
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=42),
              SamplingParams(max_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=7),
              SamplingParams(max_tokens=16, temperature=1.3, min_p=0.05, seed=2**64 - 1),
              SamplingParams(max_tokens=16, temperature=1.0, seed=-5)]
    refs = [seeded_reference(hf, p, sp) for p, sp in zip(PROMPTS, params)]
    c = _cluster(model, cfg, _dflash(model, cfg, 3))
    assert [r.token_ids for r in c.generate(PROMPTS, params)] == refs
    assert c.verifier.stats.num_draft_tokens > 0


SMALL_VOCAB = 6
DIST_PROMPT = de_bruijn(SMALL_VOCAB, 2)
DIST_SAMPLING = SamplingParams(max_tokens=4, temperature=0.9, top_k=4, ignore_eos=True)
NUM_SAMPLES = 400
BATCH = 200


@pytest.mark.slow  # thousands of sampled requests end to end
@pytest.mark.parametrize("rule", ["auto", "block"])
def test_sampled_distribution_with_dflash_matches_the_target(rule, one_thread):
    hf, model, cfg = tiny_llama(seed=5, dtype=torch.float64, vocab_size=SMALL_VOCAB,
                                init_std=0.15)
    exact = exact_marginals(hf, DIST_PROMPT, DIST_SAMPLING, (2, 3))
    c = _cluster(model, cfg, _dflash(model, cfg, 6, block=3), k=3, num_kv_blocks=4096,
                 window=3, max_num_seqs=BATCH, max_queue_len=BATCH, adaptive_drafts=False,
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
    assert 0.1 * st.num_draft_tokens < st.num_accepted_tokens < st.num_draft_tokens
    assert seen and all(seen)
    for pos in (2, 3):
        counts = [0] * SMALL_VOCAB
        for s in samples:
            counts[s[pos]] += 1
        p = chi2_pvalue(counts, exact[pos].tolist())
        assert p > 1e-3, (rule, pos, counts, exact[pos].tolist())
