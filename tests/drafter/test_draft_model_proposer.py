"""The standalone draft-model proposer (drafter/proposers/draft_model.py) on tiny random float64
Llamas: drafts equal the draft model's greedy continuation, speculative greedy output equals
plain decoding whatever the draft model, KV is reused, rolled back and freed, and the
vocabulary check refuses a tokenizer that maps a token to another id."""

from __future__ import annotations

import logging
import random

import pytest
import torch

import specmesh.drafter.proposers  # noqa: F401
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.drafter.registry import get_proposer
from specmesh.drafter.proposers.draft_model import DraftModelProposer, build_draft_model_proposer
from specmesh.drafter.tokenizer_match import check_same_vocabulary
from helpers.models import hf_greedy, tiny_llama
from specmesh.protocol.messages import SamplingParams

VOCAB = 96
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def target():
    hf, model, cfg = tiny_llama(seed=1, dtype=torch.float64, vocab_size=VOCAB)
    rng = random.Random(0)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [1, 2, 3], [rng.randrange(VOCAB) for _ in range(29)],
               [40]]
    return hf, model, cfg, prompts


@pytest.fixture(scope="module")
def small_draft():
    """A different, smaller random Llama with the target's vocabulary size."""
    _, model, _ = tiny_llama(seed=7, dtype=torch.float64, vocab_size=VOCAB, hidden_size=32,
                             num_layers=1, num_heads=2, num_kv_heads=1)
    return model


def _proposer(model, **kw):
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    return DraftModelProposer(dtype="float64", loaded=model, **kw)


def _plain(model, cfg, prompts):
    c = InProcessCluster(model, cfg, num_speculative_tokens=0, num_kv_blocks=128, block_size=4)
    return [r.token_ids for r in c.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]


def test_registered():
    assert get_proposer("draft_model") is DraftModelProposer


def test_same_model_drafts_the_target_greedy_continuation(target):
    hf, model, _, prompts = target
    p = _proposer(model)
    for i, prompt in enumerate(prompts):
        p.open(f"r{i}", prompt)
        assert p.propose(f"r{i}", prompt, 6) == hf_greedy(hf, prompt, 6)
        assert p.num_cached_tokens(f"r{i}") == len(prompt) + 5  # every draft but the last


def test_same_model_through_the_cluster_is_exact_and_accepts_nearly_all(target):
    _, model, cfg, prompts = target
    ref = _plain(model, cfg, prompts)
    c = InProcessCluster(model, cfg, num_speculative_tokens=4, num_kv_blocks=128, block_size=4,
                         draft_method="draft_model", proposer=_proposer(model))
    res = c.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [r.token_ids for r in res] == ref
    st = c.verifier.stats
    assert st.num_accepted_tokens > 0
    assert st.num_accepted_tokens >= 0.95 * st.num_draft_tokens
    assert st.mean_accept_len > 3


def test_different_draft_model_output_equals_plain_decoding(target, small_draft):
    _, model, cfg, prompts = target
    ref = _plain(model, cfg, prompts)
    p = _proposer(small_draft, target_vocab_size=cfg.vocab_size)
    c = InProcessCluster(model, cfg, num_speculative_tokens=3, num_kv_blocks=128, block_size=4,
                         draft_method="draft_model", proposer=p)
    assert [r.token_ids for r in c.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))] == ref
    assert c.verifier.stats.num_draft_tokens > 0
    assert p.stats.num_tokens_drafted > 0


def test_agreeing_continuation_feeds_one_token(target):
    _, model, _, prompts = target
    ctx = prompts[2]
    p, fresh = _proposer(model), _proposer(model)
    d = p.propose("r", ctx, 4)
    before = p.stats.num_tokens_computed
    d2 = p.propose("r", ctx + d, 3)
    assert p.stats.num_tokens_computed - before == 3  # last draft + 2 new drafts' inputs
    assert d2 == fresh.propose("x", ctx + d, 3)
    assert p.stats.num_recomputes == 0


def test_rollback_and_context_divergence_match_a_fresh_proposer(target, small_draft):
    _, model, _, prompts = target
    ctx = prompts[2]
    for m in (model, small_draft):
        p = _proposer(m)
        p.open("r", ctx)
        d = p.propose("r", ctx, 5)
        # the verifier rejected the 3rd draft and committed another token there
        other = (d[2] + 1) % VOCAB
        p.rollback("r", len(ctx) + 2)
        assert p.num_cached_tokens("r") == len(ctx) + 2
        new_ctx = ctx + d[:2] + [other]
        assert p.propose("r", new_ctx, 4) == _proposer(m).propose("x", new_ctx, 4)
        # no rollback: the context changed inside the cached prefix
        changed = ctx[:10] + [(ctx[10] + 3) % VOCAB] + ctx[11:]
        assert p.propose("r", changed, 4) == _proposer(m).propose("x", changed, 4)
        assert p.stats.num_recomputes == 1
        # a shorter context (a prefix of what the KV holds) and a rollback past the end
        assert p.propose("r", changed[:7], 2) == _proposer(m).propose("x", changed[:7], 2)
        p.rollback("r", 10_000)
        assert p.propose("r", ctx, 5) == d


def test_blocks_freed_on_rollback_and_close(target):
    _, model, _, prompts = target
    p = _proposer(model, num_blocks=32, block_size=4)
    bm = p.block_manager
    p.open("a", prompts[2])
    p.open("b", prompts[0])
    p.propose("a", prompts[2], 6)  # 29 + 5 positions: 9 blocks
    p.propose("b", prompts[0], 6)  # 8 + 5: 4 blocks
    assert bm.num_free_blocks == 32 - 9 - 4
    p.rollback("a", 8)
    assert bm.num_free_blocks == 32 - 2 - 4
    p.close("a")
    p.close("b")
    p.close("never-opened")
    assert bm.num_free_blocks == 32
    p.open("c", prompts[1])
    p.propose("c", prompts[1], 3)
    p.open("c", prompts[1])  # re-open drops the old KV
    assert bm.num_free_blocks == 32


def test_out_of_blocks_gives_no_drafts_and_logs_once(target, caplog):
    _, model, _, prompts = target
    p = _proposer(model, num_blocks=3, block_size=4)  # 12 positions
    long = prompts[2]
    with caplog.at_level(logging.WARNING, logger="specmesh.drafter.draft_lm_kv"):
        assert p.propose("a", long, 4) == []
        assert p.propose("a", long, 4) == []
    assert len([r for r in caplog.records if "KV full" in r.getMessage()]) == 1
    assert p.stats.num_out_of_blocks == 2
    assert p.block_manager.num_free_blocks == 3
    # room for fewer drafts than asked: as many as fit
    assert len(p.propose("b", prompts[0], 8)) == 12 - 8 + 1
    # another request fits no more: none for it, the first keeps its KV
    assert p.propose("c", prompts[1], 2) == []
    assert p.num_cached_tokens("b") == 12
    p.close("b")
    assert len(p.propose("c", prompts[1], 2)) == 2


def test_positions_capped_by_max_model_len(target):
    _, model, _, prompts = target
    p = _proposer(model, max_model_len=10)
    assert len(p.propose("a", prompts[0], 5)) == 3  # context 8: positions 8, 9 hold drafts
    assert p.propose("b", prompts[2], 5) == []  # 29 > 10: nothing, no exception


def test_drafts_stay_inside_the_target_vocabulary(target):
    _, model, _, prompts = target
    p = _proposer(model, target_vocab_size=None)
    p.draft_vocab_limit = 10  # as if the target had 10 embedding rows
    assert all(t < 10 for t in p.propose("a", prompts[2], 6))
    assert p.propose("b", [VOCAB + 3], 2) == []  # an id past the draft model's rows
    assert p.stats.num_out_of_vocab == 1


# -- vocabulary check -------------------------------------------------------------------------

def _tokenizer(words):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


WORDS = ["[UNK]", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]


def test_matching_tokenizers_pass():
    check_same_vocabulary(_tokenizer(WORDS), _tokenizer(list(WORDS)), "big", "small")


def test_vocabulary_size_mismatch_is_refused():
    with pytest.raises(ValueError, match=r"'small'.*97 tokens.*'big'.*96.*'extra'"):
        check_same_vocabulary(_tokenizer(WORDS), _tokenizer(WORDS + ["extra"]), "big", "small")


def test_different_token_ids_are_refused_naming_the_token():
    swapped = list(WORDS)
    swapped[10], swapped[11] = swapped[11], swapped[10]
    with pytest.raises(ValueError, match=r"'small'.*'big'.*id 10 is 'w7' in 'big' and 'w8'"):
        check_same_vocabulary(_tokenizer(WORDS), _tokenizer(swapped), "big", "small")


def test_missing_tokenizer_is_refused():
    with pytest.raises(ValueError, match="no tokenizer"):
        check_same_vocabulary(_tokenizer(WORDS), None, "big", "small")


def test_proposer_checks_the_vocabulary_at_construction(target, small_draft):
    _, _, cfg, _ = target
    renamed = WORDS[:-1] + ["other"]
    with pytest.raises(ValueError, match="'other'"):
        _proposer(small_draft, target_tokenizer=_tokenizer(WORDS),
                  draft_tokenizer=_tokenizer(renamed))
    _proposer(small_draft, target_tokenizer=_tokenizer(WORDS), draft_tokenizer=_tokenizer(WORDS))
    with pytest.raises(ValueError, match="embedding rows"):
        _proposer(small_draft, target_vocab_size=cfg.vocab_size + 8)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """The small draft model saved as a Hugging Face dir with a WordLevel tokenizer."""
    hf, _, _ = tiny_llama(seed=7, dtype=torch.float32, vocab_size=VOCAB, hidden_size=32,
                          num_layers=1, num_heads=2, num_kv_heads=1)
    path = tmp_path_factory.mktemp("draft-model")
    hf.save_pretrained(path)
    _tokenizer(WORDS).save_pretrained(path)
    return str(path)


def test_build_from_a_path(target, draft_dir):
    _, model, cfg, prompts = target
    p = build_draft_model_proposer(draft_dir, cfg, _tokenizer(WORDS), "float64",
                                   target_name="tiny-target", num_blocks=16, block_size=4)
    assert p.model.dtype == torch.float64 and p.draft_name.startswith("draft-model")
    assert len(p.propose("a", prompts[0], 3)) == 3
    with pytest.raises(ValueError, match=r"tiny-target.*'x'"):
        build_draft_model_proposer(draft_dir, cfg, _tokenizer(["x"] + WORDS[1:]), "float64",
                                   target_name="tiny-target")


def test_drafter_host_builds_the_draft_model_method(draft_dir):
    from specmesh.cluster.config import ClusterConfig
    from specmesh.cluster.hosts.drafter import build_proposer

    cfg = ClusterConfig.create(model=draft_dir, dtype="float32", device="cpu",
                               draft_method="draft_model",
                               drafter_method_kwargs={"model": draft_dir, "kv_cache_mb": 1})
    p = build_proposer(cfg)
    assert isinstance(p, DraftModelProposer) and p.model.dtype == torch.float32
    from specmesh.drafter.proposers.ngram import NgramProposer

    assert isinstance(build_proposer(ClusterConfig.create(model=draft_dir)), NgramProposer)
    with pytest.raises(ValueError, match="method_kwargs"):
        build_proposer(ClusterConfig.create(model=draft_dir, draft_method="draft_model"))
