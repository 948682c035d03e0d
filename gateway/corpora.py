"""The gateway's control of the drafters' corpora and cross-request history (docs/drafters.md,
'Corpora'): the list of corpora it serves, kept here, and the DrafterCorpus operations it sends.

The gateway dials verifiers only; each verifier relays an operation to its drafters
(decode/corpus_relay.py), says which drafters got it (DrafterCorpusRelayed) and forwards their
answers (DrafterCorpusResult). An operation is done when every verifier it went to has said
where it relayed it and every drafter named there has answered; :meth:`CorpusControl.wait`
waits for that, bounded. A verifier that says Hello as a new incarnation (it started or
restarted after the corpora were loaded) gets every corpus of the list again; drafters that
join or restart get them from their verifiers. So the list here is what every drafter holds,
once the operations have gone round; a gateway that restarts keeps only the ``--corpus``
files it is started with (the drafters keep the others until told otherwise).

``op_id`` numbers operations from the gateway's start time in nanoseconds up, so they grow
across its restarts; drafters apply per name only the newest (drafter/corpus_loader.py).
Thread-safe: the HTTP handlers call in from the event loop, the backend's reader thread
delivers the verifiers' messages.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specmesh.protocol.enums import CorpusOp, CorpusStatus
from specmesh.protocol.messages import (
    CORPUS_CHUNK_TOKENS,
    DrafterCorpus,
    DrafterCorpusRelayed,
    DrafterCorpusResult,
)

log = logging.getLogger(__name__)

#: how long an HTTP call waits for the drafters' answers by default, seconds
DEFAULT_WAIT_S = 60.0


def corpus_messages(op_id: int, name: str, token_ids: Sequence[int]) -> list[DrafterCorpus]:
    """The DrafterCorpus chunks of loading ``token_ids`` (at least one) as ``name``."""
    n = len(token_ids)
    num = max(-(-n // CORPUS_CHUNK_TOKENS), 1)
    return [DrafterCorpus(op=CorpusOp.LOAD.value, op_id=op_id, name=name,
                          token_ids=list(token_ids[i * CORPUS_CHUNK_TOKENS:
                                                   (i + 1) * CORPUS_CHUNK_TOKENS]),
                          chunk_index=i, num_chunks=num) for i in range(num)]


@dataclass
class StoredCorpus:
    """A corpus of the gateway's list: its tokens, the operation that loaded it, and what each
    drafter last answered about it (drafter -> {"status", "num_tokens", "error"})."""

    name: str
    token_ids: array
    op_id: int
    drafters: dict[str, dict] = field(default_factory=dict)

    def describe(self) -> dict:
        return {"name": self.name, "num_tokens": len(self.token_ids),
                "drafters": {d: dict(s) for d, s in sorted(self.drafters.items())}}


@dataclass
class Operation:
    """One operation in flight: the verifiers it went to whose relay report is not in yet,
    the drafters they relayed it to, and the answers so far."""

    op: str
    op_id: int
    name: str
    verifiers: set[str]
    sent_to: list[str] = field(default_factory=list)
    drafters: set[str] = field(default_factory=set)
    results: dict[str, DrafterCorpusResult] = field(default_factory=dict)
    verifier_errors: dict[str, str] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)

    def check(self) -> None:
        if not self.verifiers and self.drafters <= set(self.results):
            self.done.set()

    def summary(self) -> dict:
        """What the HTTP answer says: each drafter's answer, who has not answered yet, what
        a verifier refused."""
        return {"op": self.op, "op_id": self.op_id, "name": self.name,
                "verifiers": list(self.sent_to),
                "drafters": {d: {"status": r.status, "num_tokens": r.num_tokens,
                                 "error": r.error} for d, r in sorted(self.results.items())},
                "pending_drafters": sorted(self.drafters - set(self.results)),
                "pending_verifiers": sorted(self.verifiers),
                "verifier_errors": dict(sorted(self.verifier_errors.items()))}


class CorpusControl:
    """The list of corpora and the operations on the drafters. ``send(peer, msg)`` sends to a
    verifier (the backend's send: thread-safe), ``verifiers()`` names the verifiers connected
    now; ``supported``: whether the cluster's drafting method drafts from corpora (``method``
    names it, for the refusal)."""

    def __init__(self, send: Callable[[str, object], None], verifiers: Callable[[], list[str]],
                 supported: bool = True, method: str = "") -> None:
        self._send = send
        self._verifiers = verifiers
        self.supported = supported
        self.method = method
        self.corpora: dict[str, StoredCorpus] = {}
        self._op_ids = itertools.count(time.time_ns())
        self._ops: dict[int, Operation] = {}
        self._lock = threading.Lock()  # the list and the operations
        self._send_lock = threading.Lock()  # one operation's chunks leave together

    def attach(self, backend) -> CorpusControl:  # noqa: ANN001 - a MailboxBackend
        """Take the verifiers' corpus answers from ``backend``'s reader thread; returns self."""
        backend.control_handlers[DrafterCorpusRelayed] = self.on_message
        backend.control_handlers[DrafterCorpusResult] = self.on_message
        return self

    # -- operations (any thread) ------------------------------------------------------------

    def unsupported_reason(self) -> str:
        """Why corpora cannot be loaded ("" when they can)."""
        if self.supported:
            return ""
        return (f"the cluster's drafting method {self.method!r} keeps no cross-request memory "
                "and cannot draft from a corpus: serve with --drafter ngram (or suffix)")

    def load(self, name: str, token_ids: Sequence[int]) -> Operation:
        """Put ``token_ids`` in the list as ``name`` (replacing a corpus of that name) and send
        it to every connected verifier (the others get it when they connect)."""
        with self._lock:
            op_id = next(self._op_ids)
            self.corpora[name] = StoredCorpus(name, array("i", token_ids), op_id)
        return self._start(CorpusOp.LOAD, op_id, name, corpus_messages(op_id, name, token_ids))

    def keep(self, name: str, token_ids: Sequence[int]) -> None:
        """Put ``token_ids`` in the list as ``name`` without sending it now: every verifier
        gets it when it connects (``--corpus`` files, loaded before any verifier is)."""
        with self._lock:
            self.corpora[name] = StoredCorpus(name, array("i", token_ids), next(self._op_ids))

    def drop(self, name: str) -> Operation | None:
        """Take ``name`` off the list and tell the drafters to forget it; None when the list
        has no such corpus."""
        with self._lock:
            if self.corpora.pop(name, None) is None:
                return None
            op_id = next(self._op_ids)
        return self._start(CorpusOp.DROP, op_id, name, [DrafterCorpus(
            op=CorpusOp.DROP.value, op_id=op_id, name=name, token_ids=[])])

    def clear_history(self) -> Operation:
        """Tell every drafter to forget what earlier requests left in its memory."""
        op_id = next(self._op_ids)
        return self._start(CorpusOp.CLEAR_HISTORY, op_id, "", [DrafterCorpus(
            op=CorpusOp.CLEAR_HISTORY.value, op_id=op_id, name="", token_ids=[])])

    async def wait(self, op: Operation, timeout_s: float = DEFAULT_WAIT_S) -> dict:
        """Wait (at most ``timeout_s``) until ``op`` is done; its summary either way. The
        operation is forgotten afterwards (also when the caller is cancelled): later answers
        only update the list's statuses."""
        try:
            if not op.done.is_set():
                await asyncio.get_running_loop().run_in_executor(None, op.done.wait, timeout_s)
        finally:
            with self._lock:
                self._ops.pop(op.op_id, None)
        with self._lock:
            return op.summary()

    def listing(self) -> list[dict]:
        """The corpora of the list, by name: tokens and each drafter's last answer."""
        with self._lock:
            return [c.describe() for _, c in sorted(self.corpora.items())]

    # -- from the verifiers (the backend's reader thread) ----------------------------------

    def on_message(self, peer: str, msg: object) -> None:
        """A DrafterCorpusRelayed or DrafterCorpusResult from verifier ``peer``."""
        with self._lock:
            op = self._ops.get(msg.op_id)
            if isinstance(msg, DrafterCorpusResult):
                self._note_result(msg)
                if op is not None:
                    op.results[msg.drafter] = msg
            elif isinstance(msg, DrafterCorpusRelayed) and op is not None:
                op.verifiers.discard(peer)
                op.drafters.update(msg.drafters)
                if msg.error:
                    op.verifier_errors[peer] = msg.error
            if op is not None:
                op.check()

    def verifier_joined(self, peer: str) -> None:
        """Verifier ``peer`` said Hello as a new incarnation: send it every corpus of the
        list (it relays them to its drafters; their answers update the list's statuses)."""
        with self._lock:
            corpora = list(self.corpora.values())
        for c in corpora:
            self._send_all(peer, corpus_messages(c.op_id, c.name, c.token_ids))
        if corpora:
            log.info("corpora %s sent to verifier %s", [c.name for c in corpora], peer)

    # -- internals --------------------------------------------------------------------------

    def _start(self, kind: CorpusOp, op_id: int, name: str,
               msgs: list[DrafterCorpus]) -> Operation:
        verifiers = list(self._verifiers())
        op = Operation(kind.value, op_id, name, set(verifiers), sorted(verifiers))
        with self._lock:
            self._ops[op_id] = op
        for v in verifiers:
            if not self._send_all(v, msgs):
                with self._lock:
                    op.verifiers.discard(v)
                    op.verifier_errors[v] = "cannot reach this verifier"
        with self._lock:
            op.check()
        return op

    def _send_all(self, peer: str, msgs: list[DrafterCorpus]) -> bool:
        """Send one operation's messages to ``peer`` with no other's in between."""
        with self._send_lock:
            try:
                for m in msgs:
                    self._send(peer, m)
                return True
            except Exception as err:  # noqa: BLE001 - the verifier may be gone
                log.warning("corpus operation %d not sent to %s: %s", msgs[0].op_id, peer, err)
                return False

    def _note_result(self, msg: DrafterCorpusResult) -> None:
        """Keep a drafter's answer about a corpus of the list (lock held)."""
        c = self.corpora.get(msg.name)
        if c is not None and msg.op == CorpusOp.LOAD and msg.op_id == c.op_id \
                and msg.status != CorpusStatus.SUPERSEDED:
            c.drafters[msg.drafter] = {"status": msg.status, "num_tokens": msg.num_tokens,
                                       "error": msg.error}
