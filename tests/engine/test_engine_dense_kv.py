"""The offline-generation KV (engine/dense_kv.py) computes what transformers computes, and the
self-distillation generator built on it (drafter/eagle/data.py) reproduces plain greedy
decoding, the target's own hidden states, and the target's greedy labels for sampled
continuations."""

from __future__ import annotations

import pytest
import torch

from specmesh.drafter.eagle.data import generate_samples
from specmesh.engine.dense_kv import DenseBatch, DenseKVCache
from helpers.models import hf_greedy, tiny_llama


@pytest.fixture(scope="module")
def models():
    return tiny_llama(seed=3, dtype=torch.float64, hidden_size=48, num_heads=6, num_kv_heads=2,
                      num_layers=3)


def _hf_logits(hf, seq):  # noqa: ANN001, ANN202
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0]


def _forward(model, cache, slots, chunks, starts):  # noqa: ANN001, ANN202
    batch = DenseBatch(slots, starts, [len(c) for c in chunks])
    cache.check(batch)
    flat = [t for c in chunks for t in c]
    pos = [p for c, s in zip(chunks, starts) for p in range(s, s + len(c))]
    with torch.inference_mode():
        return model(torch.tensor(flat), torch.tensor(pos), batch, cache).split(
            [len(c) for c in chunks])


def test_prefill_then_mixed_steps_equal_transformers(models):
    hf, model, config = models
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in (7, 12, 3)]
    cache = DenseKVCache(config, num_slots=5, max_len=20, dtype=torch.float64)
    slots = [4, 0, 2]  # out of order, with unused slots between
    # prompts (slot 2's in two chunks: the second attends to the first, bottom-right causal)
    out = _forward(model, cache, slots[:2], [seqs[0][:5], seqs[1][:9]], [0, 0])
    out2 = _forward(model, cache, [slots[2]], [seqs[2][:2]], [0])
    ref = [_hf_logits(hf, s) for s in seqs]
    assert torch.allclose(out[0], ref[0][:5], atol=1e-9)
    assert torch.allclose(out[1], ref[1][:9], atol=1e-9)
    assert torch.allclose(out2[0], ref[2][:2], atol=1e-9)
    # a chunk at a nonzero start, then batched one-token steps of all three slots
    out = _forward(model, cache, [slots[1]], [seqs[1][9:11]], [9])
    assert torch.allclose(out[0], ref[1][9:11], atol=1e-9)
    out = _forward(model, cache, slots, [[seqs[0][5]], [seqs[1][11]], [seqs[2][2]]], [5, 11, 2])
    for o, r, p in zip(out, ref, (5, 11, 2)):
        assert torch.allclose(o[0], r[p], atol=1e-9)
    out = _forward(model, cache, [slots[0], slots[2]], [[seqs[0][6]], [seqs[2][2]]], [6, 2])
    assert torch.allclose(out[0][0], ref[0][6], atol=1e-9)
    assert torch.allclose(out[1][0], ref[2][2], atol=1e-9)  # rewritten in place


def test_bad_batches_are_refused(models):
    _, _, config = models
    cache = DenseKVCache(config, num_slots=2, max_len=8)
    with pytest.raises(ValueError, match="share a slot"):
        cache.check(DenseBatch([0, 0], [0, 0], [1, 1]))
    with pytest.raises(ValueError, match="slot 2"):
        cache.check(DenseBatch([2], [0], [1]))
    with pytest.raises(ValueError, match="does not fit"):
        cache.check(DenseBatch([1], [6], [3]))
    with pytest.raises(ValueError):
        DenseKVCache(config, num_slots=0, max_len=8)


def test_greedy_samples_equal_plain_decoding_and_features(models):
    hf, model, config = models
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist()
               for n in (4, 9, 6, 11, 5)]
    # batch of 2 slots for 5 prompts: slots are reused as sequences finish (hidden_states[i +
    # 1] is layer i's raw output except for the last layer, which transformers norms)
    samples = generate_samples(model, config, prompts, [f"p{i}" for i in range(5)],
                               max_new_tokens=10, batch_size=2, feature_dtype=torch.float64,
                               hidden_layers=(0, 1))
    assert [s.name for s in samples] == [f"p{i}" for i in range(5)]
    for s, p in zip(samples, prompts):
        ref = hf_greedy(hf, p, 10, config.eos_token_ids)
        assert s.token_ids == p + ref and s.target_ids is None and s.label_ids == s.token_ids
        with torch.no_grad():
            hs = hf(torch.tensor([s.token_ids]), output_hidden_states=True).hidden_states
        want = torch.cat([hs[1][0], hs[2][0]], dim=-1)[len(p) - 1:len(s.token_ids) - 1]
        assert s.features.shape == want.shape
        assert torch.allclose(s.features, want, atol=1e-8)


def test_sampled_samples_label_the_targets_greedy_tokens(models):
    hf, model, config = models
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in (5, 8)]
    kwargs = dict(max_new_tokens=12, batch_size=4, feature_dtype=torch.float64)
    greedy = generate_samples(model, config, prompts, ["a", "b"], **kwargs)
    sampled = generate_samples(model, config, prompts, ["a", "b"], temperatures=[1.5, 1.5],
                               seed=7, **kwargs)
    again = generate_samples(model, config, prompts, ["a", "b"], temperatures=[1.5, 1.5],
                             seed=7, **kwargs)
    assert [s.token_ids for s in sampled] == [s.token_ids for s in again]  # seeded
    assert [s.token_ids for s in sampled] != [s.token_ids for s in greedy]
    for s, p in zip(sampled, prompts):
        logits = _hf_logits(hf, s.token_ids)
        want = logits[len(p) - 1:len(s.token_ids) - 1].argmax(-1).tolist()
        assert s.target_ids == want
        assert s.label_ids == p + want
        assert s.label_ids != s.token_ids  # some sampled token differs from the argmax
    with pytest.raises(ValueError, match="temperatures"):
        generate_samples(model, config, prompts, ["a", "b"], temperatures=[1.0], **kwargs)
