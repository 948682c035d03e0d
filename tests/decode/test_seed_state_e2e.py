"""Draft seed state (EAGLE family, docs/architecture.md, 'Messages') through the three in-process
workers with
real encoded messages: the target hidden states a "hidden" proposer receives (PrefillDone ->
DraftSync, then every VerifyCommit, and the re-sync after DraftNeedSync) equal the target's own
hidden states at those positions, computed by a separate plain forward over the final prompt +
output; the output is plain decoding's. An n-gram cluster ships no seed state and asks no
forward for hidden states."""

from __future__ import annotations

import pytest
import torch

from specmesh.cluster.inprocess import InProcessCluster
from specmesh.decode.seed_state import SeedWindow
from specmesh.drafter.proposer import Proposer
from specmesh.drafter.registry import register_proposer, seed_state_kinds, seed_state_of
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.runner import ModelRunner
from helpers.models import tiny_llama
from specmesh.protocol.messages import DraftSync, PrefillDone, SamplingParams, VerifyCommit

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [1, 2, 3], [11, 12, 11, 12, 11, 12, 11], [40]]
MAX_TOKENS = 20


@register_proposer
class RecordingProposer(Proposer):
    """Drafts the known plain-decoding continuation (so drafts are accepted) and records every
    seed state it is given. ``refuse_at`` (request id -> n): the n-th seed state of that request
    is refused with ValueError, once, which makes the drafter ask for a DraftSync (a re-sync
    with the rows the verifier holds)."""

    name = "recording-hidden-test"
    seed_state = "hidden"

    def __init__(self, prompts=(), refs=(), refuse_at=None, hidden_size=None):
        self.seqs = [list(p) + list(r) for p, r in zip(prompts, refs)]
        self.seen: list[tuple[str, int, torch.Tensor]] = []
        self.opens: list[tuple[str, int]] = []
        self.refuse_at = dict(refuse_at or {})
        self.count: dict[str, int] = {}
        self.seed_hidden_size = hidden_size

    def open(self, request_id, context_token_ids):
        self.opens.append((request_id, len(context_token_ids)))

    def propose(self, request_id, context_token_ids, num_tokens):
        n = len(context_token_ids)
        for seq in self.seqs:
            if seq[:n] == context_token_ids:
                return seq[n:n + num_tokens]
        return []

    def rollback(self, request_id, num_context_tokens):
        pass

    def close(self, request_id):
        pass

    def observe_seed_state(self, request_id, start_position, hidden):
        k = self.count[request_id] = self.count.get(request_id, 0) + 1
        if self.refuse_at.get(request_id) == k:
            del self.refuse_at[request_id]
            raise ValueError("refused once by the test")
        self.seen.append((request_id, start_position, hidden.clone()))


@pytest.fixture(scope="module")
def tiny():
    _, model, cfg = tiny_llama(seed=1, dtype=torch.float64, vocab_size=96)
    plain = InProcessCluster(model, cfg, num_speculative_tokens=0, num_kv_blocks=128,
                             block_size=4)
    refs = [r.token_ids for r in plain.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))]
    return model, cfg, refs


def _reference_hidden(model, cfg, tokens: list[int]) -> torch.Tensor:
    """Target hidden states [len(tokens), hidden] of one plain forward on a fresh KV cache."""
    runner = ModelRunner(model, cfg, KVCache(cfg, 64, 4, model.dtype, model.device))
    _, hidden = runner.prefill(tokens, list(range(64)), return_hidden=True)
    return hidden


def _tap(worker, kinds):
    """Record every message of ``kinds`` the worker handles."""
    seen, handle = [], worker.handle

    def spy(env):
        if isinstance(env.msg, kinds):
            seen.append(env.msg)
        handle(env)

    worker.handle = spy
    return seen


def test_registry_reports_seed_state_kinds():
    assert seed_state_of("ngram") == ""
    assert seed_state_of("no-such-method") == ""
    assert seed_state_of(RecordingProposer.name) == "hidden"
    kinds = seed_state_kinds()
    assert kinds[RecordingProposer.name] == "hidden" and "ngram" not in kinds


def test_hidden_states_reach_the_drafter_exactly(tiny):
    model, cfg, refs = tiny
    # request 1's third seed state is refused: the drafter asks for a re-sync, whose DraftSync
    # carries every row the verifier holds
    prop = RecordingProposer(PROMPTS, refs, refuse_at={"req-1": 3},
                             hidden_size=cfg.hidden_size)
    c = InProcessCluster(model, cfg, num_speculative_tokens=3, num_kv_blocks=128, block_size=4,
                         draft_method=RecordingProposer.name, proposer=prop,
                         adaptive_drafts=False)
    dones = _tap(c.verifier, PrefillDone)
    to_drafter = _tap(c.drafter, (DraftSync, VerifyCommit))
    res = c.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [r.token_ids for r in res] == [ref[:MAX_TOKENS] for ref in refs]
    assert c.verifier.stats.num_accepted_tokens > 0
    assert c.drafter.stats.num_need_sync == 1
    by_rid = {r.request_id: (p, r.token_ids) for p, r in zip(PROMPTS, res)}

    # every PrefillDone carried [1, hidden] in the model dtype
    assert len(dones) == len(PROMPTS)
    for d in dones:
        assert d.seed_state is not None and tuple(d.seed_state.shape) == (1, cfg.hidden_size)
        assert d.seed_state.dtype == "float64"
    # wire invariants: rows == committed tokens (commits), >= 1 rows (syncs)
    syncs = [m for m in to_drafter if isinstance(m, DraftSync)]
    commits = [m for m in to_drafter if isinstance(m, VerifyCommit)]
    assert len(syncs) == len(PROMPTS) + 1 and commits
    assert all(m.seed_state is not None and m.seed_state.shape[0] >= 1 for m in syncs)
    assert all(m.seed_state.shape[0] == len(m.committed_token_ids) for m in commits)
    assert max(m.seed_state.shape[0] for m in commits) > 1  # accepted drafts ride along
    assert sorted(m.request_id for m in syncs) == sorted([*by_rid, "req-1"])
    resync = [m for m in syncs if m.request_id == "req-1"][1]
    # every row since the prefill: positions p - 1 .. L - 2, one per committed token
    assert resync.seed_state.shape[0] == len(resync.committed_token_ids) > 1

    covered: dict[str, set[int]] = {rid: set() for rid in by_rid}
    for rid, start, hidden in prop.seen:
        prompt, out = by_rid[rid]
        ref = _reference_hidden(model, cfg, prompt + out)
        n = hidden.shape[0]
        assert hidden.dtype == torch.float64 and hidden.shape[1] == cfg.hidden_size
        assert 0 <= start and start + n <= len(prompt) + len(out) - 1
        torch.testing.assert_close(hidden, ref[start:start + n], rtol=1e-9, atol=1e-9)
        covered[rid] |= set(range(start, start + n))
    # the first seed state of each request is the prefill's (position p - 1); the states reach
    # every position up to the last commit that was sent (the finishing one is not)
    for rid, (prompt, out) in by_rid.items():
        first = next(s for r, s, _ in prop.seen if r == rid)
        assert first == len(prompt) - 1
        assert covered[rid] == set(range(len(prompt) - 1, max(covered[rid]) + 1))
        assert max(covered[rid]) >= len(prompt) + 1


def test_ngram_cluster_ships_no_seed_state_and_computes_none(tiny):
    model, cfg, refs = tiny
    c = InProcessCluster(model, cfg, num_speculative_tokens=3, num_kv_blocks=128, block_size=4)
    assert c.verifier.config.seed_state == ""
    dones = _tap(c.verifier, PrefillDone)
    to_drafter = _tap(c.drafter, (DraftSync, VerifyCommit))
    asked = []
    for runner in (c.verifier.verify_step.runner, c.prefill.runner):
        forward = runner.forward

        def spy(chunks, logits="all", return_hidden=False, _forward=forward, **kw):
            asked.append(return_hidden)
            return _forward(chunks, logits=logits, return_hidden=return_hidden, **kw)

        runner.forward = spy
    res = c.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [r.token_ids for r in res] == [ref[:MAX_TOKENS] for ref in refs]
    assert dones and all(d.seed_state is None for d in dones)
    assert any(isinstance(m, VerifyCommit) for m in to_drafter)
    assert all(m.seed_state is None for m in to_drafter)
    assert asked and not any(asked)
    assert all(r.seed_window is None for r in c.verifier.requests.values())


def test_seed_window_keeps_the_latest_contiguous_rows():
    w = SeedWindow(max_rows=4)
    assert w.rows_before(10) is None
    w.append(3, torch.arange(2.0)[:, None])  # positions 3, 4
    w.append(5, torch.arange(2.0, 5.0)[:, None])  # 5, 6, 7
    assert (w.start, w.end) == (4, 8)  # bounded: the last 4 rows
    start, rows = w.rows_before(9)  # context of 9 tokens: rows end at position 7
    assert start == 4 and rows[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert w.rows_before(10) is None  # not aligned with that context: nothing to ship
    w.append(12, torch.ones(1, 1))  # a gap: only the new rows are kept
    assert (w.start, w.end) == (12, 13)


def _reference_layers(model, cfg, tokens: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """Those decoder layers' outputs side by side [len(tokens), len(layers) * hidden], by
    forward hooks on a plain forward (independent of the engine's own capture)."""
    got: dict[int, torch.Tensor] = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda _m, _i, out, i=i: got.__setitem__(i, out.detach().clone())) for i in layers]
    try:
        _reference_hidden(model, cfg, tokens)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([got[i] for i in layers], dim=-1)


def test_fused_layer_states_reach_the_drafter_exactly(tiny):
    """A proposer whose instance asks for "hidden:1,0" (an EAGLE-3 fused head) gets, through
    PrefillDone -> DraftSync and every VerifyCommit, rows of 2 x hidden: the outputs of decoder
    layers 1 and 0 at those positions, equal to a separate plain forward's."""
    model, cfg, refs = tiny
    layers = (1, 0)
    prop = RecordingProposer(PROMPTS, refs, hidden_size=2 * cfg.hidden_size)
    prop.seed_state = "hidden:1,0"
    c = InProcessCluster(model, cfg, num_speculative_tokens=3, num_kv_blocks=128, block_size=4,
                         draft_method=RecordingProposer.name, proposer=prop,
                         adaptive_drafts=False)
    assert c.verifier.config.seed_state == "hidden:1,0"
    dones = _tap(c.verifier, PrefillDone)
    res = c.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [r.token_ids for r in res] == [ref[:MAX_TOKENS] for ref in refs]
    assert c.verifier.stats.num_accepted_tokens > 0
    assert all(tuple(d.seed_state.shape) == (1, 2 * cfg.hidden_size) for d in dones)
    by_rid = {r.request_id: (p, r.token_ids) for p, r in zip(PROMPTS, res)}
    assert {rid for rid, _, _ in prop.seen} == set(by_rid)
    multi = 0
    for rid, start, hidden in prop.seen:
        prompt, out = by_rid[rid]
        ref = _reference_layers(model, cfg, prompt + out, layers)
        n = hidden.shape[0]
        multi += n > 1
        torch.testing.assert_close(hidden, ref[start:start + n], rtol=1e-9, atol=1e-9)
    assert multi  # commits with accepted drafts carried several rows
