"""Mailboxes: the one transport interface workers use, plus the in-process implementation.

A worker owns one :class:`Mailbox` and talks to peers by name. Messages always travel encoded
(header frame + buffer frames, see ``protocol.codec``), so the in-process hub exercises exactly
the bytes a ZMQ socket would carry. A malformed message is never raised out of ``recv``: it is
returned as an :class:`Envelope` whose ``msg`` is the :class:`ProtocolError`, so the worker can
count it, log it with the peer, quarantine the named request, and keep serving.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specmesh.protocol.codec import decode, encode
from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.step_profile import StepProfile

log = logging.getLogger(__name__)


class PeerUnavailable(ConnectionError):
    """``send`` named a peer this mailbox has no connection to."""


@dataclass(frozen=True, slots=True)
class Envelope:
    """A received message (or the ProtocolError it decoded to) and the peer that sent it."""

    peer: str
    msg: object

    @property
    def is_error(self) -> bool:
        return isinstance(self.msg, ProtocolError)


class Mailbox(ABC):
    """Named endpoint: ``send(peer, msg)`` and ``recv(timeout_s)``; thread-safe for one reader."""

    name: str

    @abstractmethod
    def send(self, peer: str, msg: object) -> None:
        """Encode and send ``msg`` to ``peer``. Raises PeerUnavailable for an unknown peer."""

    @abstractmethod
    def recv(self, timeout_s: float = 0.0) -> Envelope | None:
        """Next envelope, waiting up to ``timeout_s`` seconds; None when nothing arrived."""

    def drain(self, max_messages: int = 4096) -> list[Envelope]:
        """Everything already queued (non-blocking), at most ``max_messages``."""
        out: list[Envelope] = []
        while len(out) < max_messages:
            env = self.recv(0.0)
            if env is None:
                break
            out.append(env)
        return out

    def peers(self) -> list[str]:
        """Names of the peers this mailbox can currently send to."""
        return []

    def wake(self) -> None:  # noqa: B027 - optional hook
        """Make a ``recv`` blocked in another thread return now (e.g. to honour a stop)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release sockets / queues."""


def decode_envelope(peer: str, frames: Sequence) -> Envelope:
    """Decode ``frames`` from ``peer``; a malformed message becomes an error envelope."""
    try:
        return Envelope(peer, decode(frames))
    except ProtocolError as err:
        err.peer = peer
        log.warning("protocol error from %s: %s", peer, err)
        return Envelope(peer, err)


class InProcHub:
    """Connects in-process mailboxes by name (tests and ``specmesh generate``)."""

    def __init__(self) -> None:
        self._queues: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()
        self.bytes_sent = 0

    def mailbox(self, name: str) -> InProcMailbox:
        with self._lock:
            if name in self._queues:
                raise ValueError(f"mailbox {name!r} already exists")
            self._queues[name] = queue.Queue()
        return InProcMailbox(self, name)

    def _deliver(self, src: str, dst: str, frames: list[bytes]) -> None:
        q = self._queues.get(dst)
        if q is None:
            raise PeerUnavailable(f"no mailbox named {dst!r}")
        self.bytes_sent += sum(len(f) for f in frames)
        q.put((src, frames))

    def _remove(self, name: str) -> None:
        with self._lock:
            self._queues.pop(name, None)

    def names(self) -> list[str]:
        return list(self._queues)


_WAKE = object()  # queued by InProcMailbox.wake: recv returns None at once


class InProcMailbox(Mailbox):
    """Mailbox on an :class:`InProcHub`; frames are copied to ``bytes`` like a socket would."""

    def __init__(self, hub: InProcHub, name: str) -> None:
        self.name = name
        self._hub = hub
        self._queue = hub._queues[name]

    def send(self, peer: str, msg: object) -> None:
        self.send_frames(peer, encode(msg))

    def send_frames(self, peer: str, frames: Sequence) -> None:
        """Send raw frames (tests use this to inject malformed bytes)."""
        self._hub._deliver(self.name, peer, [bytes(f) for f in frames])

    def recv(self, timeout_s: float = 0.0) -> Envelope | None:
        try:
            if timeout_s > 0:
                item = self._queue.get(timeout=timeout_s)
            else:
                item = self._queue.get_nowait()
        except queue.Empty:
            return None
        if item is _WAKE:
            return None
        src, frames = item
        return decode_envelope(src, frames)

    def wake(self) -> None:
        self._queue.put(_WAKE)

    def peers(self) -> list[str]:
        return [n for n in self._hub.names() if n != self.name]

    def close(self) -> None:
        self._hub._remove(self.name)

#: How long an idle worker blocks on its mailbox per loop turn, seconds. Messages end the wait
#: at once and a stop wakes the mailbox (:meth:`Mailbox.wake`), so this only bounds how often an
#: idle role wakes up for nothing (it checks timeouts then): rarely enough to use no CPU.
IDLE_TIMEOUT_S = 1.0


def run_loop(step: Callable[[float], object], stop: threading.Event, idle_timeout_s: float,
             name: str, on_error: Callable[[BaseException], None] | None = None) -> None:
    """Call ``step(idle_timeout_s)`` until ``stop`` is set. A step that raises is logged (and
    passed to ``on_error``) and the loop goes on: a bug in one step must not kill the role."""
    while not stop.is_set():
        try:
            step(idle_timeout_s)
        except Exception as err:
            log.exception("%s step failed", name)
            if on_error is not None:
                on_error(err)


class MailboxWorker(ABC):
    """The transport edge every worker shares: ingest, send, and the step loop.

    A subclass sets ``mailbox`` and ``name`` and implements :meth:`handle` (one envelope, a
    ProtocolError envelope included) and :meth:`step`.
    """

    mailbox: Mailbox
    name: str = "worker"
    #: time per phase of the step; ``ingest`` (handling received messages, not waiting for
    #: them) and ``send`` (one message into the mailbox) are recorded here for every worker.
    profile: StepProfile

    @abstractmethod
    def handle(self, env: Envelope) -> None:
        """Apply one received envelope."""

    @abstractmethod
    def step(self, timeout_s: float = 0.0) -> int:
        """One loop iteration; waits up to ``timeout_s`` for input only when idle."""

    def ingest(self, timeout_s: float = 0.0) -> int:
        """Handle every queued envelope, waiting up to ``timeout_s`` for the first one.
        Returns the number handled."""
        n = 0
        env = self.mailbox.recv(timeout_s)
        t0 = time.perf_counter()
        while env is not None:
            self.handle(env)
            n += 1
            env = self.mailbox.recv(0.0)
        if n:
            self.profile.observe("ingest", time.perf_counter() - t0)
        return n

    def send(self, peer: str | None, msg: object) -> bool:
        """Send ``msg`` to ``peer`` (None: nowhere). A peer that cannot be reached is logged and
        passed to :meth:`on_send_failed`; returns whether the message left."""
        if peer is None:
            return False
        t0 = time.perf_counter()
        try:
            self.mailbox.send(peer, msg)
            self.profile.observe("send", time.perf_counter() - t0)
            return True
        except ConnectionError as err:
            log.warning("%s cannot reach %s: %s", self.name, peer, err)
            self.on_send_failed(peer, err)
            return False

    def on_send_failed(self, peer: str, err: ConnectionError) -> None:  # noqa: B027 - hook
        """Called when a send to ``peer`` failed; nothing by default."""

    def run(self, stop: threading.Event, idle_timeout_s: float = IDLE_TIMEOUT_S,
            on_error: Callable[[BaseException], None] | None = None) -> None:
        """Step until ``stop`` is set, blocking on the mailbox while idle (whoever sets ``stop``
        calls ``mailbox.wake()`` to end the wait at once)."""
        run_loop(self.step, stop, idle_timeout_s, self.name, on_error)
