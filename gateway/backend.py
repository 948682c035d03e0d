"""The gateway's link to the verifiers: GenerateRequest out, TokenStream deltas back.

Everything that knows about mailboxes, envelopes and wire messages lives here, so the HTTP app
only sees :class:`GenerationBackend` (``generate`` / ``abort``) and tests can replace it.

Threading: one reader thread blocks on ``mailbox.recv(timeout)`` and hands each TokenStream to
the asyncio queue of its request with ``loop.call_soon_threadsafe``. Sends (GenerateRequest,
Abort) come from the event loop or any thread and are serialized by a lock, because a ZMQ
socket must not be used by two threads at once.

Every wait has a bound and an outcome (docs/architecture.md, 'Cluster and health'): a request whose
verifier restarted (a
new incarnation in its HelloAck or the roster), left the roster, or lost its connection and did
not come back within ``verifier_lost_grace_s`` fails with an error naming the verifier; a
request that gets no TokenStream for ``stream_timeout_s`` (a verifier alive but silent) fails
too; either way its pending entry is gone. A TokenStream whose ``offset`` is not the number of
tokens already delivered (a lost or repeated delta) fails the request
(docs/architecture.md, 'Messages').
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.enums import FinishReason
from specmesh.protocol.messages import Abort, GenerateRequest, TokenStream

if TYPE_CHECKING:  # transport imports the codec; the app must not need it
    from specmesh.protocol.transport import Mailbox

log = logging.getLogger(__name__)

#: Abort reason when a stream is closed or cancelled before its finished TokenStream
ABANDONED_REASON = "client disconnected"
#: How long a new request waits for a verifier to be connected (a cluster still starting, a
#: verifier restarting) before it fails, seconds; and how often it looks again.
VERIFIER_WAIT_S = 30.0
VERIFIER_POLL_S = 0.05
#: Default stream idle timeout, seconds: a request that gets no TokenStream for this long (its
#: verifier alive but silent: a hung loop, a lost final delta) fails. A request queued on a
#: busy verifier or prefilling a long prompt is silent too, so this is well above the KV
#: transfer bound (60 s).
STREAM_IDLE_TIMEOUT_S = 120.0
#: How long a verifier whose connection dropped may take to come back as the same incarnation
#: (a network blip; ZMQ reconnects within a fraction of a second) before the requests it held
#: fail, seconds. With the transport's heartbeat timeout this bounds the wait on a verifier
#: that died (process or node) well under 10 s.
VERIFIER_LOST_GRACE_S = 2.0


class DuplicateRequestId(ValueError):
    """``generate`` was given the id of a request still in flight (the gateway answers 409);
    the request in flight is not touched."""


@runtime_checkable
class GenerationBackend(Protocol):
    """What the HTTP app needs from a backend."""

    def generate(self, req: GenerateRequest) -> AsyncIterator[TokenStream]:
        """Stream the request's TokenStream deltas; the last one has ``finished=True``."""

    def abort(self, request_id: str, reason: str, num_output_tokens: int | None = None) -> None:
        """Tell the verifier to drop the request; the stream ends with ``"abort"``.
        ``num_output_tokens``: where a stop string ended the output (the verifier cuts its
        spec stats there)."""


def finished_stream(request_id: str, reason: str, error: str = "") -> TokenStream:
    """A terminal TokenStream made up locally (abort, send failure, timeout, shutdown)."""
    return TokenStream(request_id=request_id, token_ids=[], finished=True,
                       finish_reason=reason, error=error)


@dataclass
class _Pending:
    """Gateway-side state of one in-flight request."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    verifier: str = ""
    last: TokenStream | None = None  # latest real stats, for a local terminal message
    closed: bool = field(default=False)
    num_tokens: int = 0  # output tokens delivered: the offset the next TokenStream must carry


class MailboxBackend:
    """Backend over a :class:`protocol.transport.Mailbox` (in-process hub or ZMQ).

    Args:
        mailbox: the gateway's own mailbox; this object becomes its only reader.
        pick_verifier: returns the verifier peer name for a new request.
        recv_timeout_s: how long the reader thread blocks per ``recv`` call; a TokenStream ends
            the wait at once and close() wakes it, so this only sets how often an idle gateway
            wakes up for nothing.
        stream_timeout_s: stream idle timeout: fail a request when no TokenStream arrived for
            this long after it was sent (None: never).
        verifier_wait_s: how long a new request waits while ``pick_verifier`` raises (no
            verifier connected yet) before it fails with an error.
        verifier_lost_grace_s: how long a verifier whose connection dropped
            (:meth:`verifier_disconnected`) may take to come back before its requests fail.
        clock: monotonic seconds, what ``verifier_wait_s`` and ``verifier_lost_grace_s`` are
            measured on (a fake clock in tests).
    """

    def __init__(self, mailbox: Mailbox, pick_verifier: Callable[[], str],
                 recv_timeout_s: float = 1.0,
                 stream_timeout_s: float | None = STREAM_IDLE_TIMEOUT_S,
                 verifier_wait_s: float = VERIFIER_WAIT_S,
                 verifier_lost_grace_s: float = VERIFIER_LOST_GRACE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.mailbox = mailbox
        self.pick_verifier = pick_verifier
        self.recv_timeout_s = recv_timeout_s
        self.stream_timeout_s = stream_timeout_s
        self.verifier_wait_s = verifier_wait_s
        self.verifier_lost_grace_s = verifier_lost_grace_s
        self.clock = clock
        self._pending: dict[str, _Pending] = {}
        self._incarnations: dict[str, int] = {}  # verifier -> newest incarnation seen
        self._lost: dict[str, float] = {}  # verifier -> when its connection dropped
        self._gone: set[str] = set()  # lost past the grace period, not back yet
        #: sibling group -> (its verifier, requests of it sent so far): the n choices of a
        #: prompt go to one verifier (:meth:`_group_verifier`)
        self._groups: dict[str, tuple[str, int]] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self.num_protocol_errors = 0
        self.num_dropped_streams = 0  # TokenStreams for unknown / finished requests
        self.num_ignored_messages = 0  # messages of a kind a gateway does not take
        self.num_aborts_sent = 0
        self.num_stream_gaps = 0  # requests failed on a TokenStream gap or overlap
        self.num_verifier_losses = 0  # requests failed because their verifier died / restarted
        self.num_reader_turns = 0  # the reader thread's loop turns (the gateway's heartbeat)
        #: message class -> what takes it, ``handler(peer, msg)`` in the reader thread: the
        #: verifiers' control answers (gateway/corpora.py registers the corpus ones)
        self.control_handlers: dict[type, Callable[[str, object], None]] = {}
        self._thread = threading.Thread(target=self._reader, name="gateway-backend-reader",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ state

    @property
    def num_in_flight(self) -> int:
        """Requests sent to a verifier and not yet finished."""
        return len(self._pending)

    def in_flight_by_verifier(self) -> dict[str, int]:
        """Requests in flight per verifier peer (for least-loaded routing)."""
        with self._lock:
            out: dict[str, int] = {}
            for p in self._pending.values():
                out[p.verifier] = out.get(p.verifier, 0) + 1
        return out

    def _send(self, peer: str, msg: object) -> None:
        with self._send_lock:
            self.mailbox.send(peer, msg)

    def send(self, peer: str, msg: object) -> None:
        """Send a control message (not a request's) to verifier ``peer``; thread-safe.

        Raises:
            ConnectionError: no channel to ``peer``.
        """
        self._send(peer, msg)

    def _deliver(self, request_id: str, msg: TokenStream, *, final: bool) -> bool:
        """Queue ``msg`` for its request; with ``final`` the request is forgotten."""
        with self._lock:
            pending = self._pending.get(request_id)
            if pending is None or pending.closed:
                return False
            if final:
                pending.closed = True
                del self._pending[request_id]
        try:
            pending.loop.call_soon_threadsafe(pending.queue.put_nowait, msg)
        except RuntimeError:  # the request's event loop is closed
            return False
        return True

    # ------------------------------------------------------------------ reader thread

    def _reader(self) -> None:
        while not self._stop.is_set():
            self.num_reader_turns += 1
            try:
                env = self.mailbox.recv(self._recv_timeout())
                if env is not None:
                    self._handle(env.peer, env.msg)
                self._check_lost()
            except Exception:  # noqa: BLE001 - the reader must survive anything
                log.exception("gateway backend reader: unexpected error")
                self._stop.wait(self.recv_timeout_s)

    def _handle(self, peer: str, msg: object) -> None:
        if isinstance(msg, ProtocolError):
            self.num_protocol_errors += 1
            log.warning("protocol error from %s (request %s): %s", peer, msg.request_id, msg)
            if msg.request_id is not None and msg.request_id in self._pending:
                # A lost delta would corrupt the text: fail that request only.
                self._send_abort(msg.request_id, "protocol error")
                self._fail(msg.request_id, FinishReason.ERROR,
                           f"protocol error from {peer}: {msg}")
            return
        if isinstance(msg, TokenStream):
            pending = self._pending.get(msg.request_id)
            if pending is not None and not pending.closed:
                if msg.offset != pending.num_tokens:
                    self._stream_gap(peer, pending, msg)
                    return
                pending.num_tokens += len(msg.token_ids)
            if pending is not None and not msg.finished:
                pending.last = msg
            if not self._deliver(msg.request_id, msg, final=msg.finished):
                self.num_dropped_streams += 1
                log.debug("dropped TokenStream for unknown request %s", msg.request_id)
            return
        handler = self.control_handlers.get(type(msg))
        if handler is not None:
            handler(peer, msg)
            return
        self.num_ignored_messages += 1
        log.debug("gateway ignores %s from %s", type(msg).__name__, peer)

    def _stream_gap(self, peer: str, pending: _Pending, msg: TokenStream) -> None:
        """``msg`` does not start where the delivered output ends: a delta was lost (gap) or
        repeated (overlap). Nothing of it reaches the client; the request fails and the
        verifier is told to drop it."""
        have, rid = pending.num_tokens, msg.request_id
        if msg.offset > have:
            what = (f"a gap: output tokens {have}..{msg.offset - 1} never arrived (a lost "
                    "TokenStream)")
        else:
            what = (f"an overlap: output tokens {msg.offset}..{have - 1} arrived twice")
        self.num_stream_gaps += 1
        error = (f"the token stream of request {rid} from {peer} has {what}; the request is "
                 "failed rather than return output with a hole")
        log.warning("%s", error)
        self._send_abort(rid, "token stream gap")
        self._fail(rid, FinishReason.ERROR, error)

    # ------------------------------------------------------------------ verifier liveness

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

    def _fail(self, request_id: str, reason: str, error: str = "") -> None:
        pending = self._pending.get(request_id)
        last = pending.last if pending is not None else None
        msg = finished_stream(request_id, reason, error)
        if last is not None:  # keep the spec stats the client already earned
            msg = TokenStream(request_id=request_id, token_ids=[], finished=True,
                              finish_reason=reason, error=error,
                              num_prompt_tokens=last.num_prompt_tokens,
                              num_draft_tokens=last.num_draft_tokens,
                              num_accepted_tokens=last.num_accepted_tokens,
                              num_verify_steps=last.num_verify_steps,
                              num_accepted_prediction_tokens=last.num_accepted_prediction_tokens,
                              num_rejected_prediction_tokens=last.num_rejected_prediction_tokens)
        self._deliver(request_id, msg, final=True)

    # ------------------------------------------------------------------ public API

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenStream]:
        """Send ``req`` to a verifier and yield its TokenStreams until the finished one.

        Closing the iterator early or cancelling the task that awaits it (the HTTP client went
        away) aborts the request with reason ``"client disconnected"`` unless :meth:`abort` was
        already called for it (e.g. with ``"stop string"``). While no verifier is connected
        (``pick_verifier`` raises) the request waits up to ``verifier_wait_s``, then ends with
        an ``error`` TokenStream ("no verifier available ...").

        Raises:
            DuplicateRequestId: (at the first iteration) a request with this id is in flight;
                it is left as it is (nothing is sent, nothing aborted).
        """
        rid = req.request_id
        pending = _Pending(loop=asyncio.get_running_loop(), queue=asyncio.Queue())
        with self._lock:
            if rid in self._pending:
                raise DuplicateRequestId(f"request id {rid!r} is already in flight")
            self._pending[rid] = pending
        finished = False
        try:
            try:
                verifier = self._group_verifier(req) or await self._wait_for_verifier()
                self._join_group(req, verifier)
                if not pending.closed:  # not aborted while it waited
                    pending.verifier = verifier
                    self._send(verifier, req)
                if verifier in self._gone:  # no one there to answer
                    self._fail(rid, FinishReason.ERROR, self._gone_error(verifier))
            except Exception as err:  # noqa: BLE001 - no verifier / peer unavailable
                log.warning("cannot send request %s: %s", rid, err)
                with self._lock:
                    self._pending.pop(rid, None)
                finished = True
                yield finished_stream(rid, FinishReason.ERROR, f"no verifier available: {err}")
                return
            while True:
                if self.stream_timeout_s is None:
                    msg = await pending.queue.get()
                else:
                    try:
                        msg = await asyncio.wait_for(pending.queue.get(), self.stream_timeout_s)
                    except asyncio.TimeoutError:  # alive but silent: bounded too
                        self._send_abort(rid, "stream idle timeout")
                        self._fail(rid, FinishReason.ERROR,
                                   f"no output from verifier {pending.verifier} for "
                                   f"{self.stream_timeout_s:g} s (stream idle timeout); the "
                                   "request was aborted")
                        continue  # the error (or a finish that just arrived) is queued
                finished = msg.finished
                yield msg
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid, ABANDONED_REASON)

    def _group_verifier(self, req: GenerateRequest) -> str | None:
        """The verifier the other requests of ``req``'s sibling group (the ``n`` choices of a
        prompt, decode/siblings.py) went to: one verifier prefills the prompt once for all."""
        if not req.group:
            return None
        with self._lock:
            entry = self._groups.get(req.group)
        return entry[0] if entry is not None and entry[0] not in self._gone else None

    def _join_group(self, req: GenerateRequest, verifier: str) -> None:
        """Remember ``req``'s group's verifier until all ``group_size`` requests were sent."""
        if not req.group or req.group_size < 2:
            return
        with self._lock:
            _, sent = self._groups.get(req.group, (verifier, 0))
            if sent + 1 >= req.group_size:
                self._groups.pop(req.group, None)
            else:
                self._groups[req.group] = (verifier, sent + 1)

    async def _wait_for_verifier(self) -> str:
        """``pick_verifier()``, asked again every VERIFIER_POLL_S while it raises, for at most
        ``verifier_wait_s``.

        Raises:
            ConnectionError: still no verifier after ``verifier_wait_s`` (the last error says
                why).
        """
        deadline = self.clock() + self.verifier_wait_s
        while True:
            try:
                return self.pick_verifier()
            except Exception as err:  # noqa: BLE001 - whatever says "not now"
                if self.clock() >= deadline:
                    raise ConnectionError(f"{err} (waited {self.verifier_wait_s:g} s)") from err
            await asyncio.sleep(VERIFIER_POLL_S)

    def abort(self, request_id: str, reason: str = "abort",
              num_output_tokens: int | None = None) -> None:
        """Send Abort to the request's verifier and end its stream with ``"abort"``.
        ``num_output_tokens`` tells the verifier where a stop string ended the output, so it
        counts spec stats only up to there.

        Idempotent; unknown or finished requests are ignored. Thread-safe.
        """
        if self._send_abort(request_id, reason, num_output_tokens):
            self._fail(request_id, FinishReason.ABORT, reason)

    def _send_abort(self, request_id: str, reason: str,
                    num_output_tokens: int | None = None) -> bool:
        """Send Abort to the verifier of a request in flight (best effort); False when the
        request is unknown or finished."""
        with self._lock:
            pending = self._pending.get(request_id)
            if pending is None or pending.closed:
                return False
            verifier = pending.verifier
        if verifier:
            try:
                self._send(verifier, Abort(request_id=request_id, reason=reason,
                                           num_output_tokens=num_output_tokens))
                self.num_aborts_sent += 1
            except Exception as err:  # noqa: BLE001 - the verifier may be gone already
                log.warning("abort of %s not delivered to %s: %s", request_id, verifier, err)
        return True

    def close(self) -> None:
        """Stop the reader thread and end every in-flight stream with an error."""
        self._stop.set()
        self.mailbox.wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=max(1.0, 4 * self.recv_timeout_s))
        for rid in list(self._pending):
            self._fail(rid, FinishReason.ERROR, "gateway backend closed")
