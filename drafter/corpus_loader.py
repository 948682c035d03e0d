"""The drafter's side of DrafterCorpus (docs/drafters.md, 'Corpora'): a load's chunks are put
together per verifier, and every complete operation is applied to the proposer
(:meth:`~drafter.proposer.Proposer.load_corpus`, ``drop_corpus``, ``clear_history``) on one
background thread, in the order the operations arrived, so drafting never waits for a corpus to
be indexed (SGLang loads its external corpus on a background thread too). Indexing is Python and
numpy work that holds the GIL in slices (the interpreter switches threads every few ms, and
numpy's sorts release it), so the loop thread keeps drafting while a corpus loads: a
background thread rather than slices of the loop's own steps, because a method's index is
built by one call of its own (``load_corpus``), which the loop could not cut into pieces.

Each operation is answered with a DrafterCorpusResult to the verifier that sent it. Every
verifier relays the same operation (the same ``op_id``), so per name (``""`` for the history)
the loader remembers the newest operation it accepted: a repeat is applied once and answered
alike, and one older than the newest is answered ``superseded`` and not applied (so a load
relayed late by a slow verifier cannot bring back a corpus dropped since).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specmesh.drafter.proposer import CorpusUnsupported, Proposer
from specmesh.protocol.enums import CorpusOp, CorpusStatus
from specmesh.protocol.messages import MAX_CORPUS_TOKENS, DrafterCorpus, DrafterCorpusResult

log = logging.getLogger(__name__)

#: most names whose newest operation is remembered (the oldest are forgotten: a repeat of a
#: forgotten operation is applied again, which changes nothing)
MAX_TRACKED_NAMES = 4096
#: the slot of clear_history operations (corpus names are never empty)
HISTORY = ""


@dataclass
class _Assembly:
    """The chunks of one load received so far from one verifier."""

    op_id: int
    num_chunks: int
    parts: list[list[int]] = field(default_factory=list)
    num_tokens: int = 0


@dataclass
class _Outcome:
    """How an operation ended (or None while it runs) and who waits for its answer."""

    op: str
    op_id: int
    waiters: list[str]
    status: str | None = None
    num_tokens: int = 0
    error: str = ""


class CorpusLoader:
    """Applies DrafterCorpus operations to ``proposer`` for the drafter named ``drafter``;
    ``wake()`` (thread-safe: the mailbox's) ends the loop's wait when an operation is done.

    Call :meth:`on_message` for every DrafterCorpus (loop thread) and send what it and
    :meth:`results` return (loop thread); :meth:`close` stops the background thread."""

    def __init__(self, proposer: Proposer, drafter: str, wake: Callable[[], None]) -> None:
        self.proposer = proposer
        self.drafter = drafter
        self._wake = wake
        self._assembling: dict[tuple[str, str], _Assembly] = {}
        #: slot -> the newest operation accepted there (running or done)
        self._latest: OrderedDict[str, _Outcome] = OrderedDict()
        self._jobs: queue.Queue = queue.Queue()
        self._done: deque[tuple[str, _Outcome]] = deque()  # (slot, outcome), thread-safe
        self._thread: threading.Thread | None = None
        #: corpus name -> tokens, as loaded (updated when an operation's answer goes out)
        self.held: dict[str, int] = {}
        self.num_operations = 0  # operations applied (repeats and stale ones not counted)

    @property
    def num_tokens(self) -> int:
        """Tokens of every corpus held."""
        return sum(self.held.values())

    # -- loop thread ------------------------------------------------------------------------

    def on_message(self, peer: str, msg: DrafterCorpus) -> list[tuple[str, DrafterCorpusResult]]:
        """Take one operation (a load's chunk) from verifier ``peer``; returns the answers due
        now (a repeat of a finished operation, a stale one, a load that cannot be put
        together), as (peer, result) pairs to send."""
        if msg.op != CorpusOp.LOAD:
            return self._accept(peer, msg.op, msg.name, msg.op_id, None)
        key = (peer, msg.name)
        if msg.chunk_index == 0:
            self._assembling[key] = _Assembly(msg.op_id, msg.num_chunks)
        asm = self._assembling.get(key)
        if asm is None or asm.op_id != msg.op_id or asm.num_chunks != msg.num_chunks \
                or msg.chunk_index != len(asm.parts):
            self._assembling.pop(key, None)
            want = "chunk 0" if asm is None or asm.op_id != msg.op_id \
                else f"chunk {len(asm.parts)} of {asm.num_chunks}"
            return [(peer, self._result(msg.op, msg.name, msg.op_id, CorpusStatus.ERROR, error=(
                f"chunk {msg.chunk_index} of {msg.num_chunks} of load {msg.op_id} came where "
                f"{want} was due: the load is dropped (send it again)")))]
        asm.num_tokens += len(msg.token_ids)
        if self.proposer.supports_corpus:  # (else only counted: the answer is a refusal)
            asm.parts.append(msg.token_ids)
        else:
            asm.parts.append([])
        if asm.num_tokens > MAX_CORPUS_TOKENS:
            del self._assembling[key]
            return [(peer, self._result(msg.op, msg.name, msg.op_id, CorpusStatus.ERROR,
                                        error=f"more than {MAX_CORPUS_TOKENS} tokens"))]
        if len(asm.parts) < asm.num_chunks:
            return []
        del self._assembling[key]
        tokens = [t for part in asm.parts for t in part]
        return self._accept(peer, msg.op, msg.name, msg.op_id, tokens)

    def results(self) -> list[tuple[str, DrafterCorpusResult]]:
        """The answers of the operations finished since the last call, one per verifier that
        sent each, as (peer, result) pairs to send."""
        out = []
        while self._done:
            slot, oc = self._done.popleft()
            if oc.status == CorpusStatus.APPLIED and oc.op == CorpusOp.LOAD:
                self.held[slot] = oc.num_tokens
            elif oc.op == CorpusOp.DROP and oc.status in (CorpusStatus.APPLIED,
                                                          CorpusStatus.UNKNOWN):
                self.held.pop(slot, None)
            for peer in oc.waiters:
                out.append((peer, self._answer(slot, oc)))
            oc.waiters = []
        return out

    def forget_peer(self, peer: str) -> None:
        """Verifier ``peer`` is gone: drop its half-received loads."""
        for key in [k for k in self._assembling if k[0] == peer]:
            del self._assembling[key]

    def close(self) -> None:
        """Stop the background thread once the queued operations are done."""
        if self._thread is not None:
            self._jobs.put(None)

    # -- internals --------------------------------------------------------------------------

    def _accept(self, peer: str, op: str, name: str, op_id: int,
                tokens: list[int] | None) -> list[tuple[str, DrafterCorpusResult]]:
        slot = name if op != CorpusOp.CLEAR_HISTORY else HISTORY
        last = self._latest.get(slot)
        if last is not None and op_id < last.op_id:
            return [(peer, self._result(op, name, op_id, CorpusStatus.SUPERSEDED, error=(
                f"operation {last.op_id} on {name or 'the history'} came first")))]
        if last is not None and op_id == last.op_id:  # the same operation, another verifier
            if last.status is None:
                last.waiters.append(peer)
                return []
            return [(peer, self._answer(slot, last))]
        if op != CorpusOp.CLEAR_HISTORY and not self.proposer.supports_corpus:
            return [(peer, self._result(op, name, op_id, CorpusStatus.UNSUPPORTED, error=(
                f"the {self.proposer.name!r} drafting method keeps no cross-request memory: "
                "it cannot draft from a corpus (use --drafter ngram or suffix)")))]
        oc = _Outcome(op, op_id, [peer])
        self._latest[slot] = oc
        self._latest.move_to_end(slot)
        while len(self._latest) > MAX_TRACKED_NAMES:
            old = next(iter(self._latest))
            if self._latest[old].status is None:  # running: keep it
                self._latest.move_to_end(old)
                break
            del self._latest[old]
        self._start()
        self._jobs.put((slot, oc, tokens))
        return []

    def _answer(self, slot: str, oc: _Outcome) -> DrafterCorpusResult:
        return self._result(oc.op, "" if slot == HISTORY else slot, oc.op_id, oc.status,
                            oc.num_tokens, oc.error)

    def _result(self, op: str, name: str, op_id: int, status: str, num_tokens: int = 0,
                error: str = "") -> DrafterCorpusResult:
        if num_tokens == 0 and status != CorpusStatus.APPLIED:
            num_tokens = self.held.get(name, 0)
        return DrafterCorpusResult(op=str(op), op_id=op_id, name=name, drafter=self.drafter,
                                   status=str(status), num_tokens=num_tokens, error=error)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"{self.drafter}-corpus",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        """The background thread: apply queued operations one at a time."""
        while (job := self._jobs.get()) is not None:
            slot, oc, tokens = job
            latest = self._latest.get(slot)
            if latest is not None and latest.op_id > oc.op_id:  # a newer one is queued
                oc.status, oc.error = CorpusStatus.SUPERSEDED, (
                    f"operation {latest.op_id} on {slot or 'the history'} came before it ran")
            else:
                self._apply(slot, oc, tokens)
            self._done.append((slot, oc))
            self.num_operations += 1
            try:
                self._wake()
            except Exception:  # noqa: BLE001 - the loop's next turn picks it up anyway
                log.debug("corpus loader: wake failed", exc_info=True)

    def _apply(self, slot: str, oc: _Outcome, tokens: list[int] | None) -> None:
        p = self.proposer
        try:
            if oc.op == CorpusOp.LOAD:
                p.load_corpus(slot, tokens or [])
                oc.status, oc.num_tokens = CorpusStatus.APPLIED, len(tokens or [])
            elif oc.op == CorpusOp.DROP:
                oc.status = CorpusStatus.APPLIED if p.drop_corpus(slot) else \
                    CorpusStatus.UNKNOWN
            else:
                p.clear_history()
                oc.status = CorpusStatus.APPLIED
        except CorpusUnsupported as err:
            oc.status, oc.error = CorpusStatus.UNSUPPORTED, str(err)
        except Exception as err:  # noqa: BLE001 - a bad corpus must never kill the drafter
            log.exception("drafter %s: corpus %s %r failed", self.drafter, oc.op, slot)
            oc.status, oc.error = CorpusStatus.ERROR, f"{type(err).__name__}: {err}"
