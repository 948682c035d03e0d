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
(docs/architecture.md, 'Messages'). The reader thread is in gateway/stream_reader.py, the
verifiers' liveness in gateway/verifier_liveness.py and the choice of a request's verifier in
gateway/verifier_choice.py (mixins of :class:`MailboxBackend`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from specmesh.gateway.pending import Pending
from specmesh.gateway.stream_reader import StreamReader
from specmesh.gateway.verifier_choice import VERIFIER_WAIT_S, VerifierChoice
from specmesh.gateway.verifier_liveness import VerifierLiveness
from specmesh.protocol.enums import FinishReason
from specmesh.protocol.messages import Abort, GenerateRequest, TokenStream

if TYPE_CHECKING:  # transport imports the codec; the app must not need it
    from specmesh.protocol.transport import Mailbox

log = logging.getLogger(__name__)

#: Abort reason when a stream is closed or cancelled before its finished TokenStream
ABANDONED_REASON = "client disconnected"
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


class MailboxBackend(StreamReader, VerifierLiveness, VerifierChoice):
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
        self._pending: dict[str, Pending] = {}
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
        pending = Pending(loop=asyncio.get_running_loop(), queue=asyncio.Queue())
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
