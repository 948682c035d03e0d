"""The EAGLE draft seed across P/D through the in-process workers (real encoded messages):
the prefill runs the head's first step (PrefillDone.draft_seed), the verifier keeps it and
sends it with the first DraftSync, the drafter adopts it; greedy output equals plain decode
with drafts accepted and a head entry fewer per request. A malformed seed (refused by the
verifier, or well formed but refused by the drafter) and a seeder that raises cost only the
seed: every request completes with the same output."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from specmesh.cluster.inprocess import InProcessCluster
from specmesh.cluster.prefill_seeder import seeder_of
from specmesh.drafter.eagle.checkpoint import load_head, target_embeddings, target_identity
from specmesh.drafter.eagle.data import chat_token_ids
from specmesh.drafter.proposers.eagle import EagleProposer
from specmesh.engine.frames import buffer_to_tensor, tensor_to_buffer
from specmesh.engine.loader import load_model
from specmesh.protocol.messages import SamplingParams

SP = SamplingParams(max_tokens=16)


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tiny_eagle_head):
    head_dir, messages = tiny_eagle_head
    lm = load_model(tiny_model_dir, "float64")
    embed, lm_head = target_embeddings(tiny_model_dir)
    head = load_head(head_dir, embed, lm_head, target_identity(lm.name, lm.config, embed),
                     dtype=torch.float64)
    prompts = chat_token_ids(lm.tokenizer, [{"messages": m} for m in messages[:4]])
    plain = InProcessCluster(lm.model, lm.config, num_speculative_tokens=0,
                             eos_token_ids=lm.config.eos_token_ids).generate(prompts, SP)
    return lm, head, prompts, [o.token_ids for o in plain]


class _Counting(EagleProposer):
    """Counts the module-0 head entries (rows) its catch-ups and chains run."""

    rows = 0

    def _extend_many(self, live, work):
        self.rows += sum(len(w[1]) for w in work.values())
        return super()._extend_many(live, work)


def _cluster(lm, head, seeder=True, **kw):
    return InProcessCluster(lm.model, lm.config, num_speculative_tokens=3,
                            eos_token_ids=lm.config.eos_token_ids, draft_method="eagle",
                            proposer=_Counting(head_module=head),
                            prefill_seeder=EagleProposer(head_module=head) if seeder else None,
                            **kw)


def _run(cluster, prompts):
    out = cluster.generate(prompts, SP)
    return [o.token_ids for o in out], sum(o.spec.num_accepted_tokens for o in out)


def test_seeded_output_equals_plain_with_the_seeds_adopted(setup):
    lm, head, prompts, plain = setup
    seeded = _cluster(lm, head)
    got, accepted = _run(seeded, prompts)
    assert got == plain and accepted > 0
    n = len(prompts)
    assert seeded.prefill.stats.num_draft_seeds == n
    v = seeded.verifier.stats
    assert v.num_draft_seeds == v.num_draft_seeds_sent == n and v.num_bad_draft_seeds == 0
    assert v.draft_seed_bytes > 0
    assert v.seed_state_bytes > v.draft_seed_bytes  # both seeds: the per-request column
    counters = seeded.verifier.profile.counters  # what the bench's per-method table reads
    assert counters["draft_seed_bytes"] == v.draft_seed_bytes
    assert counters["seed_state_bytes"] == v.seed_state_bytes
    d = seeded.drafter
    assert d.stats.num_draft_seeds_adopted == n and d.stats.num_draft_seeds_refused == 0
    assert d.proposer.draft_stats()["num_prefill_seeds_adopted"] == n
    # the same run without seeds: the same drafts
    unseeded = _cluster(lm, head, seeder=False)
    assert _run(unseeded, prompts) == (got, accepted)
    assert unseeded.verifier.stats.draft_seed_bytes == 0
    # one head entry (row) fewer per request; here the verifier steps before the drafter's
    # first call (it waits for no tail), so the entry of the commit that step made rides in the
    # same forward as the seed's would: rows fewer, not forwards (tests/drafter/
    # test_eagle_prefill_seed.py counts the forward a drafter that drafts at once saves)
    assert seeded.drafter.proposer.rows == unseeded.drafter.proposer.rows - n
    # --prefill-draft-seed off
    off = _cluster(lm, head, prefill_draft_seed=False)
    assert not off.prefill.draft_seeders


def _tampered(seeder, how):
    def make(rid, ctx, hidden):
        seed = seeder(rid, ctx, hidden)
        if how == "raise":
            raise RuntimeError("seeder broke")
        if how == "ids":  # malformed on the wire: the verifier drops it
            return msgspec.structs.replace(seed, topk_ids=[-1] * 20,
                                           topk_probs=[math.nan] * 20)
        h = buffer_to_tensor(seed.draft_hidden).clone()  # well formed, not finite: the drafter
        h[0, 0] = math.nan
        return msgspec.structs.replace(seed, draft_hidden=tensor_to_buffer(h))
    return make


@pytest.mark.parametrize("how", ["ids", "nan", "raise"])
def test_a_bad_seed_costs_only_the_seed(setup, how):
    lm, head, prompts, plain = setup
    c = _cluster(lm, head)
    c.prefill.draft_seeders = {"eagle": _tampered(seeder_of(EagleProposer(head_module=head)),
                                                  how)}
    got, accepted = _run(c, prompts)
    assert got == plain and accepted > 0
    n = len(prompts)
    v, d = c.verifier.stats, c.drafter.stats
    assert d.num_draft_seeds_adopted == 0
    if how == "ids":
        assert v.num_bad_draft_seeds == n and v.num_draft_seeds_sent == 0
    elif how == "nan":
        assert v.num_draft_seeds_sent == n and d.num_draft_seeds_refused == n
    else:
        assert c.prefill.stats.num_draft_seed_errors == n and v.num_draft_seeds == 0
