"""The verifier's side of losing a drafter (docs/architecture.md, 'Drafting': "drafter failure never
fails a
request", issue 9): a drafter that owes an answer for longer than ``drafter_silence_s`` is not
waited for; one whose connection dropped and is not back within ``drafter_lost_grace_s`` is
lost (its requests move to another drafter or to plain decode); one that is heard from again,
or restarts, gets its requests re-synced with DraftSync. A mixin of
:class:`decode.worker.VerifierWorker` (its state: ``_drafter_owes``, ``_drafters_down``; its
``config``, ``stats``, ``lifecycle`` and ``requests``)."""

from __future__ import annotations

import logging
import time

from specmesh.decode.request import RequestStatus

log = logging.getLogger(__name__)


class DrafterLoss:
    """What the verifier does when a drafter goes silent, away or restarts."""

    def drafter_back(self, peer: str) -> None:
        """Drafter ``peer`` acknowledged our Hello again as the same incarnation."""
        self._drafters_down.pop(peer, None)
        if peer in self.lifecycle.lost_drafters:
            self.lifecycle.restore_drafter(peer)

    def _check_drafters_down(self) -> None:
        if not self._drafters_down:
            return
        bound = time.monotonic() - self.config.drafter_lost_grace_s
        for peer, since in list(self._drafters_down.items()):
            if since <= bound:
                del self._drafters_down[peer]
                log.warning("drafter %s: connection lost for %.1f s; its requests move on",
                            peer, self.config.drafter_lost_grace_s)
                self.stats.num_drafters_lost += 1
                self._drafter_owes.pop(peer, None)
                self.lifecycle.lose_drafter(peer)

    def resync_drafter(self, peer: str) -> None:
        """``peer`` restarted or joined (a new incarnation): send it the corpora this verifier
        relays (decode/corpus_relay.py), and re-open its requests with DraftSync (those that
        lost it to a failed send too)."""
        self._drafter_owes.pop(peer, None)
        self._drafters_down.pop(peer, None)
        self.corpus_relay.drafter_joined(peer)
        for req in list(self.requests.values()):
            if req.drafter == peer and req.status is RequestStatus.RUNNING:
                self.lifecycle.sync_draft(req)
        self.lifecycle.restore_drafter(peer)

    def silent_drafters(self) -> set[str]:
        """Drafters that owe an answer for longer than ``drafter_silence_s``: treated as
        gone for the tail wait until they are heard from."""
        bound = time.monotonic() - self.config.drafter_silence_s
        return {p for p, since in self._drafter_owes.items() if since < bound}

    def _heard_from_drafter(self, peer: str) -> None:
        self._drafter_owes.pop(peer, None)
        if peer in self.lifecycle.lost_drafters:  # draining again: re-sync its requests
            self.lifecycle.restore_drafter(peer)
