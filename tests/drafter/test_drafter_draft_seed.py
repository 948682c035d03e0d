"""The drafter worker and DraftSync.draft_seed (protocol 21): a seed that fits is adopted by an
EAGLE proposer and the drafts sent are those of a drafter without it; a malformed one (more
than 16 entries, lengths that differ, ids out of range, NaN, wrong shapes, a proposer that
raises) is ignored with a stat, and the request drafts on as without it (no DraftNeedSync)."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from specmesh.drafter.config import DrafterConfig
from specmesh.drafter.eagle.head import EagleHead, EagleHeadConfig
from specmesh.drafter.proposers.eagle import EagleProposer
from specmesh.drafter.worker import DrafterWorker
from specmesh.engine.frames import buffer_to_tensor, tensor_to_buffer
from specmesh.protocol.messages import (
    Buffer,
    DraftNeedSync,
    DraftSync,
    DraftTailStream,
    SamplingParams,
)
from specmesh.protocol.transport import InProcHub

V, D = 40, 32
PROMPT = [3, 7, 1, 9, 4]
FIRST = 11


def _head():
    torch.manual_seed(3)
    cfg = EagleHeadConfig(hidden_size=D, num_heads=4, num_kv_heads=2, head_dim=8,
                          intermediate_size=48, vocab_size=V, draft_vocab_size=30)
    head = EagleHead(cfg)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    emb = torch.randn(V, D)
    head.set_target_weights(emb, emb.clone(), torch.randperm(V)[:30])
    return head.eval()


HEAD = _head()
ROW = torch.randn(1, D, generator=torch.Generator().manual_seed(4))


def _good_seed():
    return EagleProposer(head_module=HEAD).make_prefill_seed("r", PROMPT + [FIRST], ROW, 4)


def _run(seed, proposer=None):
    """Drafts a worker sends for one request synced with ``seed``; (drafts, worker, need
    syncs)."""
    hub = InProcHub()
    v = hub.mailbox("verifier-0")
    p = proposer or EagleProposer(head_module=HEAD)
    d = DrafterWorker(DrafterConfig(method="eagle", window=4, max_segment=4),
                      hub.mailbox("drafter-0"), p)
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=PROMPT,
                                  committed_token_ids=[FIRST], sampling=SamplingParams(),
                                  seed_state=tensor_to_buffer(ROW), draft_seed=seed))
    for _ in range(8):
        d.step()
    msgs = [e.msg for e in v.drain()]
    drafts = [t for m in msgs if isinstance(m, DraftTailStream) for t in m.draft_token_ids]
    return drafts, d, [m for m in msgs if isinstance(m, DraftNeedSync)]


def test_a_seed_is_adopted_and_the_drafts_are_unchanged():
    plain, d0, _ = _run(None)
    got, d, need = _run(_good_seed())
    assert got == plain and len(got) == 4 and not need
    assert d.stats.num_draft_seeds_adopted == 1 and d.stats.num_draft_seeds_refused == 0
    assert d.proposer.num_prefill_seeds_adopted == 1
    assert d.proposer.num_draft_forwards == d0.proposer.num_draft_forwards - 1


def _bad(which):
    seed = _good_seed()
    replace = msgspec.structs.replace
    h = buffer_to_tensor(seed.draft_hidden).clone()
    h[0, 0] = math.nan
    return {
        "17 entries": replace(seed, topk_ids=list(range(17)), topk_probs=[0.01] * 17),
        "lengths": replace(seed, topk_probs=seed.topk_probs[:2]),
        "negative id": replace(seed, topk_ids=[-3, *seed.topk_ids[1:]]),
        "nan prob": replace(seed, topk_probs=[math.nan] * len(seed.topk_ids)),
        "nan hidden": replace(seed, draft_hidden=tensor_to_buffer(h)),
        "hidden shape": replace(seed, draft_hidden=Buffer("float32", (2, D), bytes(8 * D))),
        "kv 4-d": replace(seed, draft_kv=Buffer("float32", (1, 2, 2, 8), bytes(128))),
        "position": replace(seed, position=0),
        "token": replace(seed, token_id=FIRST + 1),
    }[which]


@pytest.mark.parametrize("which", ["17 entries", "lengths", "negative id", "nan prob",
                                   "nan hidden", "hidden shape", "kv 4-d", "position", "token"])
def test_a_malformed_seed_is_ignored_and_the_request_drafts_on(which):
    plain, d0, _ = _run(None)
    got, d, need = _run(_bad(which))
    assert got == plain and not need
    assert d.stats.num_draft_seeds_refused == 1 and d.stats.num_draft_seeds_adopted == 0
    assert d.stats.num_protocol_errors == 0
    assert d.proposer.num_draft_forwards == d0.proposer.num_draft_forwards


def test_a_proposer_that_raises_on_adopt_does_not_stop_the_worker():
    class Broken(EagleProposer):
        def adopt_prefill_seed(self, request_id, context_token_ids, seed):
            raise RuntimeError("boom")

    plain, _, _ = _run(None)
    got, d, need = _run(_good_seed(), Broken(head_module=HEAD))
    assert got == plain and not need and d.stats.num_draft_seeds_refused == 1
