"""DraftBranches end to end (in-process workers, float64 tiny model): a drafter whose path is
always wrong but whose branches hold the right next token gets drafts accepted only through
branches the verifier took at its commits, and the output stays plain greedy decoding."""

import random

import pytest
import torch
from helpers.models import hf_greedy, tiny_llama
from helpers.proposers import BranchOracleProposer

from specmesh.cluster.inprocess import InProcessCluster
from specmesh.protocol.messages import SamplingParams

MAX_TOKENS = 16
VOCAB = 96


@pytest.fixture(scope="module")
def tiny():
    hf, model, cfg = tiny_llama(seed=3, dtype=torch.float64, vocab_size=VOCAB)
    rng = random.Random(2)
    prompts = [[5, 6, 7, 8], [rng.randrange(VOCAB) for _ in range(19)], [1, 2, 3, 1, 2]]
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return model, cfg, prompts, refs


@pytest.mark.parametrize("num_branches", [0, 4])
def test_branch_drafts_are_exact_and_only_branches_are_accepted(tiny, num_branches):
    model, cfg, prompts, refs = tiny
    c = InProcessCluster(model, cfg, num_speculative_tokens=3, num_kv_blocks=128, block_size=4,
                         proposer=BranchOracleProposer(prompts, refs, VOCAB),
                         drafter_options={"num_branches": num_branches})
    res = c.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [r.token_ids for r in res] == refs
    st = c.verifier.stats
    if num_branches:
        assert st.num_branch_candidates > 0 and st.num_branch_hits > 0
        assert c.drafter.stats.num_branch_hits > 0
        assert st.num_accepted_tokens > 0  # the path's own drafts are all wrong
    else:
        assert st.num_branch_candidates == st.num_branch_hits == 0
        assert st.num_accepted_tokens == 0
    assert c.verifier.block_manager.num_free_blocks == 128


def test_branches_arriving_during_the_forward_serve_its_commit_and_nothing_is_lost(tiny):
    """Branches reach a served verifier while its forward runs: they are applied before that
    forward's commit (so the commit takes them); any other message received then waits for
    the next ingest, in order, and is not lost."""
    from specmesh.protocol.messages import DraftBranches, GenerateRequest, TokenStream

    model, cfg, prompts, refs = tiny
    c = InProcessCluster(model, cfg, num_speculative_tokens=3, num_kv_blocks=128, block_size=4)
    sp = SamplingParams(max_tokens=MAX_TOKENS)
    got: dict[str, list[int]] = {}

    def collect():
        for env in c.client.drain():
            if isinstance(env.msg, TokenStream):
                got.setdefault(env.msg.request_id, []).extend(env.msg.token_ids)

    c.client.send("verifier-0", GenerateRequest(request_id="a", prompt_token_ids=prompts[0],
                                              sampling=sp))
    while "a" not in c.verifier.requests or not c.verifier.requests["a"].committed_len:
        c.prefill.step()
        c.verifier.step()
        collect()
    req = c.verifier.requests["a"]
    n = req.committed_len
    run = c.verifier.verify_step.run

    def run_and_receive(plan, **kw):  # what lands in the mailbox while the forward runs
        out = run(plan, **kw)
        if req.committed_len == n:
            c.drafter.mailbox.send("verifier-0", DraftBranches(
                request_id="a", base_committed_len=n, position=n, token_ids=[refs[0][n]],
                continuations=[refs[0][n + 1:n + 3]]))
            c.client.send("verifier-0", GenerateRequest(
                request_id="b", prompt_token_ids=prompts[2], sampling=sp))
        return out

    c.verifier.verify_step.run = run_and_receive
    c.verifier.step()
    assert req.committed_len == n + 1 and c.verifier.stats.num_branch_hits == 1
    assert req.tail.usable(8) == refs[0][n + 1:n + 3]  # the branch is the tail at once
    assert "b" not in c.verifier.requests  # deferred, not lost
    c.verifier.verify_step.run = run
    for _ in range(200):
        c.drafter.step()
        c.prefill.step()
        c.verifier.step()
        collect()
        if c.verifier.stats.num_finished == 2:
            break
    assert got["a"] == refs[0] and got["b"] == refs[2]
