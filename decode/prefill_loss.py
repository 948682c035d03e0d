"""The verifier's side of losing a prefill worker (docs/architecture.md, 'KV transfer'): transfers
whose
prefill peer can send no more frames (deregistered, restarted, unreachable, disconnected) end
once the frames already received are handled: a cancelled one frees its blocks (no
acknowledgement will come), a running one is re-issued once on another prefill worker, else its
request fails with a clear error. A mixin of :class:`decode.worker.VerifierWorker` (its state:
``prefill_peers``, ``unreachable_prefill``, ``_orphans``; its ``kv``, ``lifecycle``,
``requests`` and ``_start_transfer``)."""

from __future__ import annotations

import logging

from specmesh.decode.request import Request, RequestStatus
from specmesh.protocol.enums import FinishReason

log = logging.getLogger(__name__)

#: How many times a request's KV transfer is re-issued on another prefill worker when its
#: prefill worker goes away (then the request fails with a clear error).
MAX_PREFILL_RETRIES = 1


class PrefillLoss:
    """What the verifier does when a prefill worker goes away (see the module docstring)."""

    def prefill_gone(self, peer: str, reason: str) -> None:
        """``peer`` can send no more frames for the transfers it holds now (deregistered,
        restarted as a new incarnation, unreachable). Once the frames already received are
        handled (after the next ingest), each of them ends: a cancelled one frees its blocks
        (no acknowledgement will come), a running one is re-issued once on another prefill
        worker, or its request fails with ``reason``. Transfers started later are not
        touched (they went to the peer's new incarnation)."""
        for t in self.kv.transfers.values():
            if t.prefill_peer == peer:
                self._orphans.setdefault(t.transfer_id, reason)

    def prefill_restarted(self, peer: str) -> None:
        """``peer`` (a prefill worker) answered as a new incarnation: what it held is lost."""
        self.unreachable_prefill.pop(peer, None)
        self.prefill_gone(peer, f"prefill worker {peer} restarted")

    def prefill_back(self, peer: str) -> None:
        """Prefill worker ``peer`` acknowledged our Hello (again): it may get transfers."""
        if self.unreachable_prefill.get(peer, "").startswith("lost the connection"):
            del self.unreachable_prefill[peer]

    def _end_orphans(self) -> None:
        orphans, self._orphans = self._orphans, {}
        for tid, reason in orphans.items():
            t = self.kv.transfers.pop(tid, None)
            if t is None:  # completed or acknowledged meanwhile
                continue
            self.kv.stats.num_orphaned += 1
            req = self.requests.get(t.request_id)
            if req is None or req.transfer_id != tid:
                continue
            if req.status is RequestStatus.CANCELLING:
                self.lifecycle.release(req)
            elif req.status is RequestStatus.PREFILLING and not self._retry_prefill(req, reason):
                self.lifecycle.finish(req, FinishReason.ERROR, f"KV transfer failed: {reason}")

    def _retry_prefill(self, req: Request, reason: str) -> bool:
        """Re-issue ``req``'s transfer on another reachable prefill worker (at most
        MAX_PREFILL_RETRIES times); False when there is none."""
        others = [p for p in self._reachable_prefill() if p != req.prefill_peer]
        if req.prefill_retries >= MAX_PREFILL_RETRIES or not others:
            return False
        req.prefill_retries += 1
        req.prefill_peer = min(others, key=self._prefill_load)
        log.warning("request %s: %s; KV transfer retried on %s", req.request_id, reason,
                    req.prefill_peer)
        self._start_transfer(req)
        return True

    def _reachable_prefill(self) -> list[str]:
        return [p for p in self.prefill_peers if p not in self.unreachable_prefill]

    def _prefill_load(self, peer: str) -> int:
        return sum(t.prefill_peer == peer for t in self.kv.transfers.values())
