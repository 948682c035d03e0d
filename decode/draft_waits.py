"""The verifier's short waits for drafts (docs/architecture.md, 'The verify step'): before a
step's plan, tails in flight get the scheduler's budget to arrive; between a forward and its
commit, tails and branches that arrived are applied (a branch prepared for this very commit
must be in place) while every other message waits for the next ingest, in order. A mixin of
:class:`decode.worker.VerifierWorker` (its ``mailbox``, ``scheduler``, ``stats``, ``handle``,
``silent_drafters`` and ``_deferred``)."""

from __future__ import annotations

import logging
import time

from specmesh.decode.request import Request
from specmesh.protocol.messages import DraftBranches, DraftTailStream

log = logging.getLogger(__name__)


class DraftWaits:
    """Waits for and applies drafts around a verify step (see the module docstring)."""

    def _ingest_drafts_before_commit(self) -> None:
        """Tails and branches that arrived during the forward, applied before its commit: a
        branch the drafter prepared for this very commit must be in place when it lands. The
        first other envelope, and everything after it, waits for the next ingest (handled in
        the order received; nothing else changes a request between forward and commit)."""
        while (env := self.mailbox.recv(0.0)) is not None:
            if not self._deferred and isinstance(env.msg, (DraftTailStream, DraftBranches)):
                try:
                    self.handle(env)
                except Exception:  # noqa: BLE001 - a draft hint must never cost the commit
                    log.exception("verifier: %s from %s failed before a commit",
                                  type(env.msg).__name__, env.peer)
            else:
                self._deferred.append(env)

    def _wait_for_tails(self, running: list[Request]) -> None:
        """Give tails in flight the scheduler's budget (at most a fraction of one step, and
        what the next draft is worth: re-read as drafts arrive) to arrive."""
        start = time.monotonic()
        silent = self.silent_drafters()
        waiting = [r for r in running if r.drafter not in silent]
        if (self.scheduler.awaiting_tail(waiting)
                and self.scheduler.tail_wait_budget_s(running, waiting) > 0):
            self.stats.num_tail_waits += 1
        while self.scheduler.awaiting_tail(waiting):
            left = start + self.scheduler.tail_wait_budget_s(running, waiting) - time.monotonic()
            env = self.mailbox.recv(left) if left > 0 else None
            if env is None:
                return
            self.handle(env)
