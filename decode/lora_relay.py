"""The verifier's part in LoRA adapters changed at run time (docs/operations.md, 'LoRA
adapters'): the gateway dials only verifiers and only verifiers dial prefill workers
(protocol/handshake.py, DIALS), so a LoraAdapterOp from a gateway is applied to the verifier's
own model (engine/lora_runtime.py) and relayed to every prefill worker; each answer
(LoraAdapterResult: the verifier's own, naming the prefill workers it relayed to, then each
prefill worker's) goes back to the gateway that sent the operation.

- ``load``: applied here first; relayed only when it succeeded.
- ``unload``: the adapter stops being served here at once, but is freed only once none of
  this verifier's requests (waiting, prefilling, running, cancelling) uses it; the unload is
  relayed to the prefill workers then, since a waiting request still has its prompt to
  prefill on it. Running requests finish on the adapter they started with (as vLLM's do).
- ``sync`` (a verifier that restarted or reconnected, or a gateway that did: serve exactly
  this set): applied here, and the resulting set relayed as a sync (with the adapters still
  unloading here: they are relayed as unloads once freed).

A prefill worker that joins, restarts or reconnects is sent a ``sync`` of the adapters held
here (:meth:`VerifierLora.prefill_joined`), so it serves the run-time adapters too.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from specmesh.engine.lora_runtime import LoraOpError, RuntimeAdapters
from specmesh.protocol.enums import LoraOp
from specmesh.protocol.messages import LoraAdapterOp, LoraAdapterResult

log = logging.getLogger(__name__)

#: most operations whose gateway is remembered, to route the prefill workers' answers back
MAX_ORIGINS = 1024
#: op_id of the syncs a verifier sends on its own (a prefill worker that joined): no gateway
#: waits for their answers
OWN_OP_ID = 0


class VerifierLora:
    """Applies and relays LoRA operations (module docstring). ``send(peer, msg) -> bool``: the
    verifier's send; ``prefill_peers()``: the prefill workers to relay to now. Loop thread
    only."""

    def __init__(self, runtime: RuntimeAdapters, send: Callable[[str, object], bool],
                 prefill_peers: Callable[[], list[str]], instance_id: str) -> None:
        self.runtime = runtime
        self._send = send
        self._prefill_peers = prefill_peers
        self.instance_id = instance_id
        self._origins: OrderedDict[int, str] = OrderedDict()  # op id -> gateway
        #: adapter -> the unload operation to relay once the adapter is freed here
        self._unloads: dict[str, LoraAdapterOp] = {}
        self._relayed: list[str] = []  # prefill workers the last relay reached
        runtime.on_freed = self._freed

    def on_op(self, gateway: str, msg: LoraAdapterOp) -> None:
        """Apply gateway ``gateway``'s operation, relay it, answer it (never raises)."""
        self._remember(msg.op_id, gateway)
        error, not_found, in_use = "", False, 0
        self._relayed = []
        try:
            if msg.op == LoraOp.LOAD:
                self._unloads.pop(msg.lora_name, None)
                self.runtime.load(msg.lora_name, msg.lora_path)
                self._relay(msg)
            elif msg.op == LoraOp.UNLOAD:
                self._unloads[msg.lora_name] = msg
                in_use = self.runtime.unload(msg.lora_name)  # relayed when freed
            else:
                error = "; ".join(self.runtime.sync(dict(msg.adapters)))
                # (adapters still unloading here stay: our waiting requests prefill on them)
                self._relay(sync_op(msg.op_id, self.runtime.held()))
        except LoraOpError as err:
            if msg.op == LoraOp.UNLOAD:
                self._unloads.pop(msg.lora_name, None)
            error, not_found = str(err), err.not_found
        if error:
            log.warning("LoRA %s of %r from %s failed: %s", msg.op, msg.lora_name, gateway,
                        error)
        self._send(gateway, LoraAdapterResult(
            op=msg.op, op_id=msg.op_id, instance_id=self.instance_id, lora_name=msg.lora_name,
            error=error, not_found=not_found, relayed_to=sorted(self._relayed),
            num_in_use=in_use))

    def on_result(self, peer: str, msg: LoraAdapterResult) -> bool:
        """Forward prefill worker ``peer``'s answer to the gateway of its operation; False
        when no gateway waits for it (a sync of our own, or a forgotten operation)."""
        origin = self._origins.get(msg.op_id)
        if origin is None:
            if msg.error:
                log.warning("prefill worker %s: LoRA %s failed: %s", peer, msg.op, msg.error)
            return False
        self._send(origin, msg)
        return True

    def prefill_joined(self, peer: str) -> None:
        """Prefill worker ``peer`` (new, restarted or reconnected) serves what we serve: a
        sync of our adapters, those still unloading here included (its answer is only
        logged when it failed)."""
        self._send(peer, sync_op(OWN_OP_ID, self.runtime.held()))

    def reap(self) -> list[str]:
        """Free the unloaded adapters no request uses any more and relay their unloads."""
        return self.runtime.reap() if self.runtime.unloading else []

    # -- internals --------------------------------------------------------------------------

    def _freed(self, name: str) -> None:
        """Adapter ``name`` was freed here: its unload goes on to the prefill workers."""
        op = self._unloads.pop(name, None)
        self._relay(op or LoraAdapterOp(op=LoraOp.UNLOAD.value, op_id=OWN_OP_ID,
                                        lora_name=name, lora_path=""))

    def _relay(self, msg: LoraAdapterOp) -> None:
        self._relayed = [p for p in self._prefill_peers() if self._send(p, msg)]

    def _remember(self, op_id: int, gateway: str) -> None:
        self._origins[op_id] = gateway
        self._origins.move_to_end(op_id)
        if len(self._origins) > MAX_ORIGINS:
            self._origins.popitem(last=False)


def sync_op(op_id: int, adapters: dict[str, str]) -> LoraAdapterOp:
    """A LoraAdapterOp ``sync`` to ``adapters`` ({name: path})."""
    return LoraAdapterOp(op=LoraOp.SYNC.value, op_id=op_id, lora_name="", lora_path="",
                         adapters=dict(adapters))


__all__ = ["VerifierLora", "sync_op"]
