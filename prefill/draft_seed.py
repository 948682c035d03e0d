"""The draft method's first step at the prefill (docs/drafters.md, 'The seed across P/D'): after
the prompt's forward, a request whose draft method has a seeder gets a
:class:`~protocol.messages.DraftSeed` in its PrefillDone (SGLang's P/D EAGLE ships the draft's
first top-k and hidden state in MetadataBuffers the same way, ``disaggregation/utils.py``).

prefill/ may not import drafter/, so the seeder is a plain callable the cluster builds from the
drafter registry with the drafter role's own spec (cluster/prefill_seeder.py) and hands to
:attr:`prefill.worker.PrefillWorker.draft_seeders`. A seeder that fails costs the request its
seed, never its prefill."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from specmesh.engine.frames import buffer_to_tensor
from specmesh.prefill.prefill_stats import PrefillStats
from specmesh.protocol.messages import Buffer, DraftSeed, PrefillRequest

log = logging.getLogger(__name__)

#: ``(request_id, context_token_ids, hidden_row) -> DraftSeed | None``: the context is the
#: prompt and its first output token (``p + 1`` ids), ``hidden_row`` the target's seed state
#: at position ``p - 1`` (torch.Tensor ``[1, seed width]``, what PrefillDone.seed_state holds)
DraftSeeder = Callable[[str, list[int], object], DraftSeed | None]


def draft_seeds(seeders: dict[str, DraftSeeder], reqs: Sequence[PrefillRequest],
                first_token_ids: Sequence[int], seed_states: Sequence[Buffer | None],
                stats: PrefillStats) -> list[DraftSeed | None]:
    """Per request the DraftSeed of its draft method's seeder (None: its method has none, it
    has no seed state, or the seeder returned none or raised: logged, counted in
    ``stats.num_draft_seed_errors``); seeds made are counted in ``stats.num_draft_seeds`` and
    ``stats.draft_seed_bytes`` (DraftSeed.nbytes)."""
    out: list[DraftSeed | None] = []
    for req, first, state in zip(reqs, first_token_ids, seed_states):
        seeder = seeders.get(req.draft_method)
        seed = None
        if seeder is not None and state is not None and first >= 0:
            try:
                seed = seeder(req.request_id, [*req.prompt_token_ids, first],
                              buffer_to_tensor(state))
            except Exception:  # noqa: BLE001 - a seeder must never fail a prefill
                log.warning("draft seed of %s failed", req.request_id, exc_info=True)
                stats.num_draft_seed_errors += 1
        if seed is not None:
            stats.num_draft_seeds += 1
            stats.draft_seed_bytes += seed.nbytes
        out.append(seed)
    return out


__all__ = ["DraftSeeder", "draft_seeds"]
