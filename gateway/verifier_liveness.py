"""Whether the verifiers that hold the gateway's requests are still there (docs/architecture.md,
'Cluster and health'): a verifier that restarted (a newer incarnation in its HelloAck or the
roster) or left the roster fails the requests it held at once; one whose connection dropped
fails them unless it comes back as the same incarnation within ``verifier_lost_grace_s``. A
mixin of :class:`gateway.backend.MailboxBackend` (its ``_pending``, ``_incarnations``,
``_lost``, ``_gone``, ``_lock``, ``clock``, ``recv_timeout_s``, ``verifier_lost_grace_s``,
``num_verifier_losses`` and ``_fail``)."""

from __future__ import annotations

import logging

from specmesh.protocol.enums import FinishReason

log = logging.getLogger(__name__)


class VerifierLiveness:
    """Fails the requests of verifiers that are gone (see the module docstring)."""

    def verifier_hello(self, peer: str, incarnation: int | None) -> None:
        """``peer`` (a verifier) acknowledged our Hello, or the roster lists it, as
        ``incarnation``. A newer incarnation than the one known is a restarted process: the
        requests its previous life held fail at once. Thread-safe."""
        if incarnation is None or incarnation < 0:
            return
        with self._lock:
            old = self._incarnations.get(peer)
            if old is not None and incarnation < old:
                return  # a late, stale report
            self._incarnations[peer] = incarnation
            self._lost.pop(peer, None)
            self._gone.discard(peer)
            if old is not None and incarnation == old:
                return  # the same process is back: nothing was lost
        if old is not None:
            self._fail_verifier(peer, f"verifier {peer} restarted (incarnation {old} -> "
                                      f"{incarnation}); the requests its previous life held "
                                      "are lost")

    def verifier_disconnected(self, peer: str) -> None:
        """The connection to ``peer`` dropped (closed, reset, or its heartbeat timed out). Its
        requests fail unless it comes back as the same incarnation within
        ``verifier_lost_grace_s``. Thread-safe."""
        with self._lock:
            self._lost.setdefault(peer, self.clock())
            self._gone.discard(peer)

    def set_verifiers(self, verifiers: dict[str, int | None]) -> None:
        """The roster's verifiers (instance id -> incarnation): requests held by a verifier
        that left the roster fail at once, and so do those of a verifier whose roster entry is
        a newer incarnation. Thread-safe."""
        with self._lock:
            gone = {p.verifier for p in self._pending.values()
                    if p.verifier and p.verifier not in verifiers}
            for peer in list(self._lost):
                if peer not in verifiers:
                    del self._lost[peer]
            self._gone &= set(verifiers)
        for peer in sorted(gone):
            self._fail_verifier(peer, f"verifier {peer} left the roster (it died or was "
                                      "removed); the requests it held are lost")
        for peer, incarnation in verifiers.items():
            self.verifier_hello(peer, incarnation)

    def _recv_timeout(self) -> float:
        """The reader's next wait: ``recv_timeout_s``, or less when a lost verifier's grace
        period ends sooner."""
        with self._lock:
            if not self._lost:
                return self.recv_timeout_s
            first = min(self._lost.values())
        left = first + self.verifier_lost_grace_s - self.clock()
        return min(self.recv_timeout_s, max(left, 0.0) + 0.01)

    def _check_lost(self) -> None:
        """Fail the requests of every verifier lost for longer than the grace period."""
        if not self._lost:
            return
        now = self.clock()
        with self._lock:
            expired = [p for p, t in self._lost.items()
                       if now - t >= self.verifier_lost_grace_s]
            for peer in expired:
                del self._lost[peer]
                self._gone.add(peer)
        for peer in expired:
            self._fail_verifier(peer, self._gone_error(peer))

    def _gone_error(self, peer: str) -> str:
        return (f"lost the connection to verifier {peer} and it did not come back within "
                f"{self.verifier_lost_grace_s:g} s (it died, or its node did); the request's "
                "output is lost")

    def _fail_verifier(self, peer: str, error: str) -> None:
        """End every request held by ``peer`` with ``error`` (no Abort: the process that held
        them is gone)."""
        with self._lock:
            rids = [rid for rid, p in self._pending.items()
                    if p.verifier == peer and not p.closed]
        if rids:
            log.warning("%s (%d requests)", error, len(rids))
        for rid in rids:
            self.num_verifier_losses += 1
            self._fail(rid, FinishReason.ERROR, error)
