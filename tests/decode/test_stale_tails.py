"""Issue 9 scenario 8 through the in-process workers: a run-ahead segment drafted after a token
the verifier rejected is never verified, even when it starts at the new committed length, and
the output stays exactly plain greedy."""

import pytest
import torch

from specmesh.cluster.inprocess import VERIFIER, InProcessCluster
from specmesh.drafter.proposer import Proposer
from helpers.models import hf_greedy, tiny_llama
from specmesh.protocol.messages import GenerateRequest, SamplingParams, TokenStream

VOCAB = 96
GARBAGE = 94  # drafted only on a wrong prefix; in no reference continuation (asserted)
WRONG = 90  # the deliberate wrong draft, likewise


class CorruptingOracle(Proposer):
    """Drafts the true continuation up to and including one deliberately wrong token every
    ``every`` output positions (a segment then ends with it); on a context that contains a
    wrong token (the run-ahead path after it) drafts GARBAGE."""

    name = "corrupting-oracle-test"

    def __init__(self, prompts, refs, every=4):
        self.seqs = [(len(p), list(p) + list(r)) for p, r in zip(prompts, refs)]
        self.every = every

    def open(self, request_id, context_token_ids):
        pass

    def propose(self, request_id, context_token_ids, num_tokens):
        n = len(context_token_ids)
        for plen, seq in self.seqs:
            if seq[:n] == context_token_ids:
                out = []
                for pos in range(n, min(n + num_tokens, len(seq))):
                    if (pos - plen) % self.every == self.every - 1:
                        out.append(WRONG)
                        break
                    out.append(seq[pos])
                return out
        return [GARBAGE] * num_tokens

    def rollback(self, request_id, num_context_tokens):
        pass

    def close(self, request_id):
        pass


@pytest.fixture(scope="module")
def tiny():
    hf, model, cfg = tiny_llama(seed=1, dtype=torch.float64, vocab_size=VOCAB)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [1, 2, 3], [11, 12, 11, 12, 11, 12, 11]]
    refs = [hf_greedy(hf, p, 24) for p in prompts]
    assert not any(t in (GARBAGE, WRONG) for r in refs for t in r)
    return model, cfg, prompts, refs


def test_run_ahead_on_a_rejected_token_is_never_verified_and_output_is_exact(tiny):
    model, cfg, prompts, refs = tiny
    c = InProcessCluster(model, cfg, num_speculative_tokens=4, num_kv_blocks=128, block_size=4,
                         proposer=CorruptingOracle(prompts, refs), adaptive_drafts=False)
    verified: list[list[int]] = []
    run = c.verifier.verify_step.run

    def recording_run(plan, **kw):
        verified.extend(p.draft_token_ids for p in plan)
        return run(plan, **kw)

    c.verifier.verify_step.run = recording_run
    sp = SamplingParams(max_tokens=24)
    for i, p in enumerate(prompts):
        c.client.send(VERIFIER, GenerateRequest(request_id=f"r{i}", prompt_token_ids=p,
                                               sampling=sp))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    done: set[str] = set()
    for _ in range(400):
        if len(done) == len(prompts):
            break
        # the drafter runs ahead while the verifier verifies: it drafts again (on the path it
        # just sent) before it reads the commit that rejects the wrong token, and the verifier
        # steps again before the drafter's fresh segment arrives
        c.drafter.step()
        c.prefill.step()
        c.verifier.step()
        c.drafter.draft()
        c.verifier.step()
        for env in c.client.drain():
            if isinstance(env.msg, TokenStream):
                got[env.msg.request_id].extend(env.msg.token_ids)
                if env.msg.finished:
                    done.add(env.msg.request_id)
    assert done == set(got)
    assert [got[f"r{i}"] for i in range(len(prompts))] == refs
    drafts = [t for d in verified for t in d]
    assert WRONG in drafts  # the deliberate wrong drafts were verified (and rejected) ...
    assert GARBAGE not in drafts  # ... but nothing drafted after one of them ever was
    st = c.verifier.stats
    assert st.num_accepted_tokens > 0 and st.num_stale_tail_tokens > 0
