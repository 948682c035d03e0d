"""Test-only drafting methods: an oracle that proposes the known greedy continuation, a
garbage one that proposes random tokens, and a null one that drafts nothing (for tests of
what a class declares)."""

import random

from specmesh.drafter.proposer import Proposer


class NullProposer(Proposer):
    """Drafts nothing and keeps no state: subclass it to test declarations and registration."""

    def open(self, request_id, context_token_ids):
        pass

    def propose(self, request_id, context_token_ids, num_tokens):
        return []

    def rollback(self, request_id, num_context_tokens):
        pass

    def close(self, request_id):
        pass


class OracleProposer(Proposer):
    """Proposes the true greedy continuation (known in advance)."""

    name = "oracle-test"

    def __init__(self, prompts, refs):
        self.seqs = [list(p) + list(r) for p, r in zip(prompts, refs)]

    def open(self, request_id, context_token_ids):
        pass

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


class GarbageProposer(OracleProposer):
    """Proposes random tokens (never trustworthy)."""

    name = "garbage-test"

    def __init__(self, vocab_size, seed=0):
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size

    def propose(self, request_id, context_token_ids, num_tokens):
        return [self.rng.randrange(self.vocab_size) for _ in range(num_tokens)]


class TreeOracleProposer(OracleProposer):
    """Drafts trees whose branch 0 is wrong (each token of the known continuation + 1) and
    whose branch 1 is the known continuation: every accepted draft comes through a side
    branch. Its chains (the drafter's run-ahead on branch 0) are the wrong tokens too."""

    name = "tree-oracle-test"
    draft_shape = "tree"

    def __init__(self, prompts, refs, vocab_size):
        super().__init__(prompts, refs)
        self.vocab_size = vocab_size

    def _wrong(self, toks):
        return [(t + 1) % self.vocab_size for t in toks]

    def propose(self, request_id, context_token_ids, num_tokens):
        right = super().propose(request_id, context_token_ids, num_tokens)
        return self._wrong(right)

    def propose_tree(self, request_id, context_token_ids, num_tokens):
        right = super().propose(request_id, context_token_ids, num_tokens)
        if not right:
            return [], []
        k = len(right)
        tokens = self._wrong(right) + right
        parents = list(range(-1, k - 1)) + [-1] + list(range(k, 2 * k - 1))
        return tokens, parents


class BranchOracleProposer(OracleProposer):
    """Drafts one wrong token (the known next token + 1) and nothing after it, and prepares
    branches whose only candidate is the known next token with the known token after it: each
    commit's bonus token is a prepared branch, so every accepted draft comes from one."""

    name = "branch-oracle-test"

    def __init__(self, prompts, refs, vocab_size):
        super().__init__(prompts, refs)
        self.vocab_size = vocab_size
        self.num_branch_calls = 0

    def propose(self, request_id, context_token_ids, num_tokens):
        n = len(context_token_ids)
        for seq in self.seqs:
            if seq[:n] == context_token_ids:
                return [(seq[n] + 1) % self.vocab_size] if n < len(seq) else []
        return []

    def propose_branches(self, calls):
        self.num_branch_calls += 1
        out = []
        for call in calls:
            true = super().propose(call.request_id, call.context_token_ids, 2)
            ok = len(true) == 2 and true[0] != call.path_token_id
            out.append({true[0]: [true[1]]} if ok else {})
        return out
