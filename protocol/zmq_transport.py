"""ZMQ mailbox: one ordered DEALER/ROUTER channel per peer pair, with the Hello handshake.

Every role binds one ROUTER on ``tcp://<host>:0`` and reads back the port (its endpoint, which
it registers with the controller). The side that starts a conversation (gateway -> verifier,
verifier -> prefill, verifier -> drafter) connects a DEALER whose identity is its own name and
says :class:`Hello` first; the ROUTER side answers :class:`HelloAck` and only then accepts
messages from that peer (anything before Hello is a ProtocolError). Both sides compare every
identity field (protocol/handshake.py): the HelloAck carries the acceptor's identity, and an
initiator that refuses it treats the peer as refused (sends fail, anything it sends is a
ProtocolError). Replies travel back on the
same connection, so e.g. KV frames and PrefillDone share one ordered channel. After a DEALER
reconnects (peer restarted), Hello is sent again.

A DEALER heartbeats its peer (ZMTP PING every ``heartbeat_ivl_ms``; no traffic for
``heartbeat_timeout_ms`` drops the connection), so a peer whose process or node died without
closing its socket is seen as gone too. When a DEALER's connection drops, the peer is no longer
``ready`` until its next HelloAck, and ``on_disconnect(peer)`` is called (in the recv thread).

A socket belongs to the thread that calls ``recv``; ``send`` from any other thread is queued and
handed to that thread through a pipe the poller watches, so sockets are never shared.

With CurveZMQ (protocol/curve.py; ``curve=True``, ``keys`` the role's key pair) the ROUTER
admits only clients whose public key :meth:`ZmqMailbox.allow` lists (the roster's), and a
DEALER dialling a peer whose server key :meth:`ZmqMailbox.set_peer_keys` gave is a CURVE
client of it. Every socket refuses a message part larger than ``max_message_bytes``
(``ZMQ_MAXMSGSIZE``: the peer is disconnected; protocol/socket_caps.py sizes it).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable

import zmq

from zmq.utils.monitor import recv_monitor_message

from specmesh.protocol.codec import encode
from specmesh.protocol.curve import CurveKeys, RosterAuthenticator, make_client, make_server
from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.handshake import PeerInfo, ack_refusal, hello_refusal
from specmesh.protocol.messages import (PROTOCOL_VERSION, Hello, HelloAck, ModelIdentity,
                                        SharedKVPool)
from specmesh.protocol.transport import Envelope, Mailbox, PeerUnavailable, decode_envelope

log = logging.getLogger(__name__)

#: ZMQ_MAXMSGSIZE of a mailbox not given one (a role's is sized from its model and frame
#: settings: protocol/socket_caps.py); a KV frame is at most a few MB
MAX_FRAME_BYTES = 512 * 1024 * 1024
HIGH_WATER_MARK = 100_000  # messages; KV streams are bursty
#: DEALER heartbeat: a PING this often, and the connection dropped after this long without any
#: traffic from the peer (its ZMQ I/O thread answers even while its Python loop is busy).
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 4000
#: a DEALER whose handshake failed (e.g. CurveZMQ: the peer does not know our key yet, its
#: roster is older than ours) is given up by ZMQ; it is dialled anew after this long
REDIAL_AFTER_S = 0.5
#: a DEALER whose connection dropped and did not come back within this long is dialled anew
REDIAL_IF_LOST_S = 2.0
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class ZmqMailbox(Mailbox):
    """Mailbox over ZMQ TCP. ``on_hello(peer_info, is_new)`` is called (in the recv thread) when
    a peer completes a handshake; ``is_new`` is False for a repeat of a known incarnation.
    ``on_disconnect(peer)`` is called (in the recv thread) when the connection to a peer we
    dialled drops. ``hwm``: messages queued per peer before ``send`` fails with PeerUnavailable
    (a send never blocks). ``advertise_host``: the address peers are told to dial (``endpoint``)
    when it is not the bound ``host`` (a wildcard bind); None: the bound one. ``keys``: this
    mailbox's CurveZMQ key pair (needed to dial a Curve peer); ``curve``: the ROUTER requires
    CurveZMQ from its clients (only keys given to :meth:`allow`; needs ``keys``).
    ``max_message_bytes``: the largest message part any of its sockets takes."""

    def __init__(self, name: str, role: str, *, host: str = "127.0.0.1", port: int = 0,
                 model: ModelIdentity | None = None, draft_method: str = "",
                 incarnation: int | None = None,
                 on_hello: Callable[[PeerInfo, bool], None] | None = None,
                 hwm: int = HIGH_WATER_MARK,
                 on_disconnect: Callable[[str], None] | None = None,
                 heartbeat_ivl_ms: int = HEARTBEAT_IVL_MS,
                 heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
                 advertise_host: str | None = None, keys: CurveKeys | None = None,
                 curve: bool = False, max_message_bytes: int = MAX_FRAME_BYTES) -> None:
        if curve and keys is None:
            raise ValueError("a CurveZMQ mailbox needs its key pair (keys)")
        self.name = name
        self.keys, self.curve = keys, curve
        self.max_message_bytes = max_message_bytes
        #: server public keys (Z85) of the peers to dial with CurveZMQ (the roster's)
        self.peer_keys: dict[str, bytes] = {}
        self._dial_keys: dict[str, bytes | None] = {}  # dialled peer -> the key it was dialled with
        self._redial: dict[str, float] = {}  # peer whose handshake failed -> when to dial again
        self.num_failed_handshakes = 0
        self._failing: set[str] = set()  # peers whose handshake failed since their last ack
        self.hwm = hwm
        self.on_disconnect = on_disconnect
        self.heartbeat_ivl_ms, self.heartbeat_timeout_ms = heartbeat_ivl_ms, heartbeat_timeout_ms
        self.role = role
        self.model = model
        self.draft_method = draft_method
        self.incarnation = incarnation if incarnation is not None else time.time_ns()
        self.on_hello = on_hello
        #: the verifier's KV pool in shared memory, announced in every Hello (None: none)
        self.shared_kv: SharedKVPool | None = None
        #: an acceptor's own check of a Hello that passed the handshake's rules: ``(peer,
        #: hello) -> why it is refused`` ("" accepts); a frozen-KV drafter refuses a verifier
        #: off its node there (protocol/colocation.py)
        self.hello_check: Callable[[str, Hello], str] | None = None
        # the ZAP handler binds per context: a Curve mailbox owns one
        self.ctx = zmq.Context() if curve else zmq.Context.instance()
        self.auth: RosterAuthenticator | None = None
        if curve:
            self.auth = RosterAuthenticator(self.ctx, name)
            self.auth.start()
        self.router = self._socket(zmq.ROUTER)
        if curve:
            make_server(self.router, keys)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A restarted peer reconnects under its old identity before the old connection is
        # seen to close: it takes the identity over (else its Hello would be lost).
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.router.bind(f"tcp://{host}:{port}")
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        if advertise_host:
            port = self.endpoint.rsplit(":", 1)[1]
            addr = f"[{advertise_host}]" if ":" in advertise_host else advertise_host
            self.endpoint = f"tcp://{addr}:{port}"
        self.accepted: dict[str, PeerInfo] = {}  # peers that said Hello to our ROUTER
        self.dealers: dict[str, zmq.Socket] = {}  # peers we connected to
        self.dealer_peers: dict[str, PeerInfo] = {}  # from their HelloAck
        self.refused: dict[str, str] = {}
        self._expected_roles: dict[str, str] = {}  # dialled peer -> its role per the roster
        self._monitors: dict[zmq.Socket, str] = {}
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self._outbox: queue.Queue = queue.Queue()
        self._owner: int | None = None
        self._pending: list[Envelope] = []
        self.num_protocol_errors = 0

    def _socket(self, kind: int) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        s.setsockopt(zmq.SNDHWM, self.hwm)
        s.setsockopt(zmq.RCVHWM, self.hwm)
        return s

    # -- CurveZMQ (protocol/curve.py) ------------------------------------------------------

    def allow(self, keys: frozenset[bytes]) -> None:
        """Admit CURVE clients with these public keys (Z85) from now on, and no others (a
        connection already made stays); a no-op without Curve. Any thread."""
        if self.auth is not None:
            self.auth.allowed = frozenset(keys)

    def set_peer_keys(self, keys: dict[str, bytes]) -> None:
        """The server public key (Z85) of each peer that requires CurveZMQ (a peer absent is
        dialled in plain TCP); a peer dialled with another key is re-dialled at its next
        :meth:`connect`."""
        self.peer_keys = dict(keys)

    @property
    def num_refused_peers(self) -> int:
        """Connections refused at the CurveZMQ handshake for a key not allowed."""
        return self.auth.num_refused if self.auth is not None else 0

    def security_entry(self) -> dict:
        """What the roster says of this mailbox's transport: ``curve`` (its ROUTER requires
        CurveZMQ) and ``curve_key`` (its public key, Z85; None without a key pair)."""
        return {"curve": self.curve,
                "curve_key": self.keys.public.decode() if self.keys is not None else None}

    def hello(self) -> Hello:
        return Hello(protocol_version=PROTOCOL_VERSION, role=self.role, instance_id=self.name,
                     incarnation=self.incarnation, model=self.model,
                     draft_method=self.draft_method, shared_kv=self.shared_kv)

    # -- connections (call from the owning thread, or before it starts) ---------------------

    def connect(self, peer: str, endpoint: str, role: str = "") -> None:
        """Open (or re-open, when the endpoint changed) the channel to ``peer`` and say Hello.
        ``role``: what the roster says ``peer`` is (its HelloAck must say the same); "" when
        unknown."""
        server_key = self.peer_keys.get(peer)
        old = self.dealers.get(peer)
        if old is not None:
            if self.dealer_peers[peer].endpoint == endpoint \
                    and self._dial_keys.get(peer) == server_key:
                return
            self.disconnect(peer)
        s = self._socket(zmq.DEALER)
        s.setsockopt_string(zmq.IDENTITY, self.name)
        if server_key is not None:
            if self.keys is None:
                s.close(0)
                self.refused[peer] = "it requires CurveZMQ and this mailbox has no key pair"
                log.error("%s: cannot dial %s: %s", self.name, peer, self.refused[peer])
                return
            make_client(s, self.keys, server_key)
        self._dial_keys[peer] = server_key
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        if self.heartbeat_ivl_ms > 0:
            s.setsockopt(zmq.HEARTBEAT_IVL, self.heartbeat_ivl_ms)
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.heartbeat_timeout_ms)
            s.setsockopt(zmq.HEARTBEAT_TTL, self.heartbeat_timeout_ms)
        mon = s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                                   | _HANDSHAKE_FAILED)
        s.connect(endpoint)
        self.dealers[peer] = s
        self.dealer_peers[peer] = PeerInfo(peer, "", -1, endpoint)
        self._expected_roles[peer] = role
        self._monitors[mon] = peer
        self.poller.register(s, zmq.POLLIN)
        self.poller.register(mon, zmq.POLLIN)
        self.refused.pop(peer, None)
        # ZMQ queues this until the TCP connection is up: Hello is the first message. Never
        # blocking: a handshake that failed already (CurveZMQ: our key not yet allowed there)
        # has dropped the pipe, and a blocking send would wait forever; dial anew instead
        try:
            s.send_multipart(encode(self.hello()), flags=zmq.NOBLOCK)
        except zmq.Again:
            self._redial.setdefault(peer, time.monotonic() + REDIAL_AFTER_S)

    def disconnect(self, peer: str) -> None:
        s = self.dealers.pop(peer, None)
        self.dealer_peers.pop(peer, None)
        self._dial_keys.pop(peer, None)
        self._redial.pop(peer, None)
        self._expected_roles.pop(peer, None)
        if s is None:
            return
        for mon, p in list(self._monitors.items()):
            if p == peer:
                self.poller.unregister(mon)
                s.disable_monitor()
                mon.close(0)
                del self._monitors[mon]
        self.poller.unregister(s)
        s.close(0)

    def peers(self) -> list[str]:
        return sorted(set(self.accepted) | set(self.dealers))

    def ready(self, peer: str) -> bool:
        """True once ``peer`` acknowledged our Hello (dealer side) or said Hello (router side)."""
        info = self.dealer_peers.get(peer)
        return (info is not None and info.acked) or peer in self.accepted

    # -- send / recv -----------------------------------------------------------------------

    def send(self, peer: str, msg: object) -> None:
        frames = encode(msg)
        if self._owner is not None and threading.get_ident() != self._owner:
            self._outbox.put((peer, frames))
            os.write(self._wake_w, b"x")
            return
        self._send_frames(peer, frames)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the thread that owns the sockets (the ``recv`` caller), at its next
        poll; immediately when called from that thread or before any ``recv``."""
        if self._owner is None or threading.get_ident() == self._owner:
            fn()
            return
        self._outbox.put(fn)
        os.write(self._wake_w, b"x")

    def wake(self) -> None:
        """End a ``recv`` blocked in the owning thread (a no-op callback through the pipe)."""
        self.call_soon(lambda: None)

    def _send_frames(self, peer: str, frames: list) -> None:
        if peer in self.refused:
            raise PeerUnavailable(f"{peer} refused our Hello: {self.refused[peer]}")
        s = self.dealers.get(peer)
        try:  # never blocks: a peer that is not draining (high-water mark) fails the send
            if s is not None:
                s.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            elif peer in self.accepted:
                self.router.send_multipart([peer.encode()] + list(frames), flags=zmq.NOBLOCK,
                                           copy=False)
            else:
                raise PeerUnavailable(f"no channel to {peer!r}")
        except zmq.Again as err:
            raise PeerUnavailable(f"{peer!r} is not draining its messages (send queue at the "
                                  f"high-water mark of {self.hwm})") from err
        except zmq.ZMQError as err:
            raise PeerUnavailable(f"cannot send to {peer!r}: {err}") from err

    def _flush_outbox(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return
            if callable(item):
                try:
                    item()
                except Exception:
                    log.exception("%s: call_soon callback failed", self.name)
                continue
            peer, frames = item
            try:
                self._send_frames(peer, frames)
            except PeerUnavailable as err:
                log.warning("%s: dropped message to %s: %s", self.name, peer, err)

    def recv(self, timeout_s: float = 0.0) -> Envelope | None:
        self._owner = threading.get_ident()
        deadline = time.monotonic() + timeout_s
        while True:
            if self._redial:
                self._redial_due()
            if self._pending:
                return self._pending.pop(0)
            left = max(deadline - time.monotonic(), 0.0)
            if self._redial:
                left = min(left, max(min(self._redial.values()) - time.monotonic(), 0.0))
            events = dict(self.poller.poll(math.ceil(left * 1000)))  # never spin below 1 ms
            if not events and time.monotonic() >= deadline:
                if self._redial:
                    self._redial_due()
                return None
            for sock in events:
                self._service(sock)

    def _service(self, sock) -> None:
        if sock == self._wake_r:
            self._flush_outbox()
        elif sock is self.router:
            while True:
                try:
                    parts = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
                self._on_router(parts[0].bytes.decode(errors="replace"), parts[1:])
        elif sock in self._monitors:
            peer = self._monitors[sock]
            try:
                event = recv_monitor_message(sock, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            info = self.dealer_peers.get(peer)
            if info is None:
                return
            if event & _HANDSHAKE_FAILED:
                # ZMQ drops this connection for good: dial it anew soon (the peer may learn
                # our key from a newer roster meanwhile)
                self.num_failed_handshakes += 1
                info.acked = False
                # logged once until the peer takes us (a new peer may refuse us for a while)
                (log.debug if peer in self._failing else log.warning)(
                    "%s: handshake with %s at %s failed (%s); dialling again every %.1f s",
                    self.name, peer, info.endpoint, zmq.Event(event).name, REDIAL_AFTER_S)
                self._failing.add(peer)
                self._redial[peer] = time.monotonic() + REDIAL_AFTER_S
                return
            if event == zmq.EVENT_DISCONNECTED:
                info.acked = False  # not ready until the peer acknowledges Hello again
                # ZMQ reconnects by itself after a lost connection, but not after a protocol
                # error (e.g. a message part over ZMQ_MAXMSGSIZE): dialled anew unless it has
                # reconnected by then
                self._redial.setdefault(peer, time.monotonic() + REDIAL_IF_LOST_S)
                if self.on_disconnect:
                    self.on_disconnect(peer)
                return
            self._redial.pop(peer, None)  # connected again
            info.num_connects += 1
            if info.num_connects > 1:  # a reconnect: the peer may be new, say Hello again
                info.acked = False
                try:
                    self.dealers[peer].send_multipart(encode(self.hello()), flags=zmq.NOBLOCK)
                except zmq.ZMQError as err:  # not draining: the next reconnect says it again
                    log.warning("%s: Hello to %s not sent: %s", self.name, peer, err)
        else:
            peer = next((p for p, s in self.dealers.items() if s is sock), None)
            if peer is None:
                return
            while True:
                try:
                    parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
                self._on_dealer(peer, parts)

    def _redial_due(self) -> None:
        """Dial anew every peer whose handshake failed and whose wait is over."""
        now = time.monotonic()
        for peer, when in list(self._redial.items()):
            if when > now:
                continue
            del self._redial[peer]
            info = self.dealer_peers.get(peer)
            if info is None:
                continue
            endpoint, role = info.endpoint, self._expected_roles.get(peer, "")
            self.disconnect(peer)
            self.connect(peer, endpoint, role)

    def _error(self, peer: str, text: str) -> None:
        self.num_protocol_errors += 1
        log.warning("%s: protocol error from %s: %s", self.name, peer, text)
        self._pending.append(Envelope(peer, ProtocolError(text, peer=peer)))

    def _decode(self, peer: str, frames: list) -> Envelope | None:
        """The decoded envelope, or None after queueing (and counting) a malformed one."""
        env = decode_envelope(peer, frames)
        if env.is_error:
            self.num_protocol_errors += 1
            self._pending.append(env)
            return None
        return env

    def _on_router(self, peer: str, frames: list) -> None:
        env = self._decode(peer, frames)
        if env is None:
            return
        msg = env.msg
        if isinstance(msg, Hello):
            why = hello_refusal(msg, peer, self.model, role=self.role,
                                draft_method=self.draft_method)
            if not why and self.hello_check is not None:
                why = self.hello_check(peer, msg)
            ack = HelloAck(accepted=not why, protocol_version=PROTOCOL_VERSION, role=self.role,
                           instance_id=self.name, incarnation=self.incarnation,
                           model=self.model, draft_method=self.draft_method, error=why)
            try:
                self.router.send_multipart([peer.encode()] + encode(ack), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            if why:
                self.accepted.pop(peer, None)
                self._error(peer, f"Hello refused: {why}")
                return
            old = self.accepted.get(peer)
            info = PeerInfo(peer, msg.role, msg.incarnation)
            self.accepted[peer] = info
            if self.on_hello:
                self.on_hello(info, old is None or old.incarnation != msg.incarnation)
            return
        if peer not in self.accepted:
            self._error(peer, f"{type(msg).__name__} before Hello")
            return
        self._pending.append(env)

    def _on_dealer(self, peer: str, frames: list) -> None:
        env = self._decode(peer, frames)
        if env is None:
            return
        msg = env.msg
        if isinstance(msg, HelloAck):
            info = self.dealer_peers[peer]
            if not msg.accepted:
                self.refused[peer] = msg.error
                self._error(peer, f"our Hello was refused: {msg.error}")
                return
            why = ack_refusal(msg, peer, role=self.role, model=self.model,
                              draft_method=self.draft_method,
                              peer_role=self._expected_roles.get(peer, ""))
            if why:
                info.acked = False
                self.refused[peer] = f"we refused its HelloAck: {why}"
                self._error(peer, f"HelloAck refused: {why}")
                return
            self.refused.pop(peer, None)
            self._failing.discard(peer)
            is_new = info.incarnation != msg.incarnation
            info.role, info.incarnation, info.acked = msg.role, msg.incarnation, True
            if self.on_hello:
                self.on_hello(info, is_new)
            return
        if peer in self.refused:
            self._error(peer, f"{type(msg).__name__} from a peer whose handshake failed "
                              f"({self.refused[peer]})")
            return
        self._pending.append(env)

    def close(self) -> None:
        """Close every socket and the wake pipe; a second call does nothing."""
        if self.router.closed:
            return
        for peer in list(self.dealers):
            self.disconnect(peer)
        self.poller.unregister(self.router)
        self.router.close(0)
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self.auth is not None:  # the ZAP thread, then the context this mailbox owns
            self.auth.stop()
            self.ctx.destroy(linger=0)
