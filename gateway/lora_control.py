"""The gateway's control of the LoRA adapters loaded and unloaded at run time, behind vLLM's
endpoints (gateway/lora_admin.py; docs/operations.md, 'LoRA adapters'):

- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``: every verifier loads the PEFT
  adapter at ``lora_path`` (a path each role's host can read) and relays the load to its
  prefill workers (decode/lora_relay.py, prefill/lora_ops.py); once all of them have it, the
  adapter is listed in ``/v1/models`` and requests may name it. 200 with vLLM's text
  ``Success: LoRA adapter 'NAME' added successfully.``; 400 with vLLM's messages for a missing
  field or a name already served ("The lora adapter 'NAME' has already been loaded.") or an
  adapter that cannot be served (its reason); 404 when the path holds no adapter; 503 when no
  verifier is connected; 504 when a role did not answer in time. A load that failed anywhere is
  unloaded again everywhere, so no role keeps a half-loaded adapter.
- ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: the adapter leaves ``/v1/models`` at once
  (new requests naming it are 404), and each role frees it once its own requests on it have
  finished: requests running on it complete on it, as vLLM's do. 200 with vLLM's text
  ``Success: LoRA adapter 'NAME' removed successfully.``; 400 without a name; 404 ("The lora
  adapter 'NAME' cannot be found.") for a name not served.

The list (:attr:`LoraControl.adapters`, name -> path) is the app's ``lora_modules``. A verifier
that says Hello (started, restarted, or reconnected: an operation sent meanwhile is lost) gets
the whole list (a ``sync``), and relays it to its prefill workers, so a role that restarts
serves what the others serve. Operations on LoRA
adapters run one at a time. Thread-safe: the HTTP handlers call in from the event loop, the
backend's reader thread delivers the verifiers' answers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specmesh.protocol.enums import LoraOp
from specmesh.protocol.messages import LoraAdapterOp, LoraAdapterResult

log = logging.getLogger(__name__)

#: how long a load or unload waits for every role's answer, seconds
LORA_WAIT_S = 120.0


class LoraRefusal(Exception):
    """An operation refused or failed, answered with ``status_code`` (vLLM's statuses) and an
    OpenAI error of ``type`` naming ``param`` (gateway/lora_admin.py turns it into one)."""

    def __init__(self, status_code: int, message: str, type: str = "BadRequestError",
                 param: str | None = "lora_name") -> None:
        super().__init__(message)
        self.status_code, self.message, self.type, self.param = (status_code, message, type,
                                                                 param)


@dataclass
class LoraOperation:
    """One operation in flight: the verifiers whose answer is not in, the prefill workers they
    relayed it to, and every role's answer (instance id -> result)."""

    op: str
    op_id: int
    name: str
    verifiers: set[str]
    prefills: set[str] = field(default_factory=set)
    results: dict[str, LoraAdapterResult] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)

    def check(self) -> None:
        if not self.verifiers and self.prefills <= set(self.results):
            self.done.set()

    def pending(self) -> list[str]:
        return sorted(self.verifiers | (self.prefills - set(self.results)))

    def failures(self) -> list[LoraAdapterResult]:
        return [r for _, r in sorted(self.results.items()) if r.error]


class LoraControl:
    """The adapters the cluster serves and the operations that change them (module
    docstring). ``send(peer, msg)`` sends to a verifier (the backend's send), ``verifiers()``
    names the verifiers connected now; ``adapters``: the adapters served from the start
    (``--lora-modules``)."""

    def __init__(self, send: Callable[[str, object], None], verifiers: Callable[[], list[str]],
                 adapters: dict[str, str] | None = None, wait_s: float = LORA_WAIT_S) -> None:
        self._send = send
        self._verifiers = verifiers
        self.adapters: dict[str, str] = dict(adapters or {})
        self.wait_s = wait_s
        #: adapters being loaded now: a sync sent meanwhile keeps them (name -> path)
        self._loading: dict[str, str] = {}
        self._op_ids = itertools.count(time.time_ns())
        self._ops: dict[int, LoraOperation] = {}
        self._lock = threading.Lock()
        self._serial = asyncio.Lock()  # one operation at a time (made in the app's loop)

    def attach(self, backend) -> LoraControl:  # noqa: ANN001 - a MailboxBackend
        """Take the verifiers' LoRA answers from ``backend``'s reader thread; returns self."""
        backend.control_handlers[LoraAdapterResult] = self.on_result
        return self

    # -- operations (the event loop) --------------------------------------------------------

    async def load(self, name: str | None, path: str | None) -> str:
        """Load adapter ``name`` from ``path`` on every role; vLLM's success text.

        Raises:
            LoraRefusal: as the module docstring lists.
        """
        if not name or not path:
            raise LoraRefusal(400, "Both 'lora_name' and 'lora_path' must be provided.",
                              type="BadRequestError", param="lora_name")
        async with self._serial:
            if name in self.adapters:
                raise LoraRefusal(400, f"The lora adapter '{name}' has already been loaded.",
                                  type="BadRequestError", param="lora_name")
            self._loading[name] = path
            try:
                op = await self._run(LoraAdapterOp(op=LoraOp.LOAD.value,
                                                   op_id=self._next_id(), lora_name=name,
                                                   lora_path=path))
            finally:
                self._loading.pop(name, None)
            failed, pending = op.failures(), op.pending()
            if failed or pending:
                # no role keeps a half-loaded adapter: an unload of what did load
                await self._run(LoraAdapterOp(op=LoraOp.UNLOAD.value, op_id=self._next_id(),
                                              lora_name=name, lora_path=""))
            if failed:
                first = failed[0]
                where = ", ".join(r.instance_id for r in failed)
                raise LoraRefusal(404 if first.not_found else 400,
                                  f"{first.error} (on {where})",
                                  type="NotFoundError" if first.not_found
                                  else "BadRequestError", param="lora_path")
            if pending:
                raise LoraRefusal(504, f"loading LoRA adapter {name!r}: no answer from "
                                       f"{', '.join(pending)} within {self.wait_s:g} s; it "
                                       "was unloaded again", type="server_error",
                                  param=None)
            self.adapters[name] = path
        log.info("LoRA adapter %s loaded from %s on %s", name, path, sorted(op.results))
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str | None) -> str:
        """Stop serving adapter ``name`` (module docstring); vLLM's success text.

        Raises:
            LoraRefusal: 400 without a name, 404 for a name not served.
        """
        if not name:
            raise LoraRefusal(400, "'lora_name' needs to be provided to unload a LoRA "
                                   "adapter.", type="BadRequestError", param="lora_name")
        async with self._serial:
            if self.adapters.pop(name, None) is None:
                raise LoraRefusal(404, f"The lora adapter '{name}' cannot be found.",
                                  type="NotFoundError", param="lora_name")
            op = await self._run(LoraAdapterOp(op=LoraOp.UNLOAD.value, op_id=self._next_id(),
                                               lora_name=name, lora_path=""))
        for r in op.failures():  # (a role that did not have it: nothing left to free there)
            log.warning("unload of LoRA adapter %s on %s: %s", name, r.instance_id, r.error)
        in_use = sum(r.num_in_use for r in op.results.values())
        log.info("LoRA adapter %s unloaded (%d requests finish on it first)", name, in_use)
        return f"Success: LoRA adapter '{name}' removed successfully."

    # -- from the verifiers (the backend's reader thread) ----------------------------------

    def on_result(self, peer: str, msg: LoraAdapterResult) -> None:
        """A LoraAdapterResult from verifier ``peer``: its own answer or a prefill worker's
        it relays."""
        with self._lock:
            op = self._ops.get(msg.op_id)
            if op is None:
                if msg.error:
                    log.warning("LoRA %s on %s: %s", msg.op, msg.instance_id, msg.error)
                return
            op.results[msg.instance_id] = msg
            if msg.instance_id == peer:
                op.verifiers.discard(peer)
                op.prefills.update(msg.relayed_to)
            op.check()

    def verifier_joined(self, peer: str) -> None:
        """Verifier ``peer`` said Hello (started, restarted or reconnected): it (and, through
        it, its prefill workers) serves exactly the list, and the adapters being loaded now
        (answers are only logged when they fail)."""
        try:
            self._send(peer, LoraAdapterOp(op=LoraOp.SYNC.value, op_id=self._next_id(),
                                           lora_name="", lora_path="",
                                           adapters={**self.adapters, **self._loading}))
        except Exception as err:  # noqa: BLE001 - the verifier may be gone again
            log.warning("LoRA adapter list not sent to %s: %s", peer, err)

    # -- internals --------------------------------------------------------------------------

    def _next_id(self) -> int:
        with self._lock:
            return next(self._op_ids)

    async def _run(self, msg: LoraAdapterOp) -> LoraOperation:
        """Send ``msg`` to every connected verifier and wait (at most ``wait_s``) for their
        answers and their prefill workers'.

        Raises:
            LoraRefusal: 503, no verifier is connected.
        """
        verifiers = list(self._verifiers())
        if not verifiers:
            raise LoraRefusal(503, "no verifier is connected: LoRA adapters cannot change "
                                   "now", type="server_error", param=None)
        op = LoraOperation(msg.op, msg.op_id, msg.lora_name, set(verifiers))
        with self._lock:
            self._ops[op.op_id] = op
        for v in verifiers:
            try:
                self._send(v, msg)
            except Exception as err:  # noqa: BLE001 - the verifier may be gone
                with self._lock:
                    op.verifiers.discard(v)
                    op.results[v] = LoraAdapterResult(op=msg.op, op_id=msg.op_id,
                                                      instance_id=v, lora_name=msg.lora_name,
                                                      error=f"cannot reach it: {err}")
        with self._lock:
            op.check()
        try:
            if not op.done.is_set():
                await asyncio.get_running_loop().run_in_executor(None, op.done.wait,
                                                                 self.wait_s)
        finally:
            with self._lock:
                self._ops.pop(op.op_id, None)
        return op


__all__ = ["LORA_WAIT_S", "LoraControl", "LoraOperation", "LoraRefusal"]
