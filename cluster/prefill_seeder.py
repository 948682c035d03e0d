"""The prefill's draft seeder (docs/drafters.md, 'The seed across P/D'): a proposer of the
cluster's drafting method, built as the drafter role builds its own (the same ``--drafter``
spec and :func:`cluster.hosts.drafter.draft_target`: dtype, CPU backend, a float32 head's Q8_0
products), so the first draft step the prefill runs is the one the drafter would run. prefill/
cannot import drafter/: the prefill worker only sees the callable
(prefill/draft_seed.py ``DraftSeeder``)."""

from __future__ import annotations

import logging

from specmesh.cluster.config import ClusterConfig
from specmesh.drafter.proposer import Proposer
from specmesh.drafter.registry import makes_prefill_seed
from specmesh.prefill.draft_seed import DraftSeeder
from specmesh.protocol.messages import MAX_DRAFT_SEED_TOPK

log = logging.getLogger(__name__)


def seeder_of(proposer: Proposer) -> DraftSeeder:
    """``proposer.make_prefill_seed`` as a DraftSeeder, reporting the proposer's ``topk``
    (EAGLE's ``--eagle-topk``, at least 1) capped at MAX_DRAFT_SEED_TOPK (SGLang's 16 slots)."""
    topk = max(1, min(int(getattr(proposer, "topk", 1)), MAX_DRAFT_SEED_TOPK))

    def seeder(request_id: str, context_token_ids: list[int], hidden):  # noqa: ANN001, ANN202
        return proposer.make_prefill_seed(request_id, context_token_ids, hidden, topk)

    return seeder


def prefill_seeders(cfg: ClusterConfig,
                    target_identity=None) -> dict[str, DraftSeeder]:  # noqa: ANN001
    """Draft method -> seeder for the prefill workers of ``cfg``: the drafter's method when
    ``cfg.prefill_draft_seed`` is on and the method ``makes_prefill_seed``, else none.
    ``target_identity``: the drafter's ModelIdentity (None: read from the model's files).
    A proposer that cannot be built here (a head path that exists only on the drafter's node,
    a file that does not load) costs the seed, never the prefill role: logged, no seeder (the
    drafter runs the first step itself, as with ``--prefill-draft-seed off``).
    """
    method = cfg.drafter.method
    if not cfg.prefill_draft_seed or not makes_prefill_seed(method):
        return {}
    from specmesh.cluster.hosts.drafter import build_proposer  # torch: role processes only

    try:
        return {method: seeder_of(build_proposer(cfg, target_identity))}
    except Exception as err:  # noqa: BLE001 - the seed is an optimisation
        log.warning("--prefill-draft-seed: no %s proposer at the prefill (%s: %s); the drafter "
                    "runs the first draft step itself", method, type(err).__name__, err)
        return {}


__all__ = ["prefill_seeders", "seeder_of"]
