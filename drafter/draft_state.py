"""The drafter's state of one request: the committed output the verifier told it, the
speculative path it drafts ahead of it, and what it has sent (drafter/worker.py keeps one per
request; drafter/branches.py picks the positions to prepare branches at from them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specmesh.drafter.prediction import PredictionDrafter
from specmesh.protocol.messages import SamplingParams


@dataclass
class DraftState:
    """Token state of one request on the drafter (output positions as in protocol.messages)."""

    request_id: str
    verifier: str  # peer that owns the request
    prompt_token_ids: list[int]
    committed: list[int]  # committed output tokens, as the verifier told us
    path: list[int] = field(default_factory=list)  # speculative tokens after `committed`
    probs: list = field(default_factory=list)  # row each path token was drawn from, or None
    #: per path token: copied from the request's prediction (sent as prediction segments)
    predicted: list[bool] = field(default_factory=list)
    sampling: SamplingParams | None = None  # the request's (DraftSync.sampling)
    num_sent: int = 0  # tokens of `path` already streamed
    # (tokens, parents, rows) for the next segment; rows: each node's draft_probs or None
    tree: tuple[list[int], list[int], list] | None = None
    exhausted: bool = False  # proposer found nothing for the current context
    news: bool = True  # synced or committed since the last segment: the verifier may wait
    commit_received_at: float | None = None  # perf_counter() of the last unanswered commit
    num_drafts_wanted: int | None = None  # VerifyCommit's: the verifier's cap (None: kappa)
    drafting_paused: bool = False  # VerifyCommit's: draft nothing from the method for now
    #: output position -> {candidate: drafts after it} sent as DraftBranches ({}: none made)
    branches: dict[int, dict[int, list[int]]] = field(default_factory=dict)
    #: the request's prediction as a draft source (drafter/prediction.py; None: none)
    prediction: PredictionDrafter | None = None

    @property
    def context(self) -> list[int]:
        return self.prompt_token_ids + self.committed + self.path
