"""Commits held from a paused drafter (decode/draft_link.py, DraftLink.notify_commit): while the
speculation gate has drafting off the verifier sends its drafter no VerifyCommit after the
one that tells it so; when drafting
resumes one VerifyCommit carries every token committed meanwhile with their target hidden
states (equal to a plain forward's), or, past the seed window, a DraftSync re-opens the
request; a request that ends while held has its commits sent before DraftClose. Through the
three in-process workers with real encoded messages; the output is plain decoding's and drafts
are accepted after the resume."""

from __future__ import annotations

import pytest
import torch

from specmesh.cluster.inprocess import InProcessCluster
from specmesh.decode.config import MAX_SEED_ROWS
from specmesh.drafter.proposer import Proposer
from specmesh.drafter.registry import register_proposer
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.runner import ModelRunner
from helpers.models import tiny_llama
from specmesh.protocol.messages import DraftClose, DraftSync, SamplingParams, VerifyCommit

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7]


@register_proposer
class KnownContinuation(Proposer):
    """Drafts the known plain-decoding continuation and records the seed rows it is given."""

    name = "held-commits-test"
    seed_state = "hidden"

    def __init__(self, seq=(), hidden_size=None):
        self.seq = list(seq)
        self.seen: list[tuple[int, torch.Tensor]] = []
        self.seed_hidden_size = hidden_size

    def open(self, request_id, context_token_ids):
        pass

    def propose(self, request_id, context_token_ids, num_tokens):
        n = len(context_token_ids)
        return self.seq[n:n + num_tokens] if self.seq[:n] == context_token_ids else []

    def rollback(self, request_id, num_context_tokens):
        pass

    def close(self, request_id):
        pass

    def observe_seed_state(self, request_id, start_position, hidden):
        self.seen.append((start_position, hidden.clone()))


class ScriptedGate:
    """The speculation gate's interface, off for the verify steps in ``off_steps``."""

    def __init__(self, off_steps: range) -> None:
        self.off_steps, self.step, self.on = off_steps, 0, True

    def begin(self, batch: int) -> bool:
        self.on = self.step not in self.off_steps
        self.step += 1
        return self.on

    def end(self, batch: int, num_tokens: int, seconds: float) -> None:
        pass

    def snapshot(self) -> dict:
        return {"drafting": self.on}


@pytest.fixture(scope="module")
def tiny():
    _, model, cfg = tiny_llama(seed=1, dtype=torch.float64, vocab_size=96)
    plain = InProcessCluster(model, cfg, num_speculative_tokens=0, num_kv_blocks=128,
                             block_size=4)
    (ref,) = plain.generate([PROMPT], SamplingParams(max_tokens=120))
    return model, cfg, list(ref.token_ids)


def _run(tiny, off_steps: range, max_tokens: int):
    """Generate PROMPT with the gate off for ``off_steps``; the messages the drafter handled."""
    model, cfg, ref = tiny
    prop = KnownContinuation(PROMPT + ref, hidden_size=cfg.hidden_size)
    c = InProcessCluster(model, cfg, num_speculative_tokens=3, num_kv_blocks=128, block_size=4,
                         draft_method=KnownContinuation.name, proposer=prop,
                         adaptive_drafts=False)
    c.verifier.scheduler.speculation_gate = ScriptedGate(off_steps)
    seen, handle = [], c.drafter.handle

    def spy(env):
        if isinstance(env.msg, (DraftSync, VerifyCommit, DraftClose)):
            seen.append(env.msg)
        handle(env)

    c.drafter.handle = spy
    (res,) = c.generate([PROMPT], SamplingParams(max_tokens=max_tokens))
    assert list(res.token_ids) == ref[:max_tokens]  # the gate changes no output
    while c.drafter.step():  # what the verifier sent at the end
        pass
    return c, prop, seen


def _reference_hidden(model, cfg, tokens: list[int]) -> torch.Tensor:
    runner = ModelRunner(model, cfg, KVCache(cfg, 64, 4, model.dtype, model.device))
    _, hidden = runner.prefill(tokens, list(range(64)), return_hidden=True)
    return hidden


def test_commits_while_paused_are_held_and_sent_as_one_with_their_rows(tiny):
    model, cfg, ref = tiny
    c, prop, seen = _run(tiny, range(2, 12), max_tokens=60)
    commits = [m for m in seen if isinstance(m, VerifyCommit)]
    # steps 2 .. 11 commit one token each (no drafts verified): step 2's commit tells the
    # drafter it is paused, 3 .. 11 send nothing, and the first commit after them carries
    # the nine held tokens and the resumed step's (a step commits at most kappa + 1 = 4)
    flush = next(m for m in commits if len(m.committed_token_ids) >= 10)
    i = commits.index(flush)
    assert [m.drafting_paused for m in commits[:i]].count(True) == 1
    assert commits[i - 1].drafting_paused and len(commits[i - 1].committed_token_ids) == 1
    assert all(not m.drafting_paused for m in commits[i:])
    assert commits[i - 1].pre_commit_len + len(commits[i - 1].committed_token_ids) \
        == flush.pre_commit_len  # contiguous: nothing was lost
    assert flush.seed_state.shape[0] == len(flush.committed_token_ids)
    assert c.verifier.stats.num_held_commit_flushes == 1
    # the flushed rows are the target's hidden states at those positions
    full = _reference_hidden(model, cfg, PROMPT + ref[:60])
    start = len(PROMPT) + flush.pre_commit_len - 1
    got = next(h for s, h in prop.seen if s == start)
    torch.testing.assert_close(got, full[start:start + got.shape[0]], rtol=1e-9, atol=1e-9)
    assert c.verifier.stats.num_accepted_tokens > 0  # drafting resumed after the flush
    assert not any(isinstance(m, DraftSync) for m in seen[1:])  # no re-open was needed


def test_a_hold_longer_than_the_seed_window_reopens_with_a_draft_sync(tiny):
    c, _, seen = _run(tiny, range(2, MAX_SEED_ROWS + 12), max_tokens=110)
    syncs = [m for m in seen if isinstance(m, DraftSync)]
    assert len(syncs) == 2  # the open, and the re-open when drafting resumed
    assert len(syncs[1].committed_token_ids) > MAX_SEED_ROWS
    assert syncs[1].seed_state.shape[0] == MAX_SEED_ROWS
    assert c.verifier.stats.num_held_commit_flushes == 1
    assert c.verifier.stats.num_accepted_tokens > 0


def test_a_request_that_ends_while_held_sends_its_commits_before_the_close(tiny):
    _, _, seen = _run(tiny, range(2, 1000), max_tokens=30)
    commits = [m for m in seen if isinstance(m, VerifyCommit)]
    assert isinstance(seen[-1], DraftClose) and isinstance(seen[-2], VerifyCommit)
    last = seen[-2]
    assert last.pre_commit_len + len(last.committed_token_ids) == 30  # the whole output
    # steps 0 and 1, step 2's telling the drafter it is paused, then the one held from 3 on
    assert len(commits) <= 4 and commits[-2].drafting_paused
