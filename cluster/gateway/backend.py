"""The gateway's link to the verifiers: GenerateRequest out, TokenStream deltas back.

Everything that knows about mailboxes, envelopes and wire messages lives here, so the HTTP app
only sees :class:`GenerationBackend` (``generate`` / ``abort``) and tests can replace it.

Threading: one reader thread blocks on ``mailbox.recv(timeout)`` and hands each TokenStream to
the asyncio queue of its request with ``loop.call_soon_threadsafe``. Sends (GenerateRequest,
Abort) come from the event loop or any thread and are serialized by a lock, because a ZMQ
socket must not be used by two threads at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from protocol.errors import ProtocolError
from protocol.enums import FinishReason
from protocol.messages import Abort, GenerateRequest, TokenStream

if TYPE_CHECKING:  # transport imports the codec; the app must not need it
    from protocol.transport import Mailbox

log = logging.getLogger(__name__)

#: Abort reason when a stream is closed or cancelled before its finished TokenStream
ABANDONED_REASON = "client disconnected"
#: How long a new request waits for a verifier to be connected (a cluster still starting, a
#: verifier restarting) before it fails, seconds; and how often it looks again.
VERIFIER_WAIT_S = 30.0
VERIFIER_POLL_S = 0.05


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


class MailboxBackend:
    """Backend over a :class:`protocol.transport.Mailbox` (in-process hub or ZMQ).

    Args:
        mailbox: the gateway's own mailbox; this object becomes its only reader.
        pick_verifier: returns the verifier peer name for a new request.
        recv_timeout_s: how long the reader thread blocks per ``recv`` call; a TokenStream ends
            the wait at once and close() wakes it, so this only sets how often an idle gateway
            wakes up for nothing.
        stream_timeout_s: fail a request when no TokenStream arrived for this long (None: never).
        verifier_wait_s: how long a new request waits while ``pick_verifier`` raises (no
            verifier connected yet) before it fails with an error.
    """

    def __init__(self, mailbox: Mailbox, pick_verifier: Callable[[], str],
                 recv_timeout_s: float = 1.0, stream_timeout_s: float | None = None,
                 verifier_wait_s: float = VERIFIER_WAIT_S) -> None:
        self.mailbox = mailbox
        self.pick_verifier = pick_verifier
        self.recv_timeout_s = recv_timeout_s
        self.stream_timeout_s = stream_timeout_s
        self.verifier_wait_s = verifier_wait_s
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self.num_protocol_errors = 0
        self.num_dropped_streams = 0  # TokenStreams for unknown / finished requests
        self.num_aborts_sent = 0
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
            try:
                env = self.mailbox.recv(self.recv_timeout_s)
                if env is not None:
                    self._handle(env.peer, env.msg)
            except Exception:  # noqa: BLE001 - the reader must survive anything
                log.exception("gateway backend reader: unexpected error")
                self._stop.wait(self.recv_timeout_s)

    def _handle(self, peer: str, msg: object) -> None:
        if isinstance(msg, ProtocolError):
            self.num_protocol_errors += 1
            log.warning("protocol error from %s (request %s): %s", peer, msg.request_id, msg)
            if msg.request_id is not None and msg.request_id in self._pending:
                # A lost delta would corrupt the text: fail that request only.
                self.abort(msg.request_id, "protocol error")
                self._fail(msg.request_id, FinishReason.ERROR,
                           f"protocol error from {peer}: {msg}")
            return
        if isinstance(msg, TokenStream):
            pending = self._pending.get(msg.request_id)
            if pending is not None and not msg.finished:
                pending.last = msg
            if not self._deliver(msg.request_id, msg, final=msg.finished):
                self.num_dropped_streams += 1
                log.debug("dropped TokenStream for unknown request %s", msg.request_id)
            return
        log.debug("gateway ignores %s from %s", type(msg).__name__, peer)

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
                              num_verify_steps=last.num_verify_steps)
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
                verifier = await self._wait_for_verifier()
                if not pending.closed:  # not aborted while it waited
                    pending.verifier = verifier
                    self._send(verifier, req)
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
                    except asyncio.TimeoutError:
                        self.abort(rid, "timeout")
                        msg = finished_stream(rid, FinishReason.ERROR, "verifier timed out")
                finished = msg.finished
                yield msg
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid, ABANDONED_REASON)

    async def _wait_for_verifier(self) -> str:
        """``pick_verifier()``, asked again every VERIFIER_POLL_S while it raises, for at most
        ``verifier_wait_s``.

        Raises:
            ConnectionError: still no verifier after ``verifier_wait_s`` (the last error says
                why).
        """
        deadline = time.monotonic() + self.verifier_wait_s
        while True:
            try:
                return self.pick_verifier()
            except Exception as err:  # noqa: BLE001 - whatever says "not now"
                if time.monotonic() >= deadline:
                    raise ConnectionError(f"{err} (waited {self.verifier_wait_s:g} s)") from err
            await asyncio.sleep(VERIFIER_POLL_S)

    def abort(self, request_id: str, reason: str = "abort",
              num_output_tokens: int | None = None) -> None:
        """Send Abort to the request's verifier and end its stream with ``"abort"``.
        ``num_output_tokens`` tells the verifier where a stop string ended the output, so it
        counts spec stats only up to there.

        Idempotent; unknown or finished requests are ignored. Thread-safe.
        """
        with self._lock:
            pending = self._pending.get(request_id)
            if pending is None or pending.closed:
                return
            verifier = pending.verifier
        if verifier:
            try:
                self._send(verifier, Abort(request_id=request_id, reason=reason,
                                           num_output_tokens=num_output_tokens))
                self.num_aborts_sent += 1
            except Exception as err:  # noqa: BLE001 - the verifier may be gone already
                log.warning("abort of %s not delivered to %s: %s", request_id, verifier, err)
        self._fail(request_id, FinishReason.ABORT, reason)

    def close(self) -> None:
        """Stop the reader thread and end every in-flight stream with an error."""
        self._stop.set()
        self.mailbox.wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=max(1.0, 4 * self.recv_timeout_s))
        for rid in list(self._pending):
            self._fail(rid, FinishReason.ERROR, "gateway backend closed")
