"""The prefill worker's part in LoRA adapters changed at run time (docs/operations.md, 'LoRA
adapters'): a LoraAdapterOp from a verifier (which relays the gateway's) is applied to the
worker's model (engine/lora_runtime.py) and answered with a LoraAdapterResult.

A prefill worker serves every verifier of the cluster, and each relays the same operations. A
load is applied once (the same name and path again is a no-op); an unload only once every
verifier of the roster (``verifier_peers``) has relayed it, since a verifier relays an unload
only after its own requests on the adapter are done (decode/lora_relay.py) and another may
still send prompts on it. A request already queued here on an unloaded adapter still runs:
the adapter is freed after it. Freeing an adapter drops the prefix cache's unused blocks (they
may hold that adapter's KV, and a later adapter of the same name must not reuse them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from specmesh.engine.lora_runtime import LoraOpError, RuntimeAdapters
from specmesh.protocol.enums import LoraOp
from specmesh.protocol.messages import LoraAdapterOp, LoraAdapterResult

log = logging.getLogger(__name__)


class PrefillLora:
    """Applies the verifiers' LoRA operations to one prefill worker's model. ``send(peer,
    msg)``: the worker's send; ``instance_id``: the worker's name in its answers; ``queued``:
    the requests waiting in its queue (what keeps an unloaded adapter alive). Loop thread
    only."""

    def __init__(self, runtime: RuntimeAdapters, send: Callable[[str, object], bool],
                 instance_id: str) -> None:
        self.runtime = runtime
        self._send = send
        self.instance_id = instance_id
        #: the verifiers of the roster (None: not known, e.g. a worker driven by a test: an
        #: unload then applies at the first verifier's)
        self.verifier_peers: set[str] | None = None
        #: adapter -> the verifiers that relayed its unload so far
        self._released: dict[str, set[str]] = {}

    def on_op(self, peer: str, msg: LoraAdapterOp) -> None:
        """Apply verifier ``peer``'s operation and answer it (never raises)."""
        error, not_found, in_use = "", False, 0
        try:
            if msg.op == LoraOp.LOAD:
                self._released.pop(msg.lora_name, None)
                self.runtime.load(msg.lora_name, msg.lora_path)
            elif msg.op == LoraOp.UNLOAD:
                in_use = self._release(peer, msg.lora_name)
            else:  # sync: release what is not listed, load what is missing
                for name in sorted(set(self.runtime.current()) - set(msg.adapters)):
                    in_use += self._release(peer, name)
                errors = []
                for name, path in sorted(msg.adapters.items()):
                    self._released.pop(name, None)
                    try:
                        self.runtime.load(name, path)
                    except LoraOpError as err:
                        errors.append(str(err))
                error = "; ".join(errors)
        except LoraOpError as err:
            error, not_found = str(err), err.not_found
        if error:
            log.warning("LoRA %s of %r from %s failed: %s", msg.op, msg.lora_name, peer, error)
        self._send(peer, LoraAdapterResult(op=msg.op, op_id=msg.op_id,
                                           instance_id=self.instance_id,
                                           lora_name=msg.lora_name, error=error,
                                           not_found=not_found, num_in_use=in_use))

    def set_verifiers(self, verifiers: Iterable[str]) -> None:
        """The roster's verifiers now; an unload that waited only for verifiers that left is
        applied."""
        self.verifier_peers = set(verifiers)
        for name in list(self._released):
            self._maybe_unload(name)

    def reap(self) -> list[str]:
        """Free the unloaded adapters no queued request uses any more (runtime's reap)."""
        return self.runtime.reap() if self.runtime.unloading else []

    # -- internals --------------------------------------------------------------------------

    def _release(self, peer: str, name: str) -> int:
        """Verifier ``peer`` released ``name``; unloads it when every verifier has. Returns
        the queued requests still on it (0: freed, or kept for other verifiers). An unload of
        a name not served (another verifier's relay got here first) is no error."""
        if name not in self.runtime.current():
            return 0
        self._released.setdefault(name, set()).add(peer)
        return self._maybe_unload(name)

    def _maybe_unload(self, name: str) -> int:
        released = self._released.get(name, set())
        if self.verifier_peers and not self.verifier_peers <= released:
            return 0
        self._released.pop(name, None)
        if name not in self.runtime.current():
            return 0
        return self.runtime.unload(name)


__all__ = ["PrefillLora"]
