"""Which prepared branches a drafter asks for (the speculation cache of SSD / Saguaro, arXiv
2603.03251; the worker's side is in drafter/worker.py).

Once a request's path is as long as its run-ahead allows, the drafter prepares, for the first
``branch_positions`` positions of the path already sent, the next draft after each of the
``num_branches`` likeliest tokens other than the path's own, and ships them as DraftBranches.
The verifier keeps them; a commit whose bonus token is one of them makes that continuation the
tail at once. This module picks the (request, position) pairs of one
:meth:`drafter.proposer.Proposer.propose_branches` call and keeps what the proposer returns;
it holds no state of its own (each request's ``branches`` dict records what was prepared).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from specmesh.drafter.draft_state import DraftState
from specmesh.drafter.proposer import BranchCall
from specmesh.engine.sampling import GREEDY, sampling_mode

#: most branch candidates (head rows) one propose_branches call drafts: bounds how long a
#: commit arriving meanwhile waits for the drafter
MAX_BRANCH_ROWS = 16
#: branches only while the drafter holds at most this many requests: with more, the drafter is
#: rarely idle and its extra head passes slow the verifier's forward on shared cores and memory
#: (docs/benchmarks.md, 'Drafting')
MAX_BRANCH_REQUESTS = 4


@dataclass
class BranchPlan:
    """One propose_branches call: ``calls`` and, aligned, the ``(state, position)`` each is
    for; ``pending``: more positions were due than one call takes (ask again next step)."""

    calls: list[BranchCall] = field(default_factory=list)
    where: list[tuple[DraftState, int]] = field(default_factory=list)
    pending: bool = False


def plan_branches(states: Iterable[DraftState], num_branches: int, branch_positions: int,
                  window_of: Callable[[DraftState], int]) -> BranchPlan:
    """The next call's candidates: greedy requests whose path is full (``window_of(st)``
    tokens, or exhausted), positions ``0 .. branch_positions - 1`` of the path already sent,
    every request's first position before any second one, each position once per path (it is
    recorded in ``st.branches`` here), at most :data:`MAX_BRANCH_ROWS` rows."""
    plan = BranchPlan()
    ready = [st for st in states
             if (st.sampling is None or sampling_mode(st.sampling) == GREEDY)
             and (st.exhausted or len(st.path) >= window_of(st))]
    for j in range(branch_positions):
        for st in ready:
            pos = len(st.committed) + j
            if j >= st.num_sent or pos in st.branches:
                continue
            if len(plan.calls) * num_branches >= MAX_BRANCH_ROWS:
                plan.pending = True
                return plan
            st.branches[pos] = {}
            plan.calls.append(BranchCall(st.request_id, context_upto(st, j), st.path[j],
                                         num_branches))
            plan.where.append((st, pos))
    return plan


def kept_candidates(got: dict, own: int) -> dict[int, list[int]]:
    """A proposer's ``{candidate: continuation}`` for one position, without the path's own
    token ``own`` and without empty continuations."""
    return {int(t): list(c) for t, c in got.items() if c and t != own}


def context_upto(st: DraftState, j: int) -> list[int]:
    """The request's context through the first ``j`` path tokens."""
    return st.prompt_token_ids + st.committed + st.path[:j]


__all__ = ["MAX_BRANCH_REQUESTS", "MAX_BRANCH_ROWS", "BranchPlan", "context_upto",
           "kept_candidates", "plan_branches"]
