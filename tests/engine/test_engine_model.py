"""Ragged batched forward (prefill / decode / verify, mixed) equals transformers' full forward."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine.kv_cache import KVCache
from specmesh.engine.runner import ModelRunner, SeqChunk
from helpers.models import tiny_llama

BLOCK = 4
LLAMA3 = {
    "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
}
VARIANTS = {
    "llama": {},
    "qwen2": {"qwen2": True},
    "llama3_rope": {"rope_parameters": LLAMA3},
    "tied_mha": {"tie_word_embeddings": True, "num_kv_heads": 4},
}
TOL = {torch.float64: 1e-9, torch.float32: 1e-4}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request):
    return request.param


@pytest.fixture(scope="module", params=[torch.float64, torch.float32], ids=["fp64", "fp32"])
def models(request, variant):
    hf, ours, config = tiny_llama(seed=1, dtype=request.param, **VARIANTS[variant])
    return hf, ours, config, request.param


class Ref:
    """Transformers' full-sequence logits for a token sequence (memoised)."""

    def __init__(self, hf):
        self.hf, self.memo = hf, {}

    def __call__(self, seq: list[int]) -> torch.Tensor:
        key = tuple(seq)
        if key not in self.memo:
            with torch.no_grad():
                self.memo[key] = self.hf(torch.tensor([seq])).logits[0]
        return self.memo[key]


def _seq(seed: int, n: int, vocab: int = 128) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _runner(ours, config, dtype, num_blocks=64):
    return ModelRunner(ours, config, KVCache(config, num_blocks, BLOCK, dtype))


def _check(chunks, outs, seqs, ref, tol):
    for chunk, out, seq in zip(chunks, outs, seqs):
        want = ref(seq[: chunk.end_pos])[chunk.start_pos : chunk.end_pos]
        assert out.shape == want.shape
        assert (out.double() - want.double()).abs().max().item() < tol


def test_prefill_decode_verify_mixed_batches(models):
    hf, ours, config, dtype = models
    ref, tol, r = Ref(hf), TOL[dtype], _runner(ours, config, dtype)
    seqs = [_seq(i, 30) for i in range(4)]
    # scattered, non-monotonic block ids; every request crosses block boundaries
    tables = [[9, 3, 17, 4, 22, 30, 31, 40], [0, 12, 5, 33, 34, 35, 36, 37],
              [8, 1, 2, 19, 20, 21, 41, 42], [50, 51, 52, 53, 54, 55, 56, 57]]

    def step(specs):  # specs: (request, start, q_len)
        chunks = [SeqChunk(seqs[i][s : s + n], s, tables[i]) for i, s, n in specs]
        _check(chunks, r.forward(chunks), [seqs[i] for i, _, _ in specs], ref, tol)

    step([(0, 0, 7), (1, 0, 3), (2, 0, 10)])  # ragged prefill of three prompts
    step([(0, 7, 1)])  # one-token decode on a non-empty cache
    step([(1, 3, 5)])  # 5-token verify chunk on a non-empty cache
    step([(0, 8, 1), (1, 8, 5), (2, 10, 6), (3, 0, 9)])  # decode + verify + prefill chunk + prompt
    step([(3, 9, 1), (0, 9, 5), (2, 16, 1)])


def test_verify_overwrites_rejected_kv(models):
    """After a verify whose tail is rejected, the next step rewrites those positions."""
    hf, ours, config, dtype = models
    ref, tol, r = Ref(hf), TOL[dtype], _runner(ours, config, dtype)
    table = list(range(10))
    prompt, drafts, truth = _seq(5, 9), _seq(6, 5), _seq(7, 8)
    r.forward([SeqChunk(prompt, 0, table)])
    r.forward([SeqChunk(drafts, 9, table)])  # pretend only drafts[:2] are accepted
    seq = prompt + drafts[:2] + truth
    chunk = SeqChunk(truth, 11, table)
    _check([chunk], r.forward([chunk]), [seq], ref, tol)


def test_last_logits_and_hidden(models):
    hf, ours, config, dtype = models
    tol, r = TOL[dtype], _runner(ours, config, dtype)
    a, b = _seq(1, 6), _seq(2, 11)
    chunks = [SeqChunk(a, 0, [0, 1]), SeqChunk(b, 0, [2, 3, 4])]
    logits, hidden = r.forward(chunks, logits="last", return_hidden=True)
    assert [x.shape for x in logits] == [(1, config.vocab_size)] * 2
    assert [h.shape for h in hidden] == [(6, config.hidden_size), (11, config.hidden_size)]
    with torch.no_grad():
        out = hf(torch.tensor([b]), output_hidden_states=True)
    assert (logits[1][0] - out.logits[0, -1]).abs().max().item() < tol
    assert (hidden[1] - out.hidden_states[-1][0]).abs().max().item() < tol


def test_chunked_prefill_matches_one_shot(models):
    hf, ours, config, dtype = models
    ref, tol = Ref(hf), TOL[dtype]
    prompt = _seq(3, 23)
    want = ref(prompt)[-1:]
    for chunk_size in (None, 5, 8, 1):
        r = _runner(ours, config, dtype, num_blocks=8)
        got = r.prefill(prompt, [7, 6, 5, 4, 3, 2], chunk_size=chunk_size)
        assert got.shape == (1, config.vocab_size)
        assert (got - want).abs().max().item() < tol


def test_verify_equals_sequential_decode_fp64():
    """Bottom-right causal alignment: a 5-token verify equals five one-token decodes."""
    _, ours, config = tiny_llama(seed=2)
    seq = _seq(9, 17)
    r1, r2 = _runner(ours, config, torch.float64), _runner(ours, config, torch.float64)
    r1.prefill(seq[:12], [0, 1, 2, 3, 4])
    r2.prefill(seq[:12], [4, 3, 2, 1, 0])
    verify = r1.forward([SeqChunk(seq[12:], 12, [0, 1, 2, 3, 4])])[0]
    steps = [r2.forward([SeqChunk([t], 12 + i, [4, 3, 2, 1, 0])])[0][0] for i, t in
             enumerate(seq[12:])]
    assert (verify - torch.stack(steps)).abs().max().item() < 1e-12


def test_greedy_generation_equals_hf_generate_fp64():
    hf, ours, config = tiny_llama(seed=3)
    prompt = _seq(11, 8)
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    r = _runner(ours, config, torch.float64)
    table = list(range(10))
    logits = r.prefill(prompt, table)
    out: list[int] = []
    while len(out) < 24:
        out.append(int(logits[-1].argmax()))
        logits = r.forward([SeqChunk(out[-1:], len(prompt) + len(out) - 1, table)])[0]
    assert out == want
    assert len(set(out)) > 6  # the random model is not degenerate


def test_bfloat16_runs_and_returns_float32_logits():
    hf, ours, config = tiny_llama(seed=1, dtype=torch.float64)
    ours_bf16 = ours.to(torch.bfloat16)
    r = _runner(ours_bf16, config, torch.bfloat16)
    seq = _seq(4, 12)
    prefill = r.forward([SeqChunk(seq[:8], 0, [0, 1, 2])])[0]
    verify = r.forward([SeqChunk(seq[8:], 8, [0, 1, 2])])[0]
    got = torch.cat([prefill, verify])
    assert got.dtype == torch.float32
    want = Ref(hf)(seq)
    assert (got.double() - want).abs().max().item() < 0.1 * want.abs().max().item()
