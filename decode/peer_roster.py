"""The verifier's view of its peers (docs/architecture.md, 'Cluster and health'): the roster's
prefill workers and drafters, and what a failed send or a dropped connection does to them. A
prefill worker that cannot be reached gets no new transfer and its transfers end as
:meth:`decode.prefill_loss.PrefillLoss.prefill_gone` says; a drafter that is lost has its
requests move to another drafter or to plain decode (decode/drafter_loss.py). A mixin of
:class:`decode.worker.VerifierWorker` (its ``prefill_peers``, ``unreachable_prefill``,
``_drafters_down``, ``_drafter_owes``, ``kv``, ``lifecycle``, ``requests`` and ``stats``)."""

from __future__ import annotations

import time


class PeerRoster:
    """Roster changes and connection failures of the verifier's peers (see the module
    docstring)."""

    def set_roster(self, prefill_peers: list[str], drafter_peers: list[str]) -> None:
        """Replace the known peers. Requests on a vanished drafter are re-opened on another
        (or run without drafts); transfers from a vanished prefill worker end as
        :meth:`prefill_gone` says."""
        self.prefill_peers = list(prefill_peers)
        self.lifecycle.set_drafters(drafter_peers)
        for peer in set(self._drafters_down) - set(drafter_peers):
            del self._drafters_down[peer]  # (its requests moved with the roster)
        for peer in {t.prefill_peer for t in self.kv.transfers.values()} - set(prefill_peers):
            self.prefill_gone(peer, f"prefill worker {peer} left the cluster")
        for peer in set(self.unreachable_prefill) - set(prefill_peers):
            del self.unreachable_prefill[peer]

    def on_send_failed(self, peer: str, err: ConnectionError) -> None:
        """A send to ``peer`` failed (it refused our Hello, or there is no channel to it): a
        prefill worker gets no new transfer until the roster changes and its transfers end
        as :meth:`prefill_gone` says."""
        if peer in self.prefill_peers or any(t.prefill_peer == peer
                                             for t in self.kv.transfers.values()):
            self.unreachable_prefill[peer] = str(err)
            self.prefill_gone(peer, f"cannot reach prefill worker {peer}: {err}")
        elif peer in self.lifecycle.drafter_peers or any(r.drafter == peer
                                                         for r in self.requests.values()):
            # drafter-bound messages are dropped, never the loop: plain decode, re-sync later
            self.stats.num_drafters_lost += 1
            self._drafter_owes.pop(peer, None)
            self.lifecycle.lose_drafter(peer)

    def peer_disconnected(self, peer: str) -> None:
        """The transport's connection to ``peer`` dropped (closed, reset, heartbeat timeout;
        called in the loop thread). A prefill worker's frames in flight are lost with the
        connection: its transfers end as :meth:`prefill_gone` says (retried on another worker,
        or a clear error) at once, and it gets no new transfer until it acknowledges our Hello
        again (:meth:`prefill_back`). A drafter that is not back (:meth:`drafter_back`, or a
        restart: :meth:`resync_drafter`) within ``drafter_lost_grace_s`` is lost
        (:meth:`lose_drafter` of the lifecycle): its requests move to another drafter or
        to plain decode without waiting for the health check."""
        if peer in self.prefill_peers or any(t.prefill_peer == peer
                                             for t in self.kv.transfers.values()):
            reason = f"lost the connection to prefill worker {peer}"
            self.unreachable_prefill[peer] = reason
            self.prefill_gone(peer, reason)
        elif peer in self.lifecycle.drafter_peers:
            self._drafters_down.setdefault(peer, time.monotonic())
